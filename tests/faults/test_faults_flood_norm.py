"""Two more bad inputs against a live coordinator, each needing its own run: a flood of unfinished
update blobs from one device (it must not lock the others out), and a huge update norm with no
bound, with a bound and policy ``reject``, and with a bound and policy ``clip``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from campaign import SELECTED, T, fold, live_coordinator
from craft import Device, chunks, honest_update, sparse_update
from faultlib import FEDERATION, wait_until
from fedtestlib import FedBroker

from flayer.engine import scale_update
from flayer.aggregate import check_update
from flayer.engine import initial_global_state
from mqtt_broker import mosquitto_available
from protocol import UpdateHeader, decode_update

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]


def test_a_flood_of_unfinished_blobs_does_not_lock_out_other_devices(
    tmp_path: Path, live_fed: FedBroker, faults_ledger: Any
) -> None:
    coord = live_coordinator(tmp_path, live_fed, rounds=1, max_malformed=10_000)  # the flood is not cut off
    thread = coord.start()
    a, b, c = (Device(live_fed.devices[d], T) for d in SELECTED)
    n = 4200  # more than the collector's whole budget of unfinished blobs (4096)
    try:
        plan = a.plan(1)
        shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
        flood = []
        for i in range(n):  # two-chunk blobs of which only the first chunk ever comes
            blob = sparse_update(
                UpdateHeader(FEDERATION, 1, "dev-a", plan.model_digest),
                "fc.bias",
                (10,),
                [0.001 * (i + 1)] * 10,
            )
            flood.append(chunks(blob, "dev-a", 1, size=len(blob) // 2 + 80)[0])
        a.send_chunks(flood, 1, [0] * n)
        a.publish([(T.metrics("dev-a"), b"after the flood")])  # arrives after it: a marker
        wait_until(lambda: coord.counters["bad_message"] or not thread.is_alive(), 60, "the flood")
        honest = {
            d.id: honest_update(shapes, UpdateHeader(FEDERATION, 1, d.id, plan.model_digest), seed=i)
            for i, d in enumerate((a, b, c))
        }
        for dev in (b, c, a):
            assert dev.ack(dev.send(honest[dev.id], 1), 15).status == "accepted", f"{dev.id} was locked out"
        thread.join(60)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished
        assert result.history[0]["rejected"] == {"incomplete": n, "bad_message": 1}
        g1 = fold(
            coord, initial_global_state(coord.strategy, 0), [honest[d] for d in ("dev-b", "dev-c", "dev-a")]
        )
        assert all(torch.equal(result.global_state[k], g1[k]) for k in g1)
        faults_ledger.bad_input("flood of unfinished blobs", n, result.history[0]["rejected"]["incomplete"])
    finally:
        for dev in (a, b, c):
            dev.close()
        coord.stop()


@pytest.mark.parametrize("policy", ["off", "auto", "reject", "clip"])
def test_huge_norm_with_and_without_a_bound(
    tmp_path: Path, live_fed: FedBroker, policy: str, faults_ledger: Any
) -> None:
    """No bound (``norm_auto = 0``): a large (finite) update is within a device's role and is folded.
    ``auto`` (the default: no ``norm_bound``; in round 1, 10 x the model's own norm) and ``reject``
    (an explicit bound): refused (counter ``norm``). ``clip``: scaled down to the bound and folded
    (counter ``clipped``)."""
    kw: dict[str, Any] = {"off": {"norm_auto": 0.0}, "auto": {}}.get(policy, {"norm_bound": 5.0,
                                                                            "norm_policy": policy})
    refused = policy in ("auto", "reject")
    coord = live_coordinator(tmp_path, live_fed, rounds=1, **kw)
    thread = coord.start()
    a, b, c = (Device(live_fed.devices[d], T) for d in SELECTED)
    try:
        plan = a.plan(1)
        shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
        hd = {d.id: UpdateHeader(FEDERATION, 1, d.id, plan.model_digest) for d in (a, b, c)}
        huge = honest_update(shapes, hd["dev-a"], seed=9, scale=10.0)
        norm = check_update(decode_update(huge).update, shapes)  # the coordinator's own norm
        assert norm > 1000
        status = a.ack(a.send(huge, 1)).status
        assert status == ("rejected" if refused else "accepted")
        blobs = {d.id: honest_update(shapes, hd[d.id], seed=i) for i, d in enumerate((b, c))}
        for dev in (b, c):
            assert dev.ack(dev.send(blobs[dev.id], 1)).status == "accepted"
        if refused:  # dev-a sends an honest update after all
            blobs["dev-a"] = honest_update(shapes, hd["dev-a"], seed=2)
            assert a.ack(a.send(blobs["dev-a"], 1)).status == "accepted"
        thread.join(60)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished
        g0 = initial_global_state(coord.strategy, 0)
        agg = coord.strategy.aggregator(g0)
        if not refused:
            up = decode_update(huge).update
            agg.fold(scale_update(up, 5.0 / norm * (1 - 1e-6)) if policy == "clip" else up)
        for d in ("dev-b", "dev-c") if not refused else ("dev-b", "dev-c", "dev-a"):
            agg.fold(decode_update(blobs[d]).update)
        want = agg.result()
        assert all(torch.equal(result.global_state[k], want[k]) for k in want)
        assert all(bool(torch.isfinite(v).all()) for v in result.global_state.values())
        rejected, clipped = result.history[0]["rejected"], result.history[0]["clipped"]
        if refused:
            assert rejected == {"norm": 1} and clipped == 0
            faults_ledger.bad_input(f"huge norm ({'automatic bound' if policy == 'auto' else 'norm_bound'}, "
                                    f"policy reject)", 1, 1)
        elif policy == "clip":
            assert rejected == {} and clipped == 1 and result.counters["clipped"] == 1
            faults_ledger.bad_input("huge norm (norm_bound, policy clip: clipped)", 1, 1)
        else:
            assert rejected == {} and clipped == 0
    finally:
        for dev in (a, b, c):
            dev.close()
        coord.stop()
