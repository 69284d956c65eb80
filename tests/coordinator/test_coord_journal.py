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
    path, _updates = _fill(tmp_path)
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


def test_read_updates_reads_each_client_s_first_record_where_it_was_appended(tmp_path: Path) -> None:
    from coordinator.journal import JournalError

    j = Journal(tmp_path, 3)
    j.append_plan(b"plan-bytes")
    for client, blob in (("dev-a", b"a" * 300), ("dev-b", b"b first"), ("dev-c", b"c" * 99), ("dev-b", b"b again")):
        j.append_update(client, 3, blob)
    assert [(r.client, r.data) for r in j.read_updates(["dev-c", "dev-b", "dev-x", "dev-c"])] == \
        [("dev-c", b"c" * 99), ("dev-b", b"b first")]  # each once, the first; one without a record left out
    at, size = j._where["dev-a"]
    data = bytearray(journal_path(tmp_path, 3).read_bytes())
    data[at + size - 7] ^= 1  # a bit of dev-a's record flips on disk
    journal_path(tmp_path, 3).write_bytes(bytes(data))
    with pytest.raises(JournalError, match=f"byte {at} does not authenticate"):
        list(j.read_updates(["dev-a"]))
    assert [r.data for r in j.read_updates(["dev-c"])] == [b"c" * 99]  # the others are still read
    j._where["dev-c"] = j._where["dev-b"]  # an offset that holds another client's record
    with pytest.raises(JournalError, match="'dev-b''s update, not 'dev-c''s"):
        list(j.read_updates(["dev-c"]))
    j.close()


def test_a_journal_reopened_on_a_file_with_updates_finds_them_in_one_streaming_pass(tmp_path: Path) -> None:
    import struct

    from coordinator.journal import JournalError, _encode, _update_payload, scan_updates

    j = Journal(tmp_path, 3)
    j.append_plan(b"plan-bytes")
    j.append_update("dev-b", 3, b"b's own")
    planted = _encode(2, _update_payload("dev-c", 3, b"planted as c's")[0], bytes(32))  # under a guessed key
    j.append_update("dev-a", 3, b"\0" * 9 + planted + b"\0" * 9)  # a device's bytes shaped as a record
    j.append_update("dev-c", 3, b"c's own")
    j.close()
    j = Journal(tmp_path, 3)  # the index covers none of the file's records: read_updates scans
    assert not j.indexed
    assert {r.client: r.data for r in j.read_updates(["dev-c", "dev-b"])} == {"dev-c": b"c's own", "dev-b": b"b's own"}
    j.append_update("dev-d", 3, b"d's own")
    assert [r.data for r in j.read_updates(["dev-d"])] == [b"d's own"]
    j.close()
    path = journal_path(tmp_path, 3)
    key = (tmp_path / ".key").read_bytes()
    data = bytearray(path.read_bytes())
    at = 41 + len(b"plan-bytes")  # dev-b's record
    data[at + 60] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match=f"byte {at} does not authenticate"):
        list(scan_updates(path, key, ["dev-c"]))  # never resynchronised past a damaged record
    path.write_bytes(bytes(data[:at]) + struct.pack("<4sBI", b"FLJ2", 2, 1 << 30))  # a torn tail: the pass ends
    assert list(scan_updates(path, key, ["dev-c"])) == []
