"""Journal: what is appended is replayed; a torn tail at any byte is ignored and cut before appending;
a corrupt record before the tail is skipped and counted; old journals are pruned."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from coordinator.journal import Journal, journal_path, prune_journals, read_journal


def _fill(folder: Path, round_: int = 3) -> tuple[Path, list[tuple[str, bytes]]]:
    j = Journal(folder, round_)
    j.append_plan(b"plan-bytes")
    updates = [(f"dev-{i}", os.urandom(50 + 37 * i)) for i in range(4)]
    for client, blob in updates:
        digest = j.append_update(client, round_, blob)
        assert digest == hashlib.sha256(blob).hexdigest()
    j.close()
    return journal_path(folder, round_), updates


def test_round_trip(tmp_path: Path) -> None:
    path, updates = _fill(tmp_path)
    replay = read_journal(path)
    assert replay.plan == b"plan-bytes"
    assert [(r.client, r.data) for r in replay.updates] == updates
    assert all(r.round == 3 and r.digest == hashlib.sha256(r.data).hexdigest() for r in replay.updates)
    assert replay.torn_bytes == 0 and replay.corrupt == 0 and replay.good_bytes == path.stat().st_size


HEAD = 41  # magic, kind, length, HMAC-SHA256 (coordinator.journal)


def test_torn_tail_at_every_byte_of_the_last_record(tmp_path: Path) -> None:
    path, updates = _fill(tmp_path)
    full = path.read_bytes()
    last = len(updates[-1][1]) + HEAD + len(updates[-1][0]) + 37  # header + payload of the last record
    start = len(full) - last
    for cut in range(start + 1, len(full)):
        path.write_bytes(full[:cut])
        replay = read_journal(path)
        assert [r.client for r in replay.updates] == [c for c, _ in updates[:-1]], cut
        assert replay.good_bytes == start and replay.torn_bytes == cut - start


def test_appending_after_a_torn_tail_cuts_it_first(tmp_path: Path) -> None:
    path, updates = _fill(tmp_path)
    path.write_bytes(path.read_bytes()[:-5])
    j = Journal(tmp_path, 3)
    j.append_update("dev-9", 3, b"after the crash")
    j.close()
    replay = read_journal(path)
    assert [r.client for r in replay.updates] == ["dev-0", "dev-1", "dev-2", "dev-9"]
    assert replay.torn_bytes == 0


def test_corrupt_record_before_the_tail_is_skipped(tmp_path: Path) -> None:
    path, updates = _fill(tmp_path)
    data = bytearray(path.read_bytes())
    # flip a byte inside the second update's blob (after plan record and first update record)
    first = HEAD + len(b"plan-bytes") + HEAD + 1 + 5 + 4 + 32 + len(updates[0][1])
    data[first + HEAD + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    replay = read_journal(path)
    assert replay.corrupt == 1
    assert [r.client for r in replay.updates] == ["dev-0", "dev-2", "dev-3"]


def test_garbage_is_not_a_journal(tmp_path: Path) -> None:
    path = journal_path(tmp_path, 1)
    path.write_bytes(b"not a journal at all")
    replay = read_journal(path)
    assert replay.plan is None and replay.updates == [] and replay.torn_bytes == len(b"not a journal at all")


@pytest.mark.parametrize("keep, left", [(1, [5]), (3, [3, 4, 5])])
def test_prune(tmp_path: Path, keep: int, left: list[int]) -> None:
    for r in range(1, 6):
        Journal(tmp_path, r).close()
    (tmp_path / "other.txt").write_text("kept")
    prune_journals(tmp_path, done_round=5, keep=keep)
    assert sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("round-*.jnl")) == left
    assert (tmp_path / "other.txt").exists()
