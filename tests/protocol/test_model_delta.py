"""Model deltas: a chain of versions rebuilt bit-exactly (lossless and lossy), and bad deltas refused."""

from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest
import torch

from coordinator.deltas import DeltaChain
from coordinator.publish import model_blob
from edge_client.delta_fetch import delta_source, rebuild
from protocol import (
    EncodeError,
    Plan,
    UpdateHeader,
    WireError,
    blob_digest,
    decode_envelope,
    decode_message,
    decode_state,
    encode_message,
    encode_state,
)
from protocol.model_delta import DeltaRef, apply_delta, delta_ref, make_delta

SHAPES = {"conv.weight": (8, 1, 3, 3), "conv.bias": (8,), "fc.weight": (10, 72), "fc.bias": (10,)}


def _versions(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """n model versions: each changes a random ~30% of the coordinates (FLAYER's masked aggregation)."""
    rng = np.random.default_rng(seed)
    state = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    out = [state]
    for _ in range(n - 1):
        nxt = {}
        for k, v in out[-1].items():
            step = rng.normal(scale=1e-2, size=v.shape).astype(np.float32) * (rng.random(v.shape) < 0.3)
            nxt[k] = (v + step).astype(np.float32)
        out.append(nxt)
    return out


def _header(base: dict[str, np.ndarray], round_: int = 2) -> UpdateHeader:
    return UpdateHeader("fed", round_, "coordinator", blob_digest(encode_state(base)))


def test_exact_deltas_rebuild_every_version_bit_exactly_and_are_smaller() -> None:
    versions = _versions(5)
    held = versions[0]
    for target in versions[1:]:
        header = _header(held)
        blob = make_delta(held, target, "exact", header)
        rebuilt = apply_delta(held, blob, header.base_digest)
        assert blob_digest(encode_state(rebuilt)) == blob_digest(encode_state(target))
        assert len(blob) < 0.6 * len(encode_state(target))  # ~30% of the coordinates changed
        held = rebuilt


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_lossy_chain_agrees_bit_for_bit_with_the_coordinator(mode: str) -> None:
    """The coordinator's published model is the reconstruction; a device rebuilding from the same
    blobs, version after version, holds the very same bytes (digest equal)."""
    versions = _versions(5, seed=1)
    chain = DeltaChain(mode, "fed", "coordinator")
    coord_state = {k: torch.from_numpy(v) for k, v in versions[0].items()}
    coord_model = model_blob(coord_state)
    device_state, device_digest = dict(coord_state), coord_model.digest
    for i, target in enumerate(versions[1:], start=2):
        new = {k: torch.from_numpy(v) for k, v in target.items()}
        coord_state, new_model = chain.advance(coord_model, coord_state, new, i)
        assert chain.blob is not None and chain.base == coord_model.digest and chain.target == new_model.digest
        chain.chunks = 1  # as if published
        plan = Plan(i, ("d",), 1.0, "fedavg", {}, {"name": "cnn"}, new_model.digest, 1, new_model.size,
                    delta=chain.plan_field(new_model.digest))
        ref = delta_source(plan, (device_digest, device_state))
        assert ref is not None
        blob, digest = rebuild(chain.blob.blob, ref, plan, device_state, _limits())
        assert blob == new_model.blob and digest == new_model.digest
        device_state = {k: torch.from_numpy(v.copy()) for k, v in
                        apply_delta({k: v.numpy() for k, v in device_state.items()}, chain.blob.blob,
                                    device_digest).items()}
        device_digest = new_model.digest
        coord_model = new_model
        err = max(float(np.abs(coord_state[k].numpy() - target[k]).max()) for k in SHAPES)
        assert 0 < err < (2e-2 if mode == "int8" else 1e-4)  # lossy, but close to the true aggregate


def _limits():  # type: ignore[no-untyped-def]
    from protocol import WireLimits

    return WireLimits()


def test_tampered_or_mismatched_deltas_are_refused() -> None:
    v0, v1, v2 = _versions(3, seed=2)
    held = {k: torch.from_numpy(v) for k, v in v0.items()}
    header = _header(v0)
    target = encode_state(v1)
    plan = Plan(2, (), 1.0, "fedavg", {}, {"name": "cnn"}, blob_digest(target), 1, len(target))
    good = make_delta(v0, v1, "exact", header)
    ref = DeltaRef(header.base_digest, blob_digest(good), 1, len(good))
    assert rebuild(good, ref, plan, held, _limits()) == (target, blob_digest(target))
    wrong_target = make_delta(v0, v2, "exact", header)  # a valid delta, to another model
    with pytest.raises(WireError, match="rebuilt model"):
        rebuild(wrong_target, DeltaRef(ref.base, blob_digest(wrong_target), 1, len(wrong_target)), plan, held,
                _limits())
    other_base = make_delta(v0, v1, "exact", UpdateHeader("fed", 2, "coordinator", "ab" * 32))
    with pytest.raises(WireError, match="against model"):
        rebuild(other_base, DeltaRef(ref.base, blob_digest(other_base), 1, len(other_base)), plan, held,
                _limits())
    flipped = bytearray(good)
    flipped[-1] ^= 0x40
    with pytest.raises(WireError):
        rebuild(bytes(flipped), DeltaRef(ref.base, blob_digest(flipped), 1, len(flipped)), plan, held, _limits())
    with pytest.raises(WireError, match="bytes"):
        rebuild(good, DeltaRef(ref.base, ref.digest, 1, len(good) + 1), plan, held, _limits())


def test_a_device_without_the_base_model_takes_the_full_model() -> None:
    v0, v1 = _versions(2)
    base = blob_digest(encode_state(v0))
    plan = Plan(2, (), 1.0, "fedavg", {}, {"name": "cnn"}, blob_digest(encode_state(v1)), 1, 10,
                delta={"base": base, "digest": "cd" * 32, "chunks": 1, "size": 5})
    held = {k: torch.from_numpy(v) for k, v in v0.items()}
    assert delta_source(plan, None) is None
    assert delta_source(plan, ("ef" * 32, held)) is None  # holds another model
    assert delta_source(plan, (base, held)) == DeltaRef(base, "cd" * 32, 1, 5)
    assert delta_source(Plan(2, (), 1.0, "fedavg", {}, {"name": "cnn"}, plan.model_digest, 1, 10),
                        (base, held)) is None  # no delta offered


def test_plan_delta_field_round_trips_and_is_checked() -> None:
    ref = {"base": "ab" * 32, "digest": "cd" * 32, "chunks": 2, "size": 900}
    plan = Plan(2, (), 1.0, "fedavg", {}, {"name": "cnn"}, "ef" * 32, 1, 10, delta=ref)
    _, got = decode_message(encode_message(plan, "fed", "coord"))
    assert got == plan and delta_ref(got.delta) == DeltaRef("ab" * 32, "cd" * 32, 2, 900)
    env = decode_envelope(encode_message(plan, "fed", "coord"))
    for bad in ({**ref, "chunks": 0}, {**ref, "base": "xyz"}, {"base": "ab" * 32}, {**ref, "size": True}):
        obj = {**json.loads(env.body), "delta": bad}
        with pytest.raises(WireError, match="delta"):
            from protocol.messages import _from_obj

            _from_obj(Plan, obj)


def test_make_delta_refuses_models_of_another_shape() -> None:
    v0, v1 = _versions(2)
    v1 = {**v1, "fc.bias": np.zeros(11, np.float32)}
    with pytest.raises(EncodeError, match="fc.bias"):
        make_delta(v0, v1, "exact", _header(v0))
    with pytest.raises(EncodeError, match="mode"):
        make_delta(v0, v0, "bf8", _header(v0))


def test_a_device_some_versions_behind_rebuilds_through_the_chain() -> None:
    """The coordinator keeps the deltas of the last CHAIN versions; a device holding an older one
    follows them step by step to the plan's model, bit for bit; one older than the chain takes none."""
    from protocol.model_delta import CHAIN

    versions = _versions(CHAIN + 3, seed=3)
    chain = DeltaChain("int8", "fed", "coordinator")
    state = {k: torch.from_numpy(v) for k, v in versions[0].items()}
    model = model_blob(state)
    held = [(model.digest, state)]
    for i, target in enumerate(versions[1:], start=2):
        state, model = chain.advance(model, state, {k: torch.from_numpy(v) for k, v in target.items()}, i)
        for link in chain.links:
            link.chunks = link.chunks or 1  # as if published
        held.append((model.digest, state))
    assert len(chain.links) == CHAIN
    walk = sum(link.blob.size for link in chain.links)
    # a model larger than the whole walk, so the device takes every step (with this small model's own size
    # the eight deltas cost more than the model, and a device that far behind takes the model: rule 4)
    plan = Plan(9, ("d",), 1.0, "fedavg", {}, {"name": "cnn"}, model.digest, 1, max(model.size, walk + 1),
                delta=chain.plan_field(model.digest), delta_chain=chain.chain_field(model.digest))
    assert len(plan.delta_chain) == CHAIN - 1
    real = dataclasses.replace(plan, model_size=model.size)
    assert (delta_source(real, held[-1 - CHAIN]) is None) == (walk >= model.size)
    blobs = {link.blob.digest: link.blob.blob for link in chain.links}
    device = held[-1 - CHAIN]  # CHAIN versions behind: the oldest link starts there
    steps = 0
    while device[0] != plan.model_digest:
        ref = delta_source(plan, device)
        assert ref is not None
        blob, digest = rebuild(blobs[ref.digest], ref, plan, device[1], _limits())
        device = (digest, {k: torch.from_numpy(v.copy()) for k, v in decode_state(blob).items()})
        steps += 1
    assert steps == CHAIN and device[0] == model.digest
    assert delta_source(plan, held[-2 - CHAIN]) is None  # older than the chain: the full model
    with pytest.raises(WireError):
        from protocol.model_delta import chain_refs

        chain_refs(["ab" * 32 + ":" + "cd" * 32 + ":" + "ef" * 32 + ":0:5"])


def test_make_delta_refuses_a_change_the_lossy_codec_cannot_hold_naming_the_tensor() -> None:
    """fp16 holds changes up to 65504 (65519 rounds to it) and none from 65520; int8 needs a positive,
    finite scale; no lossy mode takes a change float32 cannot hold. Exact takes them all."""
    v0 = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    held = {k: v.copy() for k, v in v0.items()}
    held["fc.bias"][2] = 65504.0
    blob = make_delta(v0, held, "fp16", _header(v0))
    assert apply_delta(v0, blob, _header(v0).base_digest)["fc.bias"][2] == 65504.0
    cases = [("fp16", "fc.bias", 65520.0, "fp16"), ("fp16", "conv.bias", -1e6, "fp16"),
             ("int8", "fc.weight", 1e-44, "int8 scale"), ("int8", "fc.bias", np.finfo(np.float32).max, "int8 scale")]
    for mode, name, value, why in cases:
        target = {k: v.copy() for k, v in v0.items()}
        target[name].reshape(-1)[1] = value
        with pytest.raises(EncodeError, match=f"tensor '{name}'.*{why}"):
            make_delta(v0, target, mode, _header(v0))
        exact = make_delta(v0, target, "exact", _header(v0))
        assert apply_delta(v0, exact, _header(v0).base_digest)[name].reshape(-1)[1] == np.float32(value)
    far = {k: v.copy() for k, v in v0.items()}
    far["fc.bias"][0], v0["fc.bias"][0] = 3e38, -3e38  # the change is +inf in float32
    for mode in ("fp16", "int8"):
        with pytest.raises(EncodeError, match="'fc.bias' changes by more than float32 can hold"):
            make_delta(v0, far, mode, _header(v0))
