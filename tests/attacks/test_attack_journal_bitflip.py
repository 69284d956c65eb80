"""A flipped bit in an early journal record's length (docs/explanation/guarantees.md, "No acknowledged update is
lost"; docs/howto/stop-resume.md, "Resume").

The adversary is the storage under the coordinator's state folder (design, move 5: abuse recovery paths, torn
tails): after the coordinator journaled a round's plan and three acknowledged updates, one bit of the first
update's length field flips, so that record's end is wrong (past the end of the file, or inside the next record).
The coordinator restarts over the folder: it opens the round's journal (:class:`coordinator.journal.Journal`, which
cuts a torn tail before appending) and replays it. The guarantee: the damaged record is skipped and counted, the
two acknowledged updates after it are replayed, and nothing readable is cut from the journal -- not even the
damaged bytes, which are kept beside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.journal import _HEAD, Journal, journal_path, read_journal

LENGTH_AT = 5  # "FLJR", then the kind byte, then the u32 length


@pytest.mark.parametrize("bit", [3, 27])  # the end lands inside the next record / far past the end of the file
def test_a_flipped_length_bit_drops_no_acknowledged_update_after_it(tmp_path: Path, bit: int) -> None:
    folder = tmp_path / "journal"
    j = Journal(folder, 4)
    j.append_plan(b"the plan of round 4")
    starts = []
    for i, dev in enumerate(["dev-a", "dev-b", "dev-c"]):
        starts.append(journal_path(folder, 4).stat().st_size)
        j.append_update(dev, 4, bytes([i]) * (100 + 40 * i))  # acknowledged once this returns
    j.close()
    path = journal_path(folder, 4)
    data = bytearray(path.read_bytes())
    data[starts[0] + LENGTH_AT + bit // 8] ^= 1 << (bit % 8)  # the storage flips one bit
    path.write_bytes(bytes(data))
    size = len(data)

    Journal(folder, 4).close()  # the restarted coordinator opens the round's journal to append
    replay = read_journal(path)
    assert [u.client for u in replay.updates] == ["dev-b", "dev-c"], "acknowledged updates after the damage were lost"
    assert replay.corrupt == 1 and replay.plan == b"the plan of round 4"
    assert path.stat().st_size == size, "the journal was cut although intact records follow the damage"
    assert not list(folder.glob("*.cut-*"))


def test_a_torn_tail_is_cut_but_kept_beside_the_journal(tmp_path: Path) -> None:
    """The control: a record torn by a crash mid-append (never acknowledged) is still cut before appending, and its
    bytes are kept aside, not dropped."""
    folder = tmp_path / "journal"
    j = Journal(folder, 2)
    j.append_update("dev-a", 2, b"x" * 50)
    j.close()
    path = journal_path(folder, 2)
    whole = path.read_bytes()
    torn = b"FLJ2\x02" + (500).to_bytes(4, "little") + b"\0" * 32 + b"partial"
    path.write_bytes(whole + torn)
    Journal(folder, 2).close()
    assert path.read_bytes() == whole
    (kept,) = folder.glob("*.cut-*")
    assert kept.name == f"{path.name}.cut-{len(whole)}" and kept.read_bytes() == torn
    assert len(torn) > _HEAD.size
