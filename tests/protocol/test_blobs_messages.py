"""Model blobs (safetensors) and the JSON messages."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from _wirecraft import envelope

from flayer.models import ModelSpec, build_model
from flayer.update import float_state, state_numpy
from protocol import (
    Ack,
    EncodeError,
    Kind,
    Message,
    Metrics,
    Plan,
    Status,
    WireError,
    WireLimits,
    blob_digest,
    decode_envelope,
    decode_message,
    decode_state,
    encode_message,
    encode_state,
)


def _state() -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    return state_numpy(float_state(build_model(ModelSpec("cnn"))))


def test_state_round_trip_is_exact_and_deterministic() -> None:
    state = _state()
    blob = encode_state(state)
    assert encode_state(dict(reversed(list(state.items())))) == blob  # same state, same digest
    out = decode_state(blob, expected={k: v.shape for k, v in state.items()})
    assert set(out) == set(state)
    for k, v in state.items():
        assert out[k].dtype == v.dtype and out[k].tobytes() == v.tobytes()
    assert len(blob_digest(blob)) == 64 and blob_digest(blob) == blob_digest(bytearray(blob))


def test_mixed_dtypes_and_scalars() -> None:
    state: dict[str, np.ndarray] = {
        "a": np.array(3.5, np.float32),
        "b": np.arange(5, dtype=np.int64),
        "c": np.zeros((0, 3), np.float16),
        "d": np.array([True, False]),
        "e": np.arange(6, dtype=np.uint8).reshape(2, 3),
    }
    out = decode_state(encode_state(state))
    for k, v in state.items():
        np.testing.assert_array_equal(out[k], v)
        assert out[k].dtype == v.dtype and out[k].shape == v.shape


def test_state_checks_expected_names_and_shapes() -> None:
    blob = encode_state({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)})
    with pytest.raises(WireError, match="not in the expected"):
        decode_state(blob, expected={"w": (3, 2), "b": (3,)})
    with pytest.raises(WireError, match="missing"):
        decode_state(blob, expected={"w": (2, 3), "b": (3,), "c": (1,)})
    with pytest.raises(WireError, match="not in the expected"):
        decode_state(blob, expected={"w": (2, 3)})
    with pytest.raises(WireError, match="limit"):
        decode_state(blob, WireLimits(max_numel=5))
    with pytest.raises(WireError, match="limit"):
        decode_state(blob, WireLimits(max_blob_bytes=len(blob) - 1))


def test_encode_state_rejects_bad_input() -> None:
    for bad in (
        {"w": np.array([np.nan], np.float32)},
        {"w": np.zeros(2, np.complex64)},
        {"": np.zeros(1)},
        {"w": [1.0, 2.0]},
    ):
        with pytest.raises(EncodeError):
            encode_state(bad)  # type: ignore[arg-type]


def _safetensors(header: object, data: bytes, hlen: int | None = None) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + data


@pytest.mark.parametrize(
    "blob, reason",
    [
        (b"", "too short"),
        (_safetensors({}, b"", hlen=2**64 - 1), "header length"),
        (_safetensors({}, b"", hlen=3), "header length"),
        (_safetensors({}, b"x", hlen=3), "JSON"),
        (
            _safetensors(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": 1}', b"\0" * 4),
            "repeats",
        ),
        (_safetensors(b"[1, 2]", b""), "not a JSON object"),
        (_safetensors(b"\xff\xfe", b""), "JSON"),
        (_safetensors(b"[" * 100_000, b""), "JSON"),
        (_safetensors({"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}, b"\0" * 2), "dtype"),
        (_safetensors({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "dtype"),
        (_safetensors({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "shape"),
        (_safetensors({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4), "shape"),
        (
            _safetensors({"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}, b"\0" * 4),
            "shape",
        ),
        (_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "offsets"),
        (
            _safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 2**70]}}, b"\0" * 4),
            "offsets",
        ),
        (_safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "gap"),
        (
            _safetensors(
                {
                    "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                },
                b"\0" * 8,
            ),
            "overlap",
        ),
        (_safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8), "cover"),
        (
            _safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, b"\0" * 4),
            "exactly",
        ),
        (_safetensors({"__metadata__": {"k": 1}}, b""), "metadata"),
        (
            _safetensors(
                {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, struct.pack("<f", np.nan)
            ),
            "NaN",
        ),
        (
            _safetensors({"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}}, b"\x00\x7c"),
            "NaN or Inf",
        ),
        (_safetensors(b'{"a": NaN}', b""), "NaN"),
        (_safetensors(b'{"a": 1' + b"0" * 5000 + b"}", b""), "JSON"),
    ],
)
def test_hostile_model_blobs(blob: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode_state(blob)


PLAN = Plan(
    round=4,
    selected=("c1", "c2", "dev-9"),
    deadline=1.7e9,
    strategy="flayer",
    options={"head_layers": 1, "mask": "paper", "lr_cap": 2.5, "pla": True},
    model={"name": "cnn", "in_channels": 1, "height": 28},
    model_digest="0f" * 32,
    model_chunks=3,
    model_size=3_500_000,
    value_codec="fp32",
    compress=False,
)
MESSAGES: list[Message] = [
    PLAN,
    Ack(4, "c1", "ab" * 32, "accepted"),
    Ack(4, "c2", "cd" * 32, "rejected", "shape mismatch"),
    Status(3, "online", 1.7e9, {"device": "cuda", "memory_gb": 8}),
    Status(0, "offline", 0.0),
    Metrics(4, 1.7e9, {"acc_test": 0.91, "train_loss": 0.3}),
]


@pytest.mark.parametrize("msg", MESSAGES)
def test_messages_round_trip(msg: Message) -> None:
    payload = encode_message(msg, "fed", "coord" if isinstance(msg, (Plan, Ack)) else "c1")
    env, out = decode_message(payload)
    assert out == msg and env.round == msg.round and env.count == 1


def _json_env(kind: Kind, obj: object, round_: int = 4) -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return envelope(body, kind=int(kind), round_=round_)


_PLAN_OBJ = json.loads(decode_envelope(encode_message(PLAN, "fed", "coord")).body)


@pytest.mark.parametrize(
    "kind, obj, reason",
    [
        (Kind.PLAN, {**_PLAN_OBJ, "extra": 1}, "unexpected fields"),
        (Kind.PLAN, {k: v for k, v in _PLAN_OBJ.items() if k != "deadline"}, "missing"),
        (Kind.PLAN, {**_PLAN_OBJ, "round": 0}, "round"),
        (Kind.PLAN, {**_PLAN_OBJ, "round": True}, "round"),
        (Kind.PLAN, {**_PLAN_OBJ, "round": 4.0}, "round"),
        (Kind.PLAN, {**_PLAN_OBJ, "selected": ["c1", "c1"]}, "repeats"),
        (Kind.PLAN, {**_PLAN_OBJ, "selected": ["c/1"]}, "selected"),
        (Kind.PLAN, {**_PLAN_OBJ, "model_digest": "0F" * 32}, "hex"),
        (Kind.PLAN, {**_PLAN_OBJ, "deadline": -1}, "deadline"),
        (Kind.PLAN, {**_PLAN_OBJ, "options": {"x": [1, 2]}}, "options"),
        (Kind.PLAN, {**_PLAN_OBJ, "options": {"bad key": 1}}, "key"),
        (Kind.PLAN, {**_PLAN_OBJ, "value_codec": "fp8"}, "value_codec"),
        (Kind.PLAN, {**_PLAN_OBJ, "compress": 0}, "compress"),
        (Kind.PLAN, {**_PLAN_OBJ, "round": 5}, "envelope's round"),
        (Kind.PLAN, b'{"round": 4, "round": 4}', "repeats"),
        (Kind.PLAN, b'{"deadline": NaN}', "NaN"),
        (Kind.PLAN, b'{"deadline": 1e999}', "unexpected|deadline"),
        (Kind.PLAN, b"[" * 50_000, "JSON"),
        (Kind.PLAN, b"\xff", "JSON"),
        (Kind.PLAN, b"[]", "not a JSON object"),
        (
            Kind.ACK,
            {"round": 4, "client": "c1", "update_digest": "ab" * 32, "status": "maybe", "reason": "", "version": 0},
            "status",
        ),
        (Kind.STATUS, {"round": 4, "state": "online", "time": "now", "info": {}}, "time"),
        (Kind.METRICS, {"round": 4, "time": 1.0, "values": {"acc": "high"}}, "finite"),
    ],
)
def test_strict_message_validation(kind: Kind, obj: object, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode_message(_json_env(kind, obj))


def test_message_kind_size_and_chunk_rules() -> None:
    payload = encode_message(MESSAGES[1], "fed", "coord")
    with pytest.raises(WireError, match="expected a plan"):
        decode_message(payload, kind=Kind.PLAN)
    with pytest.raises(WireError, match="limit"):
        decode_message(payload, WireLimits(max_json_bytes=20))
    body = json.dumps({"round": 4, "time": 1.0, "values": {}}).encode()
    with pytest.raises(WireError, match="single-chunk"):
        decode_message(envelope(body, kind=int(Kind.METRICS), count=2, total=2 * len(body)))
    with pytest.raises(WireError, match="does not carry"):
        decode_message(encode_state_envelope())
    with pytest.raises(EncodeError):
        encode_message(Ack(4, "c1", "xyz", "accepted"), "fed", "coord")
    with pytest.raises(EncodeError, match="exceeds"):
        encode_message(
            Metrics(1, 0.0, {f"k{i}": 1.0 for i in range(200)}), "fed", "c1", WireLimits(max_json_bytes=100)
        )


def encode_state_envelope() -> bytes:
    blob = encode_state({"w": np.zeros(2, np.float32)})
    return envelope(blob, kind=int(Kind.MODEL_CHUNK))
