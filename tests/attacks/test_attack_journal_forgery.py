"""A device that hides a journal record inside its own update (docs/explanation/security.md, "No acknowledged
update is lost"; coordinator.journal).

The coordinator journals every accepted update, the device's bytes included, before it folds and acknowledges it,
and after a crash it resynchronises past a damaged record on the next intact one. The adversary is a selected
device: it shapes the values of its upload as a complete journal record -- an update under another device's id,
or a plan -- and waits for its own record to be torn (the coordinator killed while appending it; a large upload
widens the window) or for a bit to flip in its length. Before the defence replay then read the planted record as
the other device's update (folded as that device's, its real update a duplicate) or as a plan (the resumed
round's cohort). The guarantee: records are authenticated with a key the coordinator keeps in its state folder,
so nothing a device planted is ever read as a record, by the current format or the earlier one.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from coordinator.journal import KIND_PLAN, KIND_UPDATE, Journal, _update_payload, journal_path, read_journal


def _planted(kind: int, payload: bytes) -> list[bytes]:
    """What the device can put in its blob: a legacy CRC record, and current-format records under keys it guesses."""
    import hashlib
    import hmac

    legacy = struct.pack("<4sBII", b"FLJR", kind, len(payload), zlib.crc32(bytes([kind]) + payload)) + payload
    out = [legacy]
    for guess in (bytes(32), b"\xff" * 32):
        mac = hmac.new(guess, struct.pack("<BI", kind, len(payload)) + payload, hashlib.sha256).digest()
        out.append(struct.pack("<4sBI32s", b"FLJ2", kind, len(payload), mac) + payload)
    return out


@pytest.mark.parametrize("damage", ["torn", "length bit"])
@pytest.mark.parametrize("kind", [KIND_UPDATE, KIND_PLAN])
def test_a_record_planted_in_an_update_is_never_replayed(tmp_path: Path, damage: str, kind: int) -> None:
    forged = _update_payload("dev-b", 3, b"not what dev-b sent")[0] if kind == KIND_UPDATE else b"forged plan"
    for n, planted in enumerate(_planted(kind, forged)):
        folder = tmp_path / f"{damage}-{kind}-{n}"
        j = Journal(folder, 3)
        j.append_plan(b"the real plan")
        j.append_update("dev-c", 3, b"an honest update")
        start = journal_path(folder, 3).stat().st_size
        j.append_update("dev-a", 3, b"\x00" * 64 + planted + b"\x00" * 64)  # the device's own bytes
        j.close()
        path = journal_path(folder, 3)
        data = bytearray(path.read_bytes())
        if damage == "torn":  # the coordinator died while appending dev-a's record: its last bytes never written
            data = data[:len(data) - 32]
        else:  # one bit of dev-a's length flipped
            data[start + 5] ^= 0x40
        path.write_bytes(bytes(data))
        replay = read_journal(path)
        assert [r.client for r in replay.updates] == ["dev-c"], f"{planted[:4]!r}: replayed {replay.updates}"
        assert replay.plans == [b"the real plan"], f"{planted[:4]!r}: replayed plans {replay.plans}"
