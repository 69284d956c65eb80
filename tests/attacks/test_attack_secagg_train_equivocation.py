"""A coordinator that shows one device another plan than the rest, alike in every secure and privacy parameter
(docs/explanation/secure-aggregation.md, "One plan for everyone"; docs/explanation/design.md, "What a party signs
is what it relied on").

The adversary is the coordinator: it writes the plans (its own messages) and relays every advert, bundle, sealed
share, survivor set and unmask request, without checking any of them. No device colludes. The victim reads plan A;
every other selected device reads plan B: the same round, the same ``secure`` and ``privacy`` mappings, and one other
field changed -- ``train.lr = 1e-30`` (a step that leaves every float32 weight as it was: each of their updates is
exactly 0), another ``model_digest`` (another global model), or another ``seed``. Each device reads its plan through
its real plan path (:meth:`edge_client.secure.SecureRounds._secure_plan`: its own binding, its own Ed25519 key, the
others' keys from the federation's registry) and runs the real :class:`edge_client.secure.SecureSession`; the
coordinator runs :class:`flayer.secagg.SecAggServer` as its relay. Before the defence the transcript covered only the
secure parameters, so every signature verified, the round unmasked, and the sum was the victim's update. Now the
transcript covers the digest of every plan field but those a re-publication may change
(:mod:`protocol.plan_digest`): the devices of plan B verify nothing the victim signed, nor it theirs.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import numpy as np
import pytest

from edge_client.secure import SecureRounds
from flayer.engine.secure import plan_round, plan_secure
from flayer.engine.secure_layout import layout_of
from flayer.privacy_config import PrivacySettings
from flayer.secagg import SecAggAbandoned, SecAggError, SecAggServer, ServerConsistency, decode_message
from flayer.update import TensorDelta, Update
from protocol import Plan, SignatureError, encode_message
from protocol import decode_message as decode_wire
from protocol.signing import SigningKey

FED, ROUND, RUN_SEED, N = "fed", 1, 7, 32
IDS = tuple(f"dev-{i:02d}" for i in range(6))
VICTIM = IDS[2]


class Registry:
    """The federation's key registry (``signing_keys.json``): every device's public key, never the coordinator's."""

    def __init__(self) -> None:
        self.signers = {d: SigningKey.generate() for d in IDS}

    def available(self) -> bool:
        return True

    def key_for(self, federation: str, device: str) -> Any:
        if federation != FED or device not in self.signers:
            raise SignatureError(f"no key for {device!r}")
        return self.signers[device].public


class Device(SecureRounds):
    """A selected device's secure-round path, as an edge client runs it, its adverts collected instead of sent."""

    def __init__(self, me: str, reg: Registry) -> None:
        self.id, self.peers, self.signer = me, reg, reg.signers[me]
        self.creds = types.SimpleNamespace(federation=FED)
        self.settings = types.SimpleNamespace(secure_corrupt_fraction=0.0)
        self.stored = types.SimpleNamespace(done_round=0, extra={})
        self.store = types.SimpleNamespace(secure_advert=lambda: None, save_secure_advert=lambda r, s: None)
        self._secure, self.sent = None, []

    def _budget_refuses(self, plan: Any) -> bool:
        return False

    def _secure_publish(self, bodies: list[bytes], round_: int) -> None:
        self.sent.extend(bodies)


def _upd(values: np.ndarray) -> Update:
    return Update({"w": TensorDelta((N,), values.astype(np.float32))}, 1, {})


def _plan_a() -> Plan:
    """The honest plan of a secure round without DP, as the coordinator's own code writes its ``secure`` mapping."""
    planned = plan_round(PrivacySettings(secure_aggregation=True), f"{FED}.{ROUND}.ab", ROUND, IDS,
                         layout_of(_upd(np.zeros(N))), RUN_SEED, None, 1.0)
    return Plan(round=ROUND, selected=IDS, deadline=1000.0, strategy="fedavg", options={"mu": 0.0},
                model={"name": "mlp", "num_classes": 10}, model_digest="a" * 64, model_chunks=1, model_size=4096,
                seed=RUN_SEED, train={"lr": 0.05, "local_epochs": 1}, secure={**plan_secure(planned), "void": ""})


def _read(plan: Plan) -> Plan:
    """The plan as a device decodes it from the coordinator's message."""
    return decode_wire(encode_message(plan, FED, "coordinator"))[1]  # type: ignore[return-value]


