"""FLAYER's public positions are computed once a round and shared by the round's devices: each device's masks
are exactly those computed afresh from the round's public seed, and a new round gets its own."""

from __future__ import annotations

import torch

import flayer.strategies.flayer as flayer_mod
from flayer.config import TrainConfig
from flayer.models import ModelSpec
from flayer.strategies import make_strategy
from flayer.strategies.base import RoundContext
from flayer.strategies.flayer import public_seed
from flayer.train import ClientData, Split


def _change(strategy, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: torch.randn(p.shape) for n, p in strategy.new_model().named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] is None and b[k] is None) or
                                        (a[k] is not None and b[k] is not None and torch.equal(a[k], b[k])) for k in a)


def test_public_masks_are_the_fresh_ones_once_a_round(monkeypatch):
    strategy = make_strategy("flayer", ModelSpec("cnn", 1, 28, 28, 10), TrainConfig(), {"positions": "public"})
    drawn = []
    scores = flayer_mod.public_scores
    monkeypatch.setattr(flayer_mod, "public_scores", lambda change, seed: drawn.append(seed) or scores(change, seed))
    seeds = [public_seed(RoundContext(round=r, client=c, seed=0)) for r, c in ((1, 0), (1, 7), (2, 0))]
    assert seeds[0] == seeds[1] != seeds[2]  # the round's seed, never the device's
    fresh = [strategy._masks(scores(_change(strategy, 0), s)) for s in seeds]
    assert not _same(fresh[0], fresh[2])  # a stale round's masks would show
    got = [strategy.public_masks(_change(strategy, dev), s) for dev, s in enumerate(seeds)]
    assert drawn == [seeds[0], seeds[2]]  # two devices of round 1: drawn once; round 2: drawn again
    assert all(_same(g, f) for g, f in zip(got, fresh))
    assert any(m is not None for m in got[0].values())
    got[0]["conv1.0.weight"] = None  # a device's dict is its own
    assert _same(strategy.public_masks(_change(strategy, 1), seeds[2]), fresh[2])
    assert _same(strategy.public_masks(_change(strategy, 1), seeds[0]), fresh[0])


def _data(seed: int) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    mean, std = torch.tensor([0.5]).view(1, -1, 1, 1), torch.tensor([0.25]).view(1, -1, 1, 1)

    def split(n: int) -> Split:
        return Split(torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8),
                     torch.randint(0, 10, (n,), generator=g), mean, std)

    return ClientData(split(12), split(4), split(4))


def test_devices_of_a_round_upload_at_the_fresh_public_positions():
    strategy = make_strategy("flayer", ModelSpec("cnn", 1, 28, 28, 10), TrainConfig(batch_size=4),
                             {"positions": "public"})
    torch.manual_seed(5)
    g = {k: v.clone() for k, v in strategy.new_model().state_dict().items()}
    uploads = {}
    for r, c in ((1, 0), (1, 1), (2, 0)):
        ctx = RoundContext(round=r, client=c, seed=3)
        state = strategy.initial_state()
        model = strategy.receive(g, state, _data(c), ctx)
        uploads[(r, c)] = strategy.local_round(model, g, state, _data(c), ctx).update
    shapes = {n: torch.zeros(p.shape) for n, p in strategy.new_model().named_parameters()}
    for r, c in uploads:
        fresh = strategy._masks(flayer_mod.public_scores(shapes, public_seed(RoundContext(round=r, client=c, seed=3))))
        for name, m in fresh.items():
            idx = uploads[(r, c)].deltas[name].indices
            assert (m is None and idx is None) or (idx is not None and m is not None and idx.tolist() == m.tolist())
    assert uploads[(1, 0)].deltas["conv1.0.weight"].indices.tolist() != uploads[(2, 0)].deltas["conv1.0.weight"].indices.tolist()
