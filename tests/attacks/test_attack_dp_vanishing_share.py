"""A coordinator that names a huge ``contributions`` m so that each device's local noise share vanishes
(docs/explanation/privacy.md, "The privacy floor a device pins" and "A device's own budget").

In local mode each device adds ``N(0, (z C)^2 / m)`` to its clipped upload, and the coordinator sees each upload.
A plan labelled z = 1 that names m = 9e15 for two selected devices has each add noise of std 5e-9: the
coordinator reads both clipped updates almost exactly, while the plan's label and its ``mode = "local"`` meet
every check on the label. The adversary holds the coordinator's credentials on a real Mosquitto: it signs and
publishes plans of its own choosing selecting both devices, serves the model, acknowledges whatever arrives and
reads the devices' update and status topics. The devices are real edge clients over their own connections, both
pinning ``[privacy] require = "local"``; one has no budget, the other ``device_budget``. The guarantees:

- a device refuses a plan whose contribution it would book (its own share, ``z / sqrt(m)``) below
  ``MIN_MULTIPLIER``, a synchronous plan whose m exceeds the devices it selects, and an asynchronous plan whose m
  is not below ``1 / delta``: nothing reaches its update topic, its ledger books nothing, one log line a round
  says why, and its status says ``round skipped`` -- not ``budget spent``, and never ``dp_at_budget`` with
  nothing contributed;
- the control: the honest plan (m = 2 for two devices) is taken by both and booked at ``z / sqrt(2)``;
- a device whose ledger already holds a round without countable noise (booked by an earlier release) reports
  its epsilon as ``"inf"``, and the fleet's figures (``coordinator.device_privacy``) show max ``"inf"`` instead of
  dropping it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fedtestlib import Recorder, start_fed_broker
from test_attack_participation_schema import _base

from coordinator.device_privacy import device_privacy
from edge_client.budget import LEDGER_KEY, DeviceLedger
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.store import DeviceStore
from flayer.engine.accountant import epsilon_for
from flayer.engine.privacy import RoundPrivacy
from flayer.partition import make_partition
from flayer.train import client_data
from mqtt_broker import mosquitto_available
from protocol import Ack, Kind, Plan, Status, Topics, chunk_blob, decode_envelope, decode_message, encode_message
from transport.link import Received

pytestmark = [pytest.mark.integration, pytest.mark.slow]
A, B = "dev-a", "dev-b"
C, Z, DELTA = 0.5, 1.0, 1e-3
HONEST = 1.0 / math.sqrt(2)  # each device's share at the honest m = 2: what it books


class _Coordinator:
    """The coordinator's credentials: signed plans selecting both devices, acks for whatever arrives."""

    def __init__(self, fb: Any, devices: tuple[str, ...], base: Plan, blob: bytes) -> None:
        t = self.t = fb.coordinator
        self.devices, self.topics = devices, Topics(t.federation)
        self.rec = Recorder(t, [f"fl/{t.federation}/{kind}/{d}{tail}" for d in devices
                                for kind, tail in (("update", "/#"), ("status", ""))])
        chunks = chunk_blob(blob, Kind.MODEL_CHUNK, t.federation, t.username, 1, t.max_payload, base.model_digest,
                            key=t.signer())
        assert self.rec.link.publish_all([(self.topics.model_chunk(base.model_digest, i), c, True)
                                          for i, c in enumerate(chunks)], 30)
        self.base = dataclasses.replace(base, model_chunks=len(chunks), selected=devices)
        self.statuses: dict[str, dict[str, Any]] = {}

    def ask(self, round_: int, privacy: dict[str, Any], mode: str = "sync") -> dict[str, str]:
        """Publish a plan for ``round_``; each device's answer: "update", or its status's skip reason."""
        plan = dataclasses.replace(self.base, round=round_, privacy=privacy, mode=mode)
        assert self.rec.link.publish_all([(self.topics.round(), encode_message(plan, self.t.federation,
                                                                                self.t.username, key=self.t.signer()),
                                           True)], 30)
        answers: dict[str, str] = {}

        def answered(ev: Any) -> bool:
            if not isinstance(ev, Received) or not ev.payload:
                return False
            env = decode_envelope(ev.payload)
            if env.kind == Kind.UPDATE_CHUNK and env.round == round_ and env.sender not in answers:
                answers[env.sender] = "update"
                ack = Ack(round_, env.sender, env.digest, "accepted")
                self.rec.link.publish(self.topics.ack(env.sender), encode_message(
                    ack, self.t.federation, self.t.username, key=self.t.signer()))
            else:
                st = self._status(ev)
                if st is not None and st.info.get("skipped_round") == round_:
                    answers.setdefault(env.sender, str(st.info.get("skip_reason")))
            return len(answers) == len(self.devices)

        assert self.rec.next(answered, 90) is not None, f"round {round_}: not every device answered: {answers}"
        self.watch(1.0)  # the acks settle the uploads
        return answers

    def _status(self, ev: Any) -> Status | None:
        """A device's status (its info noted as its latest), or None."""
        if not isinstance(ev, Received) or not ev.payload or decode_envelope(ev.payload).kind != Kind.STATUS:
            return None
        env, st = decode_message(ev.payload)
        if not isinstance(st, Status):
            return None
        self.statuses[env.sender] = dict(st.info)
        return st

    def watch(self, seconds: float) -> None:
        """Read the devices' statuses for ``seconds``."""
        self.rec.next(lambda ev: self._status(ev) is None and False, seconds)

    def close(self) -> None:
        self.rec.close()


