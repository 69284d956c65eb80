"""A coordinator that leaves out ``positions = "public"`` from a private plan (docs/explanation/privacy.md,
"Positions that do not leak", and "Who learns what": the local-mode figure against the coordinator "holds
whatever the coordinator does").

The adversary holds the coordinator's signing key, so it writes any plan it likes: here a private local-mode
round of FLAYER whose ``options`` do not name ``positions`` (FLAYER's default is then ``topk``: each layer uploads
the entries whose change was largest -- the device's own data), or name ``positions = "topk"`` outright. An
honest coordinator always runs :func:`flayer.engine.privacy.private_strategy`, which rewrites the option to
``public``; nothing makes a hostile one do so. The coordinator then reads what each device sends (local mode
without secure aggregation: every upload), in particular its indices, which no noise covers.

The guarantee: a device whose upload positions would follow its data refuses the private round (SkipRound), or
the positions it sends are the round's public ones -- the same for two devices with different data in the same
round. Run against the device's own code: :func:`edge_client.work.train_and_encode`, what every upload goes
through.

Found by a red team: on the code before, the device trained and sent each tensor at its own top-|change| positions
(two devices of one round sent different index sets) while booking z / sqrt(m); now it refuses the plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from coordinator.publish import model_blob
from edge_client.work import SkipRound, StrategyCache, round_context, train_and_encode
from flayer.engine import initial_global_state
from flayer.engine.privacy import RoundPrivacy
from flayer.partition import make_partition
from flayer.train import client_data
from protocol import Plan, WireLimits, decode_update

C, Z, M = 0.5, 1.0, 2
SELECTED = ("dev-1", "dev-2")


@pytest.fixture(scope="module")
def setup(digits: Any) -> Any:
    parts = make_partition(digits.y, digits.num_classes, 2, "pat2", 0).clients
    shards = [client_data(digits, parts[0]), client_data(digits, parts[1])]
    spec = dataclasses.asdict(digits.model_spec())
    base = {"round": 2, "selected": SELECTED, "deadline": 1e9, "strategy": "flayer", "options": {"head_layers": 1},
            "model": spec, "model_digest": "ab" * 32, "model_chunks": 1, "model_size": 1, "seed": 3, "rounds": 5,
            "train": {"lr": 0.05, "batch_size": 10, "local_epochs": 1},
            "privacy": RoundPrivacy("local", C, Z, Z, M).as_plan()}
    strategy = StrategyCache({"device": "cpu"}).get(Plan(**base))  # type: ignore[arg-type]
    g = initial_global_state(strategy, 3)
    return shards, g, {**base, "model_digest": model_blob(g).digest}


def _positions(setup: Any, options: dict[str, Any], device: int) -> dict[str, tuple[int, ...]] | None:
    """The positions a device's upload carries, as the coordinator decodes them (None: it refused the round)."""
    shards, g, base = setup
    plan = Plan(**{**base, "options": {**base["options"], **options}})
    strategy = StrategyCache({"device": "cpu"}).get(plan)
    try:
        up = train_and_encode(strategy, plan, g, strategy.initial_state(), shards[device],
                              round_context(plan, device, torch.device("cpu")), federation="fed",
                              sender=SELECTED[device], max_payload=1 << 20, max_update_bytes=0, amp=False)
    except SkipRound:
        return None
    update = decode_update(up.blob, WireLimits()).update
    return {k: tuple(np.asarray(d.indices).tolist()) if d.indices is not None else () for k, d in update.deltas.items()}


def test_control_public_positions_are_the_same_for_both_devices(setup: Any) -> None:
    a, b = _positions(setup, {"positions": "public"}, 0), _positions(setup, {"positions": "public"}, 1)
    assert a is not None and b is not None
    assert any(a.values()), "FLAYER's upload is sparse here: there are positions to compare"
    assert a == b


@pytest.mark.parametrize("options", [{}, {"positions": "topk"}], ids=["positions-unset", "positions-topk"])
def test_a_private_plan_without_public_positions_does_not_leak_them(setup: Any, options: dict[str, Any]) -> None:
    a, b = _positions(setup, options, 0), _positions(setup, options, 1)
    if a is None and b is None:
        return  # refused: nothing reached the coordinator
    assert a is not None and b is not None
    differ = [k for k in a if a[k] != b.get(k)]
    assert not differ, (f"in a private local-mode round the coordinator received upload positions chosen from each "
                        f"device's data (tensors {differ} differ between two devices of one round; no noise covers "
                        f"the indices), while each device books z / sqrt(m) = {Z / M ** 0.5:.3g}")


@pytest.mark.parametrize("clip", [1e5, 0.5], ids=["clip-past-fp16", "clip-within-fp16"])
def test_a_plan_whose_codec_cannot_carry_its_clip_is_refused_not_fatal(setup: Any, clip: float) -> None:
    """A coordinator that names value codec fp16 beside a clip fp16 cannot hold (legal up to 1e6): the device refuses
    the round before training (a public fact), where an encoding error past fp16's range had stopped its worker."""
    shards, g, base = setup
    plan = Plan(**{**base, "options": {**base["options"], "positions": "public"}, "value_codec": "fp16",
                   "privacy": RoundPrivacy("local", clip, Z, Z, M).as_plan()})
    strategy = StrategyCache({"device": "cpu"}).get(plan)
    run = (lambda: train_and_encode(strategy, plan, g, strategy.initial_state(), shards[0],
                                    round_context(plan, 0, torch.device("cpu")), federation="fed", sender=SELECTED[0],
                                    max_payload=1 << 20, max_update_bytes=0, amp=False))
    if clip >= 65504:
        with pytest.raises(SkipRound, match="fp16"):
            run()
    else:
        assert run().blob
