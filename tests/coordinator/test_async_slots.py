"""Asynchronous rounds, the coordinator's bookkeeping as units: training slots (bound, expiry, release,
offline, restore after a restart), the pace of plan changes, one update per device per buffer, the
derived ("auto") settings, one device's share of the norm history, and I/O errors on the state folder
raised with the file's name (docs/explanation/async-rounds.md)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from coordinator.async_rounds import PlanPacer, Slots
from coordinator.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from coordinator.config import FederationSettings
from coordinator.guard import NormHistory, Quarantine
from coordinator.journal import Journal, JournalError, journal_path, read_journal
from coordinator.metrics import MetricsLog
from coordinator.result import StateWriteError
from flayer.config import ConfigError, from_mapping
from flayer.engine.versions import AsyncSettings, VersionWindow, resolve_async
from protocol.metrics_schema import run_record

ONLINE = [f"dev-{i}" for i in range(6)]


def _slots(concurrency: int, hold_s: float = 60.0) -> Slots:
    return Slots(AsyncSettings(buffer=2, max_staleness=4, concurrency=concurrency), seed=0, hold_s=hold_s)


# ---- slots ----------------------------------------------------------------------------------------


def test_fill_stops_at_concurrency_and_zero_means_every_device_online() -> None:
    s = _slots(3)
    first = s.fill(ONLINE, (), 1, 0.0)
    assert len(first) == 3 and set(s.held) == set(first)
    assert s.fill(ONLINE, (), 1, 1.0) == []  # full: nobody else
    every = _slots(0)
    assert sorted(every.fill(ONLINE, (), 1, 0.0)) == ONLINE


def test_fill_is_seeded_and_skips_devices_already_in_the_buffer() -> None:
    a, b = _slots(2), _slots(2)
    assert a.fill(ONLINE, (), 1, 0.0) == b.fill(ONLINE, (), 1, 0.0)  # same seed, version, count: same draw
    s = _slots(0)
    got = s.fill(ONLINE, {"dev-0", "dev-3"}, 1, 0.0)
    assert sorted(got) == ["dev-1", "dev-2", "dev-4", "dev-5"]


def test_release_frees_one_slot_for_another_device() -> None:
    s = _slots(2)
    held = s.fill(ONLINE[:3], (), 1, 0.0)
    assert s.release(held[0]) and not s.release(held[0])  # released once; a second time is a no-op
    new = s.fill(ONLINE[:3], {held[0]}, 1, 1.0)  # its update is in the buffer: the slot goes to the third
    assert new == sorted(set(ONLINE[:3]) - set(held)) and len(s.held) == 2


def test_expiry_frees_slots_held_past_hold_s() -> None:
    s = _slots(0, hold_s=10.0)
    s.fill(["dev-0"], (), 1, 0.0)
    s.fill(["dev-0", "dev-1"], (), 1, 5.0)
    assert s.expire(9.9) == []
    assert s.expire(10.0) == ["dev-0"] and list(s.held) == ["dev-1"]
    assert s.expire(15.0) == ["dev-1"] and not s.held


def test_offline_holders_lose_their_slots() -> None:
    s = _slots(0)
    s.fill(["dev-0", "dev-1"], (), 1, 0.0)
    assert s.drop_offline(["dev-1"]) == ["dev-0"] and list(s.held) == ["dev-1"]


def test_restore_keeps_restored_holders_until_seen_offline_or_expired() -> None:
    s = _slots(2, hold_s=30.0)
    s.restore(["dev-4", "dev-1", "dev-2"], 100.0)  # more than concurrency (an older run's plan): two kept
    assert sorted(s.held) == ["dev-1", "dev-2"]
    assert s.drop_offline([]) == []  # nobody heard from yet (a fresh registry): they keep their slots
    assert s.fill(ONLINE, (), 3, 100.0) == []  # and the bound holds: no slot for anyone else
    assert s.drop_offline(["dev-1"]) == []  # dev-1 seen online
    assert s.drop_offline([]) == ["dev-1"]  # ... then gone: an ordinary holder again
    assert s.drop_offline([], offline={"dev-2"}) == ["dev-2"]  # heard from, not online: freed
    s.restore(["dev-5"], 100.0)
    assert s.expire(130.0) == ["dev-5"] and not s.unseen


# ---- plan pace ------------------------------------------------------------------------------------


def test_plan_changes_are_coalesced_and_bounded_per_version() -> None:
    p = PlanPacer(buffer=2, interval_s=1.0)  # budget 2 x 2 + 4 = 8
    p.opened(1, 0.0)
    assert not p.may(0.5)  # within the interval of the opening plan
    changes = 0
    t = 1.0
    while t < 100.0:
        if p.may(t):
            p.changed(t)
            changes += 1
        t += 0.25
    assert changes == p.budget == 8
    p.renew()  # the buffer's deadline was extended: a new period
    assert p.may(100.0)
    p.opened(2, 100.0)
    assert p.left == 8 and not p.may(100.5) and p.may(101.0)


# ---- one update per device per buffer -------------------------------------------------------------


def test_one_update_per_device_per_buffer() -> None:
    w = VersionWindow(max_staleness=8)
    for v in range(1, 6):
        w.publish(v, f"{v:064x}")
        w.offer(["dev-a", "dev-b"])  # dev-a is offered every version: it holds updates trained from each
    assert w.screen("dev-a", 1) is None
    w.fold("dev-a", 1)
    for base in (2, 3, 4, 5):  # the others it trained are refused: one per buffer
        v = w.screen("dev-a", base)
        assert v is not None and v.counter == "in_buffer" and v.status == "late", base
    again = w.screen("dev-a", 1)
    assert again is not None and again.counter == "duplicate"  # the same update re-sent: idempotent
    assert w.screen("dev-b", 3) is None  # others are not affected
    w.publish(6, "6" * 64)  # the next version's buffer: dev-a may contribute again
    assert w.screen("dev-a", 5) is None


# ---- derived settings -----------------------------------------------------------------------------


def test_auto_settings_follow_the_buffer_and_over_selection() -> None:
    a, how = resolve_async(8, "auto", "sqrt", "auto", 1.3)  # the demo fleet's
    assert (a.concurrency, a.max_staleness) == (11, 33)
    assert "ceil(over_selection 1.3 x buffer 8) = 11" in how["concurrency"] and "= 33" in how["max_staleness"]
    explicit, how = resolve_async(8, 5, "sqrt", 3, 1.3)
    assert (explicit.concurrency, explicit.max_staleness, how) == (3, 5, {})
    every, _ = resolve_async(4, "auto", "sqrt", 0, 1.0, fleet=20)  # every device online: the fleet's 20
    assert (every.concurrency, every.max_staleness) == (0, 120)
    small, _ = resolve_async(8, "auto", "sqrt", 0, 1.3, fleet=3)
    assert small.max_staleness == 9  # ceil(24 x 3 / 8)


def test_federation_settings_take_auto_or_numbers() -> None:
    fs = from_mapping(FederationSettings, {"credentials": "c", "mode": "async", "buffer": 8}, "[federation]")
    assert (fs.max_staleness, fs.concurrency) == ("auto", "auto")
    r = fs.resolved()
    assert (r.max_staleness, r.concurrency) == (33, 11) and fs.async_settings.concurrency == 11
    fixed = from_mapping(FederationSettings, {"credentials": "c", "max_staleness": 32, "concurrency": 0}, "f")
    assert fixed.resolved() == fixed
    with pytest.raises(ConfigError, match="max_staleness"):
        from_mapping(FederationSettings, {"credentials": "c", "max_staleness": "many"}, "[federation]")
    with pytest.raises(ConfigError, match="concurrency"):
        from_mapping(FederationSettings, {"credentials": "c", "concurrency": -1}, "[federation]")


def test_run_record_carries_the_resolved_settings(tmp_path: Path) -> None:
    a, how = resolve_async(8, "auto", "sqrt", "auto", 1.3)
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write(run_record("coordinator", 0.0, "fedavg", 3, None, asynchronous={"concurrency": a.concurrency,
                                                                              "auto": how}))
    log.close()
    assert '"concurrency": 11' in (tmp_path / "m.jsonl").read_text()


# ---- the norm history -----------------------------------------------------------------------------


def test_one_device_cannot_fill_the_norm_history() -> None:
    g = {"w": torch.ones(4)}
    h = NormHistory(10.0, window=8, warmup=2)  # a device keeps at most 8 // 4 = 2 norms
    for _ in range(20):
        h.add([1000.0], ["dev-evil"])  # folded into every version, with norms just under each bound
    h.add([1.0, 1.2, 0.8], ["dev-a", "dev-b", "dev-c"])
    assert h.clients.count("dev-evil") == h.share == 2
    assert h.bound(None, g) == pytest.approx(10.0 * 1.2)  # median of (0.8, 1, 1.2, 1000, 1000)
    plain = NormHistory(10.0, window=8, warmup=2)
    plain.add([3.0, 2.0, 100.0, 4.0])  # norms whose devices are not known: the old rules
    assert plain.norms == [3.0, 2.0, 100.0, 4.0]


def test_checkpoint_keeps_whose_norms_and_the_slot_holders(tmp_path: Path) -> None:
    state = {"w": torch.zeros(2)}
    ckpt = Checkpoint(3, state, "ab" * 32, {"x": 1}, {}, {}, [1.0, 2.0], {"current": 3, "slots": ["dev-1"]},
                      ["dev-a", "dev-b"])
    save_checkpoint(tmp_path, ckpt)
    back = load_checkpoint(tmp_path, {"x": 1})
    assert back is not None and back.norm_clients == ["dev-a", "dev-b"] and back.window["slots"] == ["dev-1"]
    save_checkpoint(tmp_path, Checkpoint(4, state, "ab" * 32, {"x": 1}, {}, {}, [5.0]))  # whose not given
    back = load_checkpoint(tmp_path, {"x": 1})
    assert back is not None and back.norm_clients == [""]


# ---- I/O errors name the file ---------------------------------------------------------------------


def _enospc(*_: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_journal_append_names_the_file_and_leaves_the_journal_readable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal(tmp_path, 2)
    j.append_plan(b"plan")
    j.append_update("dev-a", 2, b"first update")
    size = journal_path(tmp_path, 2).stat().st_size
    monkeypatch.setattr("coordinator.journal.os.fsync", _enospc)  # written, but the disk is full
    with pytest.raises(JournalError, match=r"round-000002\.jnl.*No space left"):
        j.append_update("dev-b", 2, b"second update")
    monkeypatch.undo()
    j.close()
    path = journal_path(tmp_path, 2)
    assert path.stat().st_size == size  # cut back to where the record began
    replay = read_journal(path)
    assert [r.client for r in replay.updates] == ["dev-a"] and replay.torn_bytes == 0


def test_journal_that_cannot_be_opened_is_a_journal_error(tmp_path: Path) -> None:
    journal_path(tmp_path, 5).mkdir(parents=True)  # a directory where the file must go
    with pytest.raises(JournalError, match=r"round-000005\.jnl"):
        Journal(tmp_path, 5)


def test_checkpoint_quarantine_and_metrics_errors_name_their_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(OSError, match="No space") as exc:
        save_checkpoint(tmp_path, Checkpoint(1, {"w": torch.zeros(2)}, "", {}))
    assert exc.value.filename == str(tmp_path / "checkpoint.safetensors")
    with pytest.raises(OSError) as exc:
        Quarantine(tmp_path).add(1, "dev-a", "ab" * 32, "not finite")
    assert exc.value.filename == str(tmp_path / "quarantine.jsonl")
    monkeypatch.undo()
    monkeypatch.setattr(log._fh, "write", _enospc)
    with pytest.raises(OSError) as exc:
        log.write(run_record("coordinator", 0.0, "fedavg", 1, None))
    assert exc.value.filename == str(tmp_path / "metrics.jsonl")
    err = StateWriteError.of(exc.value, tmp_path)
    assert "metrics.jsonl" in str(err) and "No space left" in str(err) and "resume" in str(err)
