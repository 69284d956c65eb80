"""A coordinator that books a device's budget at a label (docs/explanation/privacy.md, "A device's own budget").

The adversary holds the coordinator's credentials and signing key on a real Mosquitto. The device (the real edge
client, over its own connection) has ``[privacy] device_budget`` set: room for two private contributions at z = 1
(q = 1, delta 1e-5). The adversary publishes central-mode plans that select it, each labelled with a large
``noise_multiplier`` while the noise they name is none or next to none:

1. labelled z = 1000, update noise 0 (the coordinator adds no noise at all);
2. labelled z = 1000, update noise 1 (the label a thousand times what it adds);
3. adaptive clipping labelled z = 1 whose clip-bit noise is 1e-9 (the clip bit in effect in the clear);

then honest plans at z = 1. The guarantee: a device counts the noise a plan names, not its label: the
mislabelled plans are refused (``round skipped``) and cost nothing, and the honest ones are counted at z = 1, so
the budget still stops it after two. Before the defence the device contributed to every mislabelled round and
reported ``dp_epsilon 0.0`` with ``dp_at_budget False``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from coordinator.publish import model_blob
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.work import StrategyCache
from flayer.engine import initial_global_state
from flayer.engine.accountant import epsilon_for
from flayer.engine.privacy import RoundPrivacy
from protocol import (
    Ack,
    Kind,
    Plan,
    Status,
    Topics,
    chunk_blob,
    decode_envelope,
    decode_message,
    encode_message,
)
from transport.link import Received

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # about 20 s
DEVICE, DELTA = "dev-0", 1e-5
MISLABELLED = [RoundPrivacy("central", 0.5, 1000.0, 0.0, 1), RoundPrivacy("central", 0.5, 1000.0, 1.0, 1),
               RoundPrivacy("central", 0.5, 1.0, 1.0, 1, adaptive=True, bit_std=1e-9)]
HONEST = RoundPrivacy("central", 0.5, 1.0, 1.0, 1)


def _base(digits: Any, round_: int) -> dict[str, Any]:
    return {"round": round_, "selected": (DEVICE,), "deadline": time.time() + 600, "strategy": "fedavg",
            "options": {}, "model": dataclasses.asdict(digits.model_spec()), "model_digest": "ab" * 32,
            "model_chunks": 1, "model_size": 1, "seed": 5, "rounds": 10, "phase": "train",
            "train": {"lr": 0.05, "batch_size": 10, "local_epochs": 1}}


def test_a_device_books_the_noise_a_plan_names_not_its_label(tmp_path: Path, digits: Any, attack_fed: Any,
                                                             digits_shard: Any) -> None:
    two, three = (epsilon_for([(1.0, 1.0, n)], DELTA) for n in (2, 3))
    shard = digits_shard(0, 3)
    fb = attack_fed([DEVICE], view="coordinator")  # the adversary: the coordinator's own account
    t = fb.coordinator
    topics = Topics(t.federation)
    adversary = fb.listen([f"fl/{t.federation}/update/{DEVICE}/#", f"fl/{t.federation}/status/{DEVICE}"])
    settings = EdgeSettings(state_dir=str(tmp_path / DEVICE), device="cpu", threads=1, heartbeat_s=1.0,
                            ack_timeout_s=30.0, device_budget=(two + three) / 2)
    device = EdgeClient(settings, fb.devices[DEVICE], shard)
    blob = model_blob(initial_global_state(StrategyCache({"device": "cpu"}).get(Plan(**_base(digits, 1))), 5))
    privacies = MISLABELLED + [HONEST] * 3
    outcomes: dict[int, str] = {}
    statuses: list[dict[str, Any]] = []
    try:
        chunks = chunk_blob(blob.blob, Kind.MODEL_CHUNK, t.federation, t.username, 1, t.max_payload, blob.digest,
                            key=t.signer())
        assert adversary.link.publish_all([(topics.model_chunk(blob.digest, i), c, True)
                                           for i, c in enumerate(chunks)], 30)
        device.start()
        for r, rp in enumerate(privacies, start=1):
            plan = Plan(**{**_base(digits, r), "privacy": {**rp.as_plan(), "delta": DELTA},
                           "model_digest": blob.digest, "model_size": blob.size, "model_chunks": len(chunks)})
            assert adversary.link.publish_all([(topics.round(), encode_message(plan, t.federation, t.username,
                                                                               key=t.signer()), True)], 30)

            def answered(ev: Any, r: int = r) -> bool:
                if not isinstance(ev, Received) or not ev.payload:
                    return False
                env = decode_envelope(ev.payload)
                if env.kind == Kind.UPDATE_CHUNK and env.round == r:
                    return True
                if env.kind == Kind.STATUS:
                    st = decode_message(ev.payload)[1]
                    assert isinstance(st, Status)
                    statuses.append(dict(st.info))
                    return st.info.get("skipped_round") == r
                return False

            ev = adversary.next(answered, 90)
            assert ev is not None, f"round {r}: the device neither sent an update nor said it refused"
            env = decode_envelope(ev.payload)
            if env.kind == Kind.STATUS:
                outcomes[r] = f"refused: {decode_message(ev.payload)[1].info['skip_reason']}"  # type: ignore[union-attr]
                continue
            outcomes[r] = "update"
            adversary.link.publish(topics.ack(DEVICE), encode_message(Ack(r, DEVICE, env.digest, "accepted"),
                                                                      t.federation, t.username, key=t.signer()))
            time.sleep(0.5)  # the ack settles the upload
        time.sleep(2.5)  # a heartbeat after the last round: the device's own figures
        for ev in adversary.drain(1.0):
            if ev.payload and decode_envelope(ev.payload).kind == Kind.STATUS:
                statuses.append(dict(decode_message(ev.payload)[1].info))  # type: ignore[union-attr]
        assert device.error is None
    finally:
        device.stop()
        adversary.close()
    assert [outcomes[r] for r in (1, 2, 3)] == ["refused: round skipped"] * 3, \
        f"a mislabelled plan got a contribution: {outcomes}"
    assert [outcomes[r] for r in (4, 5, 6)] == ["update", "update", "refused: budget spent"], outcomes
    last = [s for s in statuses if "dp_epsilon" in s][-1]
    assert last["dp_rounds"] == 2 and last["dp_epsilon"] == pytest.approx(two, rel=1e-4), last
