"""The coordinator's asynchronous loop without a broker (publishing recorded, a fake clock): after a
restart the slot holders of the journal's last plan hold their slots again, so no more than
``concurrency`` devices train; and the ``run`` line records the resolved "auto" settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from protocol import SigningKey, Status
from transport.credentials import Credentials

DEVICES = ["dev-a", "dev-b", "dev-c", "dev-d"]
CREDS = Credentials("utest", "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())


def _config(tmp: Path, **fed: Any) -> Any:
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', 'mode = "async"', "buffer = 2",
             "min_devices = 1", "quorum = 1", "deadline_s = 60.0",
             *(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in fed.items()),
             "[run]", 'strategy = "fedavg"', "rounds = 3", "seed = 0", "[data]", 'dataset = "digits"']
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    return load_coordinator_config(tmp / "federation.toml")


class _Offline:
    """A coordinator whose publications are recorded instead of sent (no broker)."""

    def __init__(self, cfg: Any) -> None:
        self.now = 1000.0
        self.coord = Coordinator(cfg, CREDS, clock=lambda: self.now)
        self.plans: list[Any] = []
        c = self.coord
        c.publishing.model = lambda round_, rnd: setattr(c.publishing, "chunks", 1)  # type: ignore[method-assign]
        c.publishing.publish_plan = lambda phase, rnd, cal=None: self.plans.append(  # type: ignore[method-assign]
            c.publishing.plan(phase, rnd, cal))
        c.publishing.publisher.clear_old_models = lambda: 0  # type: ignore[method-assign]
        c.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        c.cycle.restore()

    def online(self, *devices: str) -> None:
        for d in devices:
            self.coord.registry.observe(d, Status(0, "online", self.now), self.now)

    def tick(self, advance: float = 0.0) -> None:
        self.now += advance
        self.coord._tick()

    def close(self) -> None:
        if self.coord.open is not None and self.coord.open.journal is not None:
            self.coord.open.journal.close()
        self.coord.metrics.close()
        self.coord.state_lock.release()  # as a stopped (or killed) coordinator's process would


def test_a_restarted_coordinator_keeps_the_slots_of_its_last_plan(tmp_path: Path) -> None:
    cfg = _config(tmp_path, concurrency=1, max_staleness=4)
    first = _Offline(cfg)
    first.online(*DEVICES)
    first.tick()  # version 1 opens: one slot
    (holder,) = first.coord.versions.slots.held
    assert first.plans[-1].selected == (holder,)
    first.close()  # stopped (or killed) while the holder trains

    again = _Offline(cfg)
    assert set(again.coord.versions.slots.held) == {holder}  # from the journal's last plan
    others = [d for d in DEVICES if d != holder]
    again.online(*others)  # the holder is busy training: its status has not come in yet
    again.tick()  # the replayed version opens again
    for _ in range(5):
        again.tick(2.0)
    assert set(again.coord.versions.slots.held) == {holder}
    assert {p.selected for p in again.plans} == {(holder,)}  # nobody else was given a slot: one trains
    again.online(holder)
    again.tick(2.0)
    assert set(again.coord.versions.slots.held) == {holder}
    again.close()


def test_auto_settings_are_resolved_once_and_recorded(tmp_path: Path) -> None:
    cfg = _config(tmp_path, over_selection=1.3)
    off = _Offline(cfg)
    assert (off.coord.fs.concurrency, off.coord.fs.max_staleness) == (3, 36)  # ceil(1.3 x 2), ceil(24 x 3 / 2)
    assert off.coord.cfg.federation.max_staleness == 36  # what the plans carry
    off.online(*DEVICES)
    off.tick()
    assert len(off.plans[-1].selected) == 3 and off.plans[-1].max_staleness == 36
    off.close()
