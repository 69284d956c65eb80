"""The round plan's run fields (phase, seed, training settings, rounds, update limit) and their checks."""

from __future__ import annotations

import json

import pytest

from protocol import EncodeError, Plan, WireError, decode_envelope, decode_message, encode_message
from protocol.envelope import Envelope, Kind

BASE = Plan(round=3, selected=("dev-1", "dev-2"), deadline=1.7e9, strategy="flayer", options={"pla": True},
            model={"name": "cnn"}, model_digest="ab" * 32, model_chunks=2, model_size=2000,
            seed=7, train={"lr": 0.005, "batch_size": 10, "local_epochs": 1}, rounds=10,
            max_update_bytes=1 << 20)


def _raw(obj: dict, round_: int) -> bytes:
    import hashlib

    body = json.dumps(obj).encode()
    return Envelope(Kind.PLAN, "fed", "coord", round_, 0, 1, len(body), hashlib.sha256(body).hexdigest(), body).encode()


def test_run_fields_round_trip() -> None:
    for plan in (BASE, Plan(0, ("d",), 1.0, "playerfl", {}, {"name": "cnn"}, "cd" * 32, 1, 10, phase="calibrate"),
                 Plan(11, (), 1.0, "flayer", {}, {"name": "cnn"}, "cd" * 32, 1, 10, phase="final", rounds=10)):
        _, got = decode_message(encode_message(plan, "fed", "coord"))
        assert got == plan


def test_defaults_keep_old_constructor_calls_valid() -> None:
    plan = Plan(1, ("a",), 1.0, "fedavg", {}, {"name": "cnn"}, "ab" * 32, 1, 1)
    assert (plan.phase, plan.seed, dict(plan.train), plan.rounds, plan.max_update_bytes) == ("train", 0, {}, 0, 0)


@pytest.mark.parametrize("change, reason", [
    ({"phase": "warmup"}, "phase"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"train": {"lr": [1]}}, "train"),
    ({"train": {"bad key": 1}}, "key"),
    ({"rounds": -1}, "rounds"),
    ({"max_update_bytes": True}, "max_update_bytes"),
])
def test_bad_run_fields_are_rejected(change: dict, reason: str) -> None:
    obj = {**json.loads(decode_envelope(encode_message(BASE, "fed", "coord")).body), **change}
    with pytest.raises(WireError, match=reason):
        decode_message(_raw(obj, 3))


def test_round_zero_is_the_calibration_phase_only() -> None:
    obj = json.loads(decode_envelope(encode_message(BASE, "fed", "coord")).body)
    with pytest.raises(WireError, match="round 0 is the calibration phase"):
        decode_message(_raw({**obj, "round": 0}, 0))
    with pytest.raises(WireError, match="calibration"):
        decode_message(_raw({**obj, "phase": "calibrate"}, 3))
    with pytest.raises(EncodeError, match="calibration"):
        encode_message(Plan(0, (), 1.0, "fedavg", {}, {"name": "cnn"}, "ab" * 32, 1, 1), "fed", "coord")