def _round(plan_a: Plan, plan_b: Plan) -> tuple[np.ndarray | None, dict[str, np.ndarray], dict[str, str]]:
    """The victim on ``plan_a``, everyone else on ``plan_b``, the coordinator relaying: (the unmasked ring sum or
    None, each device's ring input, each device's refusal)."""
    reg = Registry()
    devices = {d: Device(d, reg) for d in IDS}
    for d, dev in devices.items():
        dev._secure_plan(_read(plan_a if d == VICTIM else plan_b))
    sessions = {d: dev._secure for d, dev in devices.items()}
    assert all(s is not None for s in sessions.values())
    rng = np.random.default_rng(5)
    victim_update = _upd(rng.normal(0, 0.05, N))
    layout = layout_of(victim_update)
    vectors = {d: s.planned.vector(victim_update if d == VICTIM else _upd(np.zeros(N)), layout)  # type: ignore[union-attr]
               for d, s in sessions.items()}  # lr = 1e-30: the others' updates are exactly 0
    server = SecAggServer(sessions[IDS[0]].planned.params,  # type: ignore[union-attr]
                          ServerConsistency(lambda *a: True, 0.0, lambda *a: True))  # it checks nothing
    refused: dict[str, str] = {}
    alive = list(IDS)

    def step(action: Any) -> None:
        for d in list(alive):
            try:
                action(d, sessions[d])
            except SecAggError as exc:
                refused[d] = str(exc)
                alive.remove(d)

    def share(d: str, s: Any) -> None:
        (batch,) = s.on_message(server.key_bundle(d).to_bytes())
        server.receive_shares(decode_message(batch))

    def mask(d: str, s: Any) -> None:
        s.on_message(server.shares_for(d).to_bytes())
        server.receive_masked(s.client.masked_input(s.shares, vectors[d]))

    def consent(d: str, s: Any) -> None:
        (given,) = s.on_message(server.consent_request(d).to_bytes())
        server.receive_consent(decode_message(given))

    def sign(d: str, s: Any) -> None:
        (sig,) = s.on_message(server.consistency_request(d).to_bytes())
        server.receive_signature(decode_message(sig))

    def unmask(d: str, s: Any) -> None:
        (answer,) = s.on_message(server.unmask_request(d).to_bytes())
        server.receive_unmask(decode_message(answer))

    for d in IDS:
        server.receive_advert(decode_message(devices[d].sent[0]))
    try:
        for action in (share, mask, consent, sign, unmask):
            step(action)
        return server.result(), vectors, refused
    except (SecAggAbandoned, SecAggError):  # abandoned, or stuck: nobody it could go on with
        return None, vectors, refused


def _equivocate(field: str) -> Plan:
    a = _plan_a()
    change: dict[str, Any] = {"train": {**a.train, "lr": 1e-30}, "model_digest": "b" * 64, "seed": RUN_SEED + 1}
    return dataclasses.replace(a, **{field: change[field]})


@pytest.mark.parametrize("field", ["train", "model_digest", "seed"])
def test_a_plan_that_differs_for_the_victim_unmasks_nothing_of_it(field: str) -> None:
    a = _plan_a()
    total, vectors, refused = _round(a, _equivocate(field))
    assert total is None or not np.array_equal(total, vectors[VICTIM]), \
        f"the unmasked sum is the victim's input: plan B's {field} is outside the transcript"
    assert total is None  # nothing unmasked at all
    assert VICTIM in refused and "is not signed by" in refused[VICTIM]  # it verified none of its neighbours
    assert all(d in refused for d in IDS)  # and none of them verified it (the complete graph at 6 devices)


def test_one_plan_published_again_with_its_republished_fields_changed_still_unmasks() -> None:
    a = _plan_a()
    again = dataclasses.replace(a, deadline=a.deadline + 300, close_by=900.0, issued=5.0,
                                secure={**a.secure, "void": "fed.0.cd"})
    total, vectors, refused = _round(a, again)
    assert refused == {} and total is not None
    modulus = np.uint64(1) << np.uint64(int(a.secure["bits"]))
    want = (sum(v.astype(np.uint64) for v in vectors.values()) % modulus).astype(np.uint32)
    assert np.array_equal(total, want)  # the sum of every input
