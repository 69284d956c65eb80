"""The coordinator's view of 'flayer broker revoke': revoked.json, re-read when it changes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from coordinator.revocations import RevocationList


def test_the_list_follows_the_file_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = tmp_path / "revoked.json"
    now = [0.0]
    rl = RevocationList(path, min_interval_s=1.0, clock=lambda: now[0])
    assert "dev-1" not in rl  # no file: nobody revoked
    path.write_text(json.dumps({"dev-1": 1.0}))
    assert "dev-1" not in rl.refresh()  # read at most every min_interval_s
    now[0] = 2.0
    assert rl.refresh() == {"dev-1"} and "dev-1" in rl
    path.write_text("{not json")
    os.utime(path, (5, 5))
    now[0] = 4.0
    assert rl.refresh() == {"dev-1"}  # a malformed file keeps the last good list
    path.write_text(json.dumps({"dev-1": 1.0, "dev-2": 3.0}))
    now[0] = 6.0
    assert rl.refresh() == {"dev-1", "dev-2"}
    assert RevocationList(None).refresh() == frozenset()


def test_a_round_stops_waiting_for_a_device_revoked_while_it_is_open(tmp_path: Path) -> None:
    """'flayer broker revoke' while a round waits for all three selected devices (quorum 3): once the coordinator
    reads the list (at the next message it receives), the revoked device is no longer online -- no stage of a
    secure round waits for it -- and the round closes when the other two are in, not at its deadline."""
    import numpy as np

    from coordinator.config import load_coordinator_config
    from coordinator.server import Coordinator
    from flayer.update import TensorDelta, Update
    from protocol import (
        Kind,
        SigningKey,
        Status,
        Topics,
        UpdateHeader,
        chunk_blob,
        encode_message,
        encode_update,
    )
    from transport.credentials import Credentials
    from transport.link import Received

    fed, devices = "revfed", ["dev-0", "dev-1", "dev-2"]
    keys = {d: SigningKey.generate() for d in devices}
    creds = Credentials(fed, "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                        signing_key=SigningKey.generate().private_text())
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 3", "quorum = 3",
             "deadline_s = 60.0", "grace_s = 0.0", 'revoked_file = "revoked.json"', "[run]", 'strategy = "fedavg"',
             "rounds = 2", "[data]", 'dataset = "digits"']
    (tmp_path / "federation.toml").write_text("\n".join(lines) + "\n")
    now = [1000.0]
    c = Coordinator(load_coordinator_config(tmp_path / "federation.toml"), creds, clock=lambda: now[0])
    plans: list[object] = []  # no broker: what it would publish is recorded, acks dropped
    setattr(c.publishing, "model", lambda round_, rnd: setattr(c.publishing, "chunks", 1))  # noqa: B010
    setattr(c.publishing, "publish_plan", lambda phase, rnd, cal=None: plans.append(phase))  # noqa: B010

    def plan_out(plan: object) -> int:
        plans.append(plan)
        return 0

    setattr(c.publishing.publisher, "plan", plan_out)  # noqa: B010
    setattr(c.inbox, "ack", lambda *a, **k: None)  # noqa: B010
    c.cfg.state_dir.mkdir(parents=True, exist_ok=True)
    c.cycle.restore()
    c.device_keys.path = None
    c.device_keys.keys = {d: k.public for d, k in keys.items()}
    topics = Topics(fed)

    def status(dev: str) -> None:  # a heartbeat, as the device publishes it
        payload = encode_message(Status(1, "online", now[0]), fed, dev, key=keys[dev])
        c.intake.on_message(Received(topics.status(dev), payload, False))

    def upload(dev: str, round_: int) -> None:
        shapes = dict(c.open.aggregate.shapes)  # type: ignore[union-attr]
        deltas = {k: TensorDelta(tuple(s), np.full(int(np.prod(s)), 1e-4, np.float32)) for k, s in shapes.items()}
        blob = encode_update(Update(deltas, 10), UpdateHeader(fed, round_, dev, c.model.digest))  # type: ignore[union-attr]
        for k, chunk in enumerate(chunk_blob(blob, Kind.UPDATE_CHUNK, fed, dev, round_, 100_000, key=keys[dev])):
            c.intake.on_message(Received(topics.update_chunk(dev, round_, k), chunk, False))

    try:
        for d in devices:
            status(d)
        c._tick()
        rnd = c.open
        assert rnd is not None and rnd.number == 1 and sorted(rnd.selected) == devices
        upload("dev-0", 1)
        upload("dev-1", 1)
        c._tick()
        assert c.open is rnd  # quorum 3: dev-2 is waited for
        (tmp_path / "revoked.json").write_text(json.dumps({"dev-2": now[0]}))
        now[0] += 1.0
        time.sleep(0.6)  # the list is read at most twice a second (RevocationList.min_interval_s)
        assert c.registry.is_online("dev-2", now[0]) is False  # gone: a secure round's stages stop waiting for it
        status("dev-0")  # any message: the intake reads the list again
        c._tick()
        assert c.open is not rnd, "the round still waits for the revoked device (its deadline is 59 s away)"
        record = c.history[-1]
        assert record["round"] == 1 and record["accepted"] == 2 and "revoked" in record["closed"], record
        assert "dev-2" not in c.online(now[0])
    finally:
        setattr(c, "_shut_down", lambda: None)  # noqa: B010
        c.metrics.close()
