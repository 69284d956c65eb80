"""The coordinator's delta chain under the field's edge cases: a round that folds nothing adds no link
from a model to itself, and a change a lossy codec cannot hold travels as an exact delta (no
EncodeError out of the round's close)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from coordinator.deltas import DeltaChain
from coordinator.publish import ModelBlob, model_blob
from protocol import decode_update
from protocol.model_delta import MODE_KEY, apply_delta

SHAPES = {"conv.weight": (4, 1, 3, 3), "fc.weight": (10, 36), "fc.bias": (10,)}
F32_MAX = float(np.finfo(np.float32).max)


def _state(seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {k: torch.from_numpy(rng.normal(size=s).astype(np.float32)) for k, s in SHAPES.items()}


def _moved(state: dict[str, torch.Tensor], seed: int, share: float = 0.3) -> dict[str, torch.Tensor]:
    """``state`` with a random ``share`` of its coordinates moved a little (a round's aggregate)."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in state.items():
        step = rng.normal(scale=1e-2, size=v.shape).astype(np.float32) * (rng.random(v.shape) < share)
        out[k] = torch.from_numpy(v.numpy() + step)
    return out


def _numpy(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in state.items()}


def _mode_of(link_blob: ModelBlob) -> float:
    return decode_update(link_blob.blob).update.info[MODE_KEY]


@pytest.mark.parametrize("mode", ["exact", "fp16", "int8"])
def test_a_round_that_folds_nothing_keeps_the_chain_and_adds_no_self_link(mode: str) -> None:
    chain = DeltaChain(mode, "fed", "coordinator")
    s0 = _state(0)
    m0 = model_blob(s0)
    s1, m1 = chain.advance(m0, s0, _moved(s0, 1), 2)
    assert [(x.base, x.target) for x in chain.links] == [(m0.digest, m1.digest)]
    # round 2 folds nothing: the aggregate is the model it started from, bit for bit
    s2, m2 = chain.advance(m1, s1, {k: v.clone() for k, v in s1.items()}, 3)
    assert m2.digest == m1.digest and model_blob(s2).digest == m1.digest
    assert [(x.base, x.target) for x in chain.links] == [(m0.digest, m1.digest)]  # unchanged: no m1 -> m1
    # the next round that changes the model extends the same chain from m1
    _, m3 = chain.advance(m2, s2, _moved(s2, 3), 4)
    assert [(x.base, x.target) for x in chain.links] == [(m0.digest, m1.digest), (m1.digest, m3.digest)]
    assert all(x.base != x.target for x in chain.links)


@pytest.mark.parametrize("jump", [65520.0, 1e6])
def test_a_change_beyond_fp16_goes_exact_with_a_log_line(jump: float, caplog: pytest.LogCaptureFixture) -> None:
    """fp16 holds no magnitude from 65,520 up: such a round's delta is sent exact, the model published
    is the true aggregate (no reconstruction), and a device rebuilds it bit for bit."""
    chain = DeltaChain("fp16", "fed", "coordinator")
    s0 = _state(0)
    m0 = model_blob(s0)
    target = _moved(s0, 1)
    target["fc.weight"][3, 7] += jump
    with caplog.at_level(logging.WARNING, logger="coordinator.deltas"):
        state, model = chain.advance(m0, s0, target, 2)
    assert model.digest == model_blob(target).digest  # the exact aggregate, not an fp16 reconstruction
    assert chain.blob is not None and chain.target == model.digest and _mode_of(chain.blob) == 0.0  # replace
    rebuilt = apply_delta(_numpy(s0), chain.blob.blob, m0.digest)
    assert model_blob({k: torch.from_numpy(v) for k, v in rebuilt.items()}).digest == model.digest
    assert any("fp16 delta cannot hold" in r.getMessage() and "fc.weight" in r.getMessage()
               and "exact" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    # the next ordinary round is fp16 again
    _, m2 = chain.advance(model, state, _moved(state, 2), 3)
    assert chain.target == m2.digest and _mode_of(chain.blob) == 1.0 and len(chain.links) == 2


@pytest.mark.parametrize("case", ["change overflows float32", "reconstruction overflows", "scale overflows",
                                  "scale underflows"])
def test_a_change_int8_cannot_hold_goes_exact(case: str, caplog: pytest.LogCaptureFixture) -> None:
    chain = DeltaChain("int8", "fed", "coordinator")
    s0 = _state(0)
    target = _moved(s0, 1)
    if case == "change overflows float32":  # new - old is +inf in float32
        s0["fc.bias"][0], target["fc.bias"][0] = -3e38, 3e38
    elif case == "reconstruction overflows":  # old + decoded rounds past float32's largest value
        s0["fc.bias"][:2] = torch.tensor([3.4e38, 0.0])
        target["fc.bias"][:2] = torch.tensor([F32_MAX, 1e37])
    elif case == "scale overflows":  # 127 * scale is beyond float32
        s0["fc.bias"][0], target["fc.bias"][0] = 0.0, F32_MAX
    else:  # the only change is so small its scale is 0: int8 would send nothing
        s0["fc.bias"][0] = 0.0
        target = {k: v.clone() for k, v in s0.items()}
        target["fc.bias"][0] = 1e-44
    m0 = model_blob(s0)
    with caplog.at_level(logging.WARNING, logger="coordinator.deltas"):
        _, model = chain.advance(m0, s0, target, 2)
    assert model.digest == model_blob(target).digest != m0.digest
    assert chain.blob is not None and _mode_of(chain.blob) == 0.0
    assert any("int8 delta cannot hold" in r.getMessage() for r in caplog.records)

