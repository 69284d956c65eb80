"""Counting the devices whose update exceeded C from the coordinator's records (docs/reference/private-fields.md:
nothing data-dependent beyond the noised release in central mode, unless the table lists it).

The adversary reads the coordinator's round records -- ``clipped`` in ``metrics.jsonl``, on the dashboard, and
``flayer_updates_clipped_total`` on the Prometheus exporter -- not the updates. In a private round (central mode,
fixed clipping) the device clips its upload to C and the coordinator clips every update again to C (device
clipping is not trusted), counting the updates it had to scale down. If an honestly clipped upload can come out
a hair above C (the clip's float32 rounding), the count is about half the devices whose update was over C: a
data-dependent figure, released without noise, that only adaptive clipping means to release (noised).

Run on the devices' own upload path (:func:`edge_client.work.train_and_encode`) and the coordinator's intake
verdict (:func:`flayer.engine.gate.admit` with the private round's server bound), with one bound on the whole upload
and with per-layer bounds (``clip_split``: each layer to its C_i, sum_i C_i^2 = C^2). The guarantee: no honest
private upload is counted as clipped, so the count says nothing of the devices' data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from coordinator.publish import model_blob
from edge_client.work import StrategyCache, round_context, train_and_encode
from flayer.engine import initial_global_state
from flayer.engine.gate import Bounds, admit
from flayer.engine.privacy import RoundPrivacy, server_bound, upload_norm
from flayer.partition import make_partition
from flayer.train import client_data
from protocol import Plan, WireLimits, decode_update

C, DEVICES, ROUNDS = 0.01, 4, 3  # C far below an update's norm: every device clips


@pytest.mark.parametrize("split", ["total", "sqrt", "equal"])  # one bound on the upload, or one a layer
def test_no_honest_private_upload_is_counted_as_clipped(digits: Any, split: str) -> None:
    part = make_partition(digits.y, digits.num_classes, DEVICES, "iid", 0, samples=200)
    spec = dataclasses.asdict(digits.model_spec())
    base = {"round": 1, "selected": tuple(f"dev-{i}" for i in range(DEVICES)), "deadline": 1e9, "strategy": "fedavg",
            "options": {}, "model": spec, "model_digest": "ab" * 32, "model_chunks": 1, "model_size": 1, "seed": 3,
            "train": {"lr": 0.05, "batch_size": 10, "local_epochs": 1}}
    strategy = StrategyCache({"device": "cpu"}).get(Plan(**base))  # type: ignore[arg-type]
    g = initial_global_state(strategy, 3)
    rp = RoundPrivacy("central", C, 1.0, 1.0, DEVICES, clip_split=split)
    bounds = Bounds(server_bound(rp, sum(v.numel() for v in g.values())), "clip")  # coordinator.open_round
    over, clipped = 0, 0
    for r in range(1, ROUNDS + 1):
        plan = Plan(**{**base, "round": r, "model_digest": model_blob(g).digest, "privacy": rp.as_plan()})
        for i in range(DEVICES):
            up = train_and_encode(strategy, plan, g, strategy.initial_state(), client_data(digits, part.clients[i]),
                                  round_context(plan, i, torch.device("cpu")), federation="fed", sender=f"dev-{i}",
                                  max_payload=1 << 20, max_update_bytes=0, amp=False)
            update = decode_update(up.blob, WireLimits()).update  # what the coordinator receives
            verdict = admit(update, upload_norm(update), bounds)
            assert verdict.accepted
            over += 1
            clipped += int(verdict.clipped)
    assert clipped == 0, (f"{clipped} of {over} honest private uploads (every one clipped on its device) were counted "
                          f"as clipped by the coordinator: the round records release how many devices' updates "
                          f"exceeded C, un-noised")
