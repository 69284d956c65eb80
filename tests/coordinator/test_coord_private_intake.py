"""The coordinator's intake in a private round (docs/reference/private-fields.md): an update that still
reports an evaluation, a loss or its sample count (a device of an earlier release, or one that ignores the
rules) is folded for its values alone -- the round record shows no accuracy, no loss and no device's
accuracy. The coordinator runs its own loop without a broker (fake clock, chunks delivered as the broker
would)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from flayer.update import TensorDelta, Update
from protocol import Kind, SigningKey, Status, Topics, UpdateHeader, chunk_blob, encode_update
from protocol.metrics_schema import read_metrics
from transport.credentials import Credentials
from transport.link import Received

DEVICES = ["dev-0", "dev-1"]
CREDS = Credentials("utest", "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())
KEYS = {d: SigningKey.generate() for d in DEVICES}  # the devices' keys, as the broker's registry holds them


def _run(tmp: Path, private: bool) -> dict[str, Any]:
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 2", "quorum = 2",
             "over_selection = 1.0", "deadline_s = 60.0", "grace_s = 0.0", "extend_s = 0.0",
             "[run]", 'strategy = "fedavg"', "rounds = 1", "seed = 3", "[data]", 'dataset = "digits"']
    if private:
        lines += ["[privacy]", "enabled = true", "population = 2", "clip = 0.5", "noise_multiplier = 1.0",
                  "delta = 0.01"]
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    now = [1000.0]
    c = Coordinator(load_coordinator_config(tmp / "federation.toml"), CREDS, clock=lambda: now[0])
    setattr(c.publishing, "model", lambda round_, rnd: setattr(c.publishing, "chunks", 1))  # noqa: B010 -- no broker
    setattr(c.publishing, "publish_plan", lambda phase, rnd, cal=None: 0)  # noqa: B010
    setattr(c.publishing.publisher, "clear_old_models", lambda: 0)  # noqa: B010
    setattr(c.inbox, "ack", lambda *a, **k: None)  # noqa: B010
    c.cfg.state_dir.mkdir(parents=True, exist_ok=True)
    c.cycle.restore()
    c.device_keys.path, c.device_keys.keys = None, {d: k.public for d, k in KEYS.items()}
    for d in DEVICES:
        c.registry.observe(d, Status(0, "online", now[0]), now[0])
    c._tick()
    assert c.open is not None and c.model is not None
    rng = np.random.default_rng(0)
    for dev in DEVICES:  # each reports what a private round must not record
        deltas = {k: TensorDelta(s, (rng.standard_normal(int(np.prod(s))) * 1e-3).astype(np.float32))
                  for k, s in c.open.aggregate.shapes.items()}
        up = Update(deltas, 57, {"test_correct": 30.0, "test_total": 40.0, "train_loss": 0.7})
        blob = encode_update(up, UpdateHeader("utest", 1, dev, c.model.digest))
        for k, payload in enumerate(chunk_blob(blob, Kind.UPDATE_CHUNK, "utest", dev, 1, 1 << 20, key=KEYS[dev])):
            c.intake.on_message(Received(Topics("utest").update_chunk(dev, 1, k), payload, False))
    now[0] += 1.0
    c._tick()
    setattr(c, "_shut_down", lambda: None)  # noqa: B010
    c.metrics.close()
    (rec,) = [r for r in read_metrics(tmp / "coord" / "metrics.jsonl") if r["kind"] == "round"]
    assert rec["accepted"] == 2
    return rec


def test_a_private_round_records_no_evaluation_a_device_reports(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    plain = _run(tmp_path / "plain", private=False)
    assert plain["acc"] == 0.75 and plain["train_loss"] == 0.7  # the same reports, recorded without privacy
    (tmp_path / "private").mkdir()
    rec = _run(tmp_path / "private", private=True)
    assert rec["acc"] is None and rec["train_loss"] is None and all(d["acc"] is None for d in rec["devices"])
