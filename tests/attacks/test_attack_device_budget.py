"""A coordinator that ignores the devices' budgets (docs/explanation/privacy.md, "A device's own budget").

The adversary holds the coordinator's credentials on a real broker: it publishes a private plan after plan, each
selecting the same device, serves the model, acknowledges every update and counts what arrives on the device's
update topic. The device (the real edge client, over its own connection) has ``[privacy] device_budget`` (and ``delta``) set
between its epsilon after two contributions and after three (the plans' z and delta, q = 1); it is stopped
after the second round and a new instance resumes from the same state folder, as after a reboot. The guarantee:
however many rounds select it, no more contributions arrive than the budget allows, and its status says
``budget spent`` (nothing else) for the rounds it refused.
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
from protocol import Ack, Kind, Plan, Status, chunk_blob, decode_envelope, decode_message, encode_message
from transport.link import Received

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # about 13 s
DEVICE, Z, DELTA, ROUNDS = "dev-0", 1.0, 1e-3, 5


def _plans(digits: Any) -> tuple[Any, list[Plan], bytes]:
    spec = dataclasses.asdict(digits.model_spec())
    base: dict[str, Any] = {"round": 1, "selected": (DEVICE,), "deadline": time.time() + 600, "strategy": "fedavg",
                            "options": {}, "model": spec, "model_digest": "ab" * 32, "model_chunks": 1,
                            "model_size": 1, "seed": 5, "rounds": ROUNDS + 1,
                            "train": {"lr": 0.05, "batch_size": 10, "local_epochs": 1}}
    strategy = StrategyCache({"device": "cpu"}).get(Plan(**base))
    blob = model_blob(initial_global_state(strategy, 5))
    privacy = {**RoundPrivacy("central", 0.5, Z, Z, 1).as_plan(), "delta": DELTA}
    plans = [Plan(**{**base, "round": r, "model_digest": blob.digest, "model_size": blob.size, "privacy": privacy})
             for r in range(1, ROUNDS + 1)]
    return strategy, plans, blob.blob


def test_a_coordinator_cannot_draw_more_contributions_than_the_device_budget(tmp_path: Path, digits: Any,
                                                                             attack_fed: Any,
                                                                             digits_shard: Any) -> None:
    two, three = (epsilon_for([(Z, 1.0, n)], DELTA) for n in (2, 3))
    budget = (two + three) / 2  # two contributions fit, a third would pass it
    _, plans, blob = _plans(digits)
    shard = digits_shard(0, 3)
    fb = attack_fed([DEVICE], view="coordinator")  # the adversary: the coordinator's own account
    t = fb.coordinator
    adversary = fb.listen([f"fl/{t.federation}/update/{DEVICE}/#", f"fl/{t.federation}/status/{DEVICE}"])
    settings = EdgeSettings(state_dir=str(tmp_path / DEVICE), device="cpu", threads=1, heartbeat_s=1.0,
                            ack_timeout_s=30.0, device_budget=budget, device_delta=DELTA)
    device: EdgeClient | None = None
    contributed: list[int] = []
    refused: list[int] = []
    try:
        from protocol import Topics

        topics = Topics(t.federation)
        chunks = chunk_blob(blob, Kind.MODEL_CHUNK, t.federation, t.username, 1, t.max_payload,
                            plans[0].model_digest, key=t.signer())  # the coordinator's own key: it is the adversary
        assert adversary.link.publish_all([(topics.model_chunk(plans[0].model_digest, i), c, True)
                                           for i, c in enumerate(chunks)], 30)
        for plan in plans:
            if device is None or plan.round == 3:  # a reboot between rounds 2 and 3: the ledger is on disk
                if device is not None:
                    device.stop()
                    assert device.wait(30) and device.error is None
                device = EdgeClient(settings, fb.devices[DEVICE], shard)
                device.start()
            plan = dataclasses.replace(plan, model_chunks=len(chunks))
            assert adversary.link.publish_all([(topics.round(), encode_message(plan, t.federation, t.username, key=t.signer()),
                                                True)], 30)

            def answered(ev: Any, r: int = plan.round) -> bool:
                if not isinstance(ev, Received) or not ev.payload:
                    return False
                env = decode_envelope(ev.payload)
                if env.kind == Kind.UPDATE_CHUNK and env.round == r:
                    return True
                if env.kind == Kind.STATUS:
                    st = decode_message(ev.payload)[1]
                    return isinstance(st, Status) and st.info.get("skipped_round") == r
                return False

            ev = adversary.next(answered, 60)
            assert ev is not None, f"round {plan.round}: the device neither sent an update nor said it refused"
            env = decode_envelope(ev.payload)
            if env.kind == Kind.UPDATE_CHUNK:
                contributed.append(plan.round)
                ack = Ack(plan.round, DEVICE, env.digest, "accepted")
                adversary.link.publish(topics.ack(DEVICE), encode_message(ack, t.federation, t.username, key=t.signer()))
                time.sleep(0.5)  # the ack settles the upload
            else:
                st = decode_message(ev.payload)[1]
                assert isinstance(st, Status) and st.info["skip_reason"] == "budget spent"
                assert st.info["dp_at_budget"] is True and st.info["dp_rounds"] == 2
                assert st.info["dp_epsilon"] == pytest.approx(two, rel=1e-5)
                refused.append(plan.round)
        assert contributed == [1, 2], f"the device contributed to rounds {contributed} with a budget for 2"
        assert refused == [3, 4, 5]
        assert device is not None and device.error is None
    finally:
        if device is not None:
            device.stop()
        adversary.close()
