"""A coordinator that swaps a secure round's plan under its session (docs/explanation/secure-aggregation.md).

The adversary writes and signs the plans. It publishes plan A for a round -- local mode (distributed noise), C 1,
noise shares sized for C 1, session S -- and then plan B for the same round and session: C 100 with its own
correctly sized shares. Each plan passes every device check on its own. Before the defence the device kept A's
session (its noise, and A's privacy mapping for its ledger) while its training job clipped by B: an update of
norm up to 100 under noise for C 1, an effective multiplier 0.01 booked as 1; and in the other order an update
trained (or not noised at all, after a central or non-private plan) under one plan was masked into the other's
session. The guarantee: a device masks and books only an upload trained under the very privacy and secure terms
its session was opened with; a change of terms under a session makes it sit the round out.
"""

from __future__ import annotations

import hashlib
import types
from typing import Any

import numpy as np

from edge_client.budget import DeviceBudgets
from edge_client.secure import SecureRounds
from edge_client.work import Upload, plan_terms
from flayer.engine.privacy import RoundPrivacy
from flayer.engine.secure_layout import layout_of
from flayer.engine.secure_ring import ring_noise
from flayer.update import TensorDelta, Update
from protocol import Plan
from protocol.signing import SigningKey

IDS = tuple(f"dev-{i:02d}" for i in range(6))
RUN_SEED, ROUND, N, T = 7, 1, 256, 4


def _upd(vals: Any) -> Update:
    return Update({"w": TensorDelta((N,), np.asarray(vals, np.float32), None)}, 1, {})


def _plan(clip: float) -> Any:
    rp = RoundPrivacy("local", clip, 1.0, 1.0, len(IDS), ring=True)
    noise, ring, vbits = ring_noise(rp, T, N, 100.0, len(IDS), 16)  # what an honest coordinator writes
    secure = {"session": "fed.1.SAME", "threshold": T, "degree": 5,
              "graph_seed": hashlib.sha256(f"secagg-graph:{RUN_SEED}:{ROUND}".encode()).hexdigest(), "length": N,
              "bits": ring.bits, "value_bits": vbits, "layout": layout_of(_upd(np.zeros(N))).digest,
              "adaptive": False, "stage_s": 10.0, "noise_std": noise, "bound": 100.0, "value_range": 100.0,
              "corrupt_fraction": 0.0, "run_seed": RUN_SEED, "dropout": 0.1}
    return Plan(round=ROUND, selected=IDS, deadline=0.0, strategy="fedavg", options={}, model={}, model_digest="0" * 64,
                model_chunks=1, model_size=1, privacy=rp.as_plan(), secure=secure)


class _Device(DeviceBudgets, SecureRounds):
    pass


def _device() -> Any:
    dev = _Device.__new__(_Device)
    dev.id = IDS[0]
    dev.settings = types.SimpleNamespace(secure_corrupt_fraction=0.0, device_budget=None, device_delta=None)
    dev.stored = types.SimpleNamespace(done_round=0, extra={}, state=None, on_disk=None)
    dev.skipped, dev._heartbeat_at, dev._secure, dev._busy = {}, 0.0, None, False
    dev.peers = types.SimpleNamespace(available=lambda: True)
    dev.creds = types.SimpleNamespace(federation="fed")
    dev.signer = SigningKey.generate()
    dev.sent = []
    dev.link = types.SimpleNamespace(publish=lambda topic, payload, **kw: dev.sent.append(topic))
    dev.topics = types.SimpleNamespace(secagg=lambda d: f"fl/fed/secagg/{d}")
    dev.store = types.SimpleNamespace(save=lambda s: None, save_upload=lambda b: None, secure_advert=lambda: None,
                                      save_secure_advert=lambda r, s: None)  # never restarted here
    dev.rounds_trained = []
    dev._progress = lambda *a, **k: None
    dev.clock = lambda: 0.0
    return dev


def test_a_plan_swapped_under_the_session_makes_the_device_sit_the_round_out() -> None:
    a, b = _plan(1.0), _plan(100.0)
    dev = _device()
    dev._secure_plan(a)
    assert dev._secure is not None and dev._secure.privacy["clip"] == 1.0  # the session of plan A
    dev._secure_plan(b)  # the same round and session under other terms
    assert dev._secure is None, "the device kept plan A's session (its noise and its booking) under plan B"
    dev._secure_plan(a)  # and plan A again does not bring it back for this round
    assert dev._secure is None


def test_an_upload_trained_under_another_plan_is_not_masked_into_the_session() -> None:
    a, b = _plan(1.0), _plan(100.0)
    dev = _device()
    dev._secure_plan(b)  # the session: plan B
    trained = Upload(ROUND, "", b"", (), update=_upd(np.zeros(N)), trained_under=plan_terms(a))
    dev._secure_trained(trained, ROUND)  # the job trained under plan A (clip 1, its noise)
    assert dev._secure is None, "an upload trained under plan A was kept for plan B's session"
    dev2 = _device()
    dev2._secure_plan(b)
    ok = Upload(ROUND, "", b"", (), update=_upd(np.zeros(N)), trained_under=plan_terms(b))
    dev2._secure_send_masked = lambda: None  # the masking itself is the protocol's (tests/secagg)
    dev2._secure_trained(ok, ROUND)
    assert dev2._secure is not None and dev2._secure.update is not None  # the honest case goes on
