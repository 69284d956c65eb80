"""Mutation fuzzing: >= 10,000 damaged payloads of every kind; decoders may raise only WireError.

Seeded numpy RNG, so a failure reproduces. Valid payloads of every kind (update blobs with every
value codec and position method, zstd or not; model blobs; envelopes of model and update chunks;
plan / ack / status / metrics messages) are damaged by bit flips, truncations, extensions,
overwrites of 1-8 byte windows with boundary values (lengths, 0, 0xff.., 2**31...), splices of two
payloads, inserted copies and plain random bytes, one to three at a time. Some payloads are
"resealed" (the damaged body gets a correct crc32 and sha256 in a fresh envelope) so the damage
reaches the decoders behind the envelope's integrity checks. Bounded time: the module has a
timeout; it takes a few seconds.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import pytest
from _wirecraft import envelope

from flayer.update import TensorDelta, Update
from protocol import (
    Ack,
    Kind,
    Metrics,
    Plan,
    Reassembler,
    Status,
    UpdateHeader,
    UpdateOptions,
    WireError,
    WireLimits,
    chunk_blob,
    decode_envelope,
    decode_message,
    decode_state,
    decode_update,
    encode_message,
    encode_state,
    encode_update,
)

N_PAYLOADS = 12_000
LIMITS = WireLimits(
    max_blob_bytes=1 << 22, max_numel=1 << 20, max_total_numel=1 << 21, max_json_bytes=1 << 14
)
Decoder = Callable[[bytes], object]


def _updates(rng: np.random.Generator) -> list[bytes]:
    header = UpdateHeader("fed", 5, "client-1", "cd" * 32)
    out = []
    for density, codec, zstd in [
        (0.02, "fp32", False),
        (0.3, "fp16", False),
        (0.5, "bf16", True),
        (0.8, "int8", False),
        (1.0, "fp32", True),
        (0.1, "int8", True),
    ]:
        deltas = {}
        for i, shape in enumerate([(40, 30), (17,), (6, 5, 5), ()]):
            numel = int(np.prod(shape))
            m = max(1, int(density * numel))
            idx = None if m == numel else np.sort(rng.choice(numel, m, replace=False))
            deltas[f"t{i}"] = TensorDelta(shape, rng.standard_normal(m).astype(np.float32), idx)
        cols = rng.random(64) < density  # a column pattern repeated by row: a zstd-coded bitmask
        idx = np.flatnonzero(np.resize(cols, 32 * 64) ^ (rng.random(32 * 64) < 0.02))
        deltas["t4"] = TensorDelta((32, 64), rng.standard_normal(idx.size).astype(np.float32), idx)
        update = Update(deltas, 33, {"acc": 0.5, "loss": 1.25})
        out.append(encode_update(update, header, UpdateOptions(codec, zstd)))
    return out


SHAPES = {"t0": (40, 30), "t1": (17,), "t2": (6, 5, 5), "t3": (), "t4": (32, 64)}


def _pool(rng: np.random.Generator) -> list[tuple[str, bytes, Decoder]]:
    state = encode_state(
        {
            "conv.weight": rng.standard_normal((8, 3, 3)).astype(np.float32),
            "conv.bias": np.zeros(8, np.float32),
            "steps": np.arange(3, dtype=np.int64),
        }
    )
    messages = [
        encode_message(
            Plan(
                3,
                ("a", "b-2"),
                1.7e9,
                "flayer",
                {"k": 1, "x": "y"},
                {"name": "cnn"},
                "ab" * 32,
                4,
                1000,
                "int8",
                True,
            ),
            "fed",
            "coord",
        ),
        encode_message(Ack(3, "a", "ab" * 32, "rejected", "bad shape"), "fed", "coord"),
        encode_message(Status(3, "training", 1.7e9, {"device": "cpu"}), "fed", "a"),
        encode_message(Metrics(3, 1.7e9, {"acc": 0.5}), "fed", "a"),
    ]
    updates = _updates(rng)
    model_chunks = [decode_envelope(p) for p in chunk_blob(state, Kind.MODEL_CHUNK, "fed", "coord", 3, 250)]

    def through_chunks(data: bytes) -> object:
        env = decode_envelope(data, LIMITS)
        r = Reassembler(LIMITS)
        for other in model_chunks:
            if other.index != env.index:
                r.add(other)
        r.add(env)
        return decode_state(r.blob(), LIMITS) if r.complete else None

    def sealed(kind: Kind, inner: Decoder) -> Decoder:
        return lambda body: inner(decode_envelope(envelope(body, kind=int(kind), round_=3), LIMITS).body)

    pool: list[tuple[str, bytes, Decoder]] = []
    for u in updates:
        pool += [
            ("update", u, lambda b: decode_update(b, LIMITS)),
            ("update+shapes", u, lambda b: decode_update(b, LIMITS, SHAPES)),
            ("sealed update", u, sealed(Kind.UPDATE_CHUNK, lambda b: decode_update(b, LIMITS, SHAPES))),
        ]
        for p in chunk_blob(u, Kind.UPDATE_CHUNK, "fed", "client-1", 5, 700)[:2]:
            pool.append(("update chunk", p, lambda b: decode_envelope(b, LIMITS)))
    pool += [
        ("state", state, lambda b: decode_state(b, LIMITS)),
        ("sealed state", state, sealed(Kind.MODEL_CHUNK, lambda b: decode_state(b, LIMITS))),
    ]
    pool += [("model chunk", c.encode(), through_chunks) for c in model_chunks]
    for m in messages:
        env = decode_envelope(m)
        pool.append(("message", m, lambda b: decode_message(b, LIMITS)))
        pool.append(
            (
                "sealed message",
                env.body,
                _sealed_message(env.kind),
            )
        )
    return pool


def _sealed_message(kind: Kind) -> Decoder:
    return lambda body: decode_message(envelope(body, kind=int(kind), round_=3), LIMITS)


_BOUNDARY = [0, 1, 2, 7, 8, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]


def _mutate(rng: np.random.Generator, data: bytes, others: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(0, 8))
        n = len(b)
        # half the damage lands in the first 96 bytes, where the headers and length fields are
        at = int(rng.integers(0, max(1, min(n, 96)) if rng.random() < 0.5 else max(1, n)))
        if op == 0 and n:  # bit flips
            for _ in range(int(rng.integers(1, 9))):
                i = int(rng.integers(0, n))
                b[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1:  # truncation
            del b[int(rng.integers(0, n + 1)) :]
        elif op == 2:  # extension
            b += rng.integers(0, 256, int(rng.integers(1, 65)), dtype=np.uint8).tobytes()
        elif op == 3 and n:  # overwrite a 1/2/4/8-byte window with a boundary value (as a length field)
            width = int(rng.choice([1, 2, 4, 8]))
            value = int(rng.choice(_BOUNDARY + [n, n - at, n + 1])) % (1 << (8 * width))
            b[at : at + width] = value.to_bytes(width, "little")[: max(0, n - at)]
        elif op == 4 and others:  # splice with another payload
            other = others[int(rng.integers(0, len(others)))]
            b = b[:at] + bytearray(other[int(rng.integers(0, len(other) + 1)) :])
        elif op == 5 and n:  # insert a copy of a segment
            j = int(rng.integers(0, n))
            b[at:at] = b[j : j + int(rng.integers(1, 33))]
        elif op == 6:  # random bytes after the original magic
            b = b[:4] + bytearray(rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes())
        elif n:  # overwrite a float field position with NaN / Inf bit patterns
            pattern = [
                struct.pack("<f", float("nan")),
                struct.pack("<f", float("inf")),
                b"\x00\x7c",
                b"\x80\x7f",
            ]
            p = pattern[int(rng.integers(0, 4))]
            b[at : at + len(p)] = p[: max(0, n - at)]
    return bytes(b)


@pytest.mark.timeout(180)
def test_fuzzed_payloads_raise_only_wire_error() -> None:
    rng = np.random.default_rng(20_250_611)
    pool = _pool(rng)
    others = [p for _, p, _ in pool]
    for _, payload, decode in pool:  # every seed payload is valid to begin with
        decode(payload)
    failures: list[tuple[int, str, str, str]] = []
    rejected = 0
    for i in range(N_PAYLOADS):
        name, payload, decode = pool[int(rng.integers(0, len(pool)))]
        data = (
            _mutate(rng, payload, others)
            if i % 50
            else bytes(rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8))
        )
        try:
            decode(data)
        except WireError as exc:
            rejected += 1
            assert exc.reason
        except Exception as exc:  # noqa: BLE001 - anything else is the bug this test looks for
            failures.append((i, name, type(exc).__name__, str(exc)[:200]))
    assert not failures, f"{len(failures)} payloads escaped as other errors, e.g. {failures[:5]}"
    assert rejected > N_PAYLOADS // 2, f"only {rejected} of {N_PAYLOADS} damaged payloads were rejected"