def _settings(tmp: Path, device: str, budget: float = 0.0) -> EdgeSettings:
    return EdgeSettings(state_dir=str(tmp / device), device="cpu", threads=1, heartbeat_s=1.0, ack_timeout_s=60.0,
                        privacy_require=("local",), device_budget=budget)


def _local(m: int) -> dict[str, Any]:
    return {**RoundPrivacy("local", C, Z, Z, m).as_plan(), "delta": DELTA}


def _fleet(tmp: Path, digits: Any, budgets: dict[str, float]) -> tuple[Any, _Coordinator, list[EdgeClient]]:
    base, blob = _base(digits, A)
    shard = client_data(digits, make_partition(digits.y, 10, 3, "iid", 0).clients[0])
    fb = start_fed_broker(tmp, "mosquitto", [A, B])
    adversary = _Coordinator(fb, (A, B), base, blob)
    devices = [EdgeClient(_settings(tmp, d, budgets.get(d, 0.0)), fb.devices[d], shard) for d in (A, B)]
    return fb, adversary, devices


def _stop(fb: Any, adversary: Any, devices: list[Any]) -> None:
    """Stop the devices, the adversary's connection and the broker (the broker by its PID)."""
    for d in devices:
        d.stop()
        d.wait(30)
    adversary.close()
    fb.broker.stop()


def test_a_coordinator_cannot_make_a_devices_local_noise_share_vanish(
        tmp_path: Path, digits: Any, caplog: pytest.LogCaptureFixture) -> None:
    if not mosquitto_available():
        pytest.skip("mosquitto is not installed")
    budget = 1.5 * epsilon_for([(HONEST, 1.0, 1)], 1e-5)  # room for the honest round at the device's delta
    fb, adversary, devices = _fleet(tmp_path, digits, {B: budget})
    attacks = [(1, _local(9 * 10**15), "sync"),  # share std 5e-9: the coordinator reads each update
               (2, _local(10**8), "sync"),  # share std 5e-5: a 3% read
               (3, _local(3), "sync"),  # one more contribution than the round can hold
               (4, _local(10**4), "async"),  # an asynchronous buffer of 10^4 where delta says N < 1000
               (6, {**_local(10**8), "delta": 1e-9}, "async")]  # N < 1e9 allows the buffer; the share is 1e-4 z
    answers: dict[int, dict[str, str]] = {}
    caplog.set_level(logging.INFO, logger="edge_client")
    try:
        for d in devices:
            d.start()
        for r, privacy, mode in attacks:
            answers[r] = adversary.ask(r, privacy, mode)
        refused_status = dict(adversary.statuses.get(B, {}))
        ledgers_after_attacks = {d.id: DeviceLedger.from_extra(d.stored.extra).runs for d in devices}
        answers[7] = adversary.ask(7, _local(2))  # the honest plan: m = 2 for the two devices it selects
        assert all(d.error is None for d in devices)
    finally:
        _stop(fb, adversary, devices)
    for r, _, _ in attacks:
        assert answers[r] == {A: "round skipped", B: "round skipped"}, f"round {r}: the devices answered {answers[r]}"
    assert ledgers_after_attacks == {A: [], B: []}, f"a refused round was booked: {ledgers_after_attacks}"
    assert refused_status.get("dp_at_budget") is not True, \
        f"the budgeted device says it is at its budget with nothing contributed: {refused_status}"
    for r, why in ((1, "exceeds the 2 device(s) it selects"), (2, "exceeds the 2 device(s)"), (3, "exceeds the 2"),
                   (4, "not below 1 / delta"), (6, "multiplier of 0.0001 (z 1 / sqrt(m = 100000000)), below 0.01")):
        for d in (A, B):
            lines = [rec.getMessage() for rec in caplog.records if f"{d}: refusing round {r}:" in rec.getMessage()]
            assert len(lines) == 1 and why in lines[0], f"{d} round {r}: {lines}"
    assert answers[7] == {A: "update", B: "update"}, f"the honest plan was refused: {answers[7]}"
    for d in devices:
        runs = DeviceLedger.from_extra(d.stored.extra).runs
        assert len(runs) == 1 and runs[0][0] == pytest.approx(HONEST) and runs[0][1] == 1, f"{d.id}: {runs}"


def test_an_infinite_device_epsilon_shows_in_the_fleets_figures(tmp_path: Path, digits: Any) -> None:
    if not mosquitto_available():
        pytest.skip("mosquitto is not installed")
    store = DeviceStore(tmp_path / A)  # what an earlier release booked for the m = 9e15 plan
    stored = store.load()
    stored.extra[LEDGER_KEY] = {"runs": [[Z / math.sqrt(9 * 10**15), 1]], "last_round": 1}
    store.save(stored)
    fb, adversary, devices = _fleet(tmp_path, digits, {})
    try:
        for d in devices:
            d.start()
        assert adversary.ask(2, _local(2)) == {A: "update", B: "update"}
        adversary.watch(2.5)  # the next heartbeats carry both ledgers
        infos = [adversary.statuses.get(d, {}) for d in (A, B)]
    finally:
        _stop(fb, adversary, devices)
    assert infos[0].get("dp_epsilon") == "inf", f"{A} does not report its infinite epsilon: {infos[0]}"
    assert isinstance(infos[1].get("dp_epsilon"), float) and math.isfinite(infos[1]["dp_epsilon"]), infos[1]
    dp = device_privacy(infos)
    assert dp is not None and dp["max"] == "inf" and dp["infinite"] == 1 and dp["with_epsilon"] == 2, dp
