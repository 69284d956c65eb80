"""One hostile device with real credentials against a live coordinator (the real server loop, in this
process) on a real Mosquitto, beside two honest devices: a finite but huge update claiming 2**32-1
samples, a poisoned update that would make the aggregate non-finite (quarantined, and the coordinator
restarts cleanly over its folder), decompression bombs as a round opens, and retained junk under its
update topics. In each: every honest update of the attacked round is aggregated, the coordinator
stays up, the global model stays finite, and each refusal is counted by reason."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from campaign import SELECTED, T, live_coordinator
from craft import Device, honest_update
from faultlib import FEDERATION, wait_until
from fedtestlib import FedBroker, Recorder

from coordinator.server import Coordinator
from flayer.engine import initial_global_state
from flayer.update import TensorDelta, Update
from mqtt_broker import mosquitto_available
from protocol import UpdateHeader, UpdateOptions, decode_update, encode_update

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]
BIG = np.float32(3.0e38)


def _shapes(coord: Coordinator) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}


def _finished(coord: Coordinator, thread: Any) -> Any:
    thread.join(60)
    result = coord._thread_result  # type: ignore[attr-defined]
    assert not isinstance(result, BaseException) and result is not None and result.finished, result
    assert all(bool(torch.isfinite(v).all()) for v in result.global_state.values())
    return result


def _huge(shapes: dict[str, tuple[int, ...]], header: UpdateHeader, samples: int = 2**32 - 1) -> bytes:
    """Every delta 3e38: finite, so no value check refuses it."""
    deltas = {k: TensorDelta(s, np.full(int(np.prod(s)), BIG, np.float32)) for k, s in shapes.items()}
    return encode_update(Update(deltas, samples), header)


def test_huge_finite_update_and_huge_sample_count(tmp_path: Path, live_fed: FedBroker, faults_ledger: Any) -> None:
    """Default settings (no norm_bound): the 3e38 update is over the automatic bound (refused,
    ``norm``); an honest-sized update claiming 2**32-1 samples is folded with weight max_samples."""
    coord = live_coordinator(tmp_path, live_fed, rounds=1, max_samples=1000)
    thread = coord.start()
    a, b, c = (Device(live_fed.devices[d], T) for d in SELECTED)
    try:
        plan = a.plan(1)
        shapes = _shapes(coord)
        hd = {d.id: UpdateHeader(FEDERATION, 1, d.id, plan.model_digest) for d in (a, b, c)}
        assert a.ack(a.send(_huge(shapes, hd["dev-a"]), 1)).status == "rejected"
        greedy = honest_update(shapes, hd["dev-a"], seed=7, samples=2**32 - 1)
        blobs = {"dev-b": honest_update(shapes, hd["dev-b"], seed=1), "dev-c": honest_update(shapes, hd["dev-c"], seed=2)}
        assert a.ack(a.send(greedy, 1)).status == "accepted"
        for dev in (b, c):
            assert dev.ack(dev.send(blobs[dev.id], 1)).status == "accepted"
        result = _finished(coord, thread)
        rec = result.history[0]
        assert rec["accepted"] == 3 and rec["rejected"] == {"norm": 1} and rec["weight_capped"] == 1
        agg = coord.strategy.aggregator(initial_global_state(coord.strategy, 0))
        agg.fold(decode_update(greedy).update, weight=1000.0)
        for d in ("dev-b", "dev-c"):
            agg.fold(decode_update(blobs[d]).update)
        want = agg.result()
        assert all(torch.equal(result.global_state[k], want[k]) for k in want)
        faults_ledger.bad_input("finite 3e38 update, 2**32-1 samples (automatic bound)", 1, 1)
        faults_ledger.attack("huge finite update + 2**32-1 samples", 2, honest_lost=0, crashes=0)
    finally:
        for dev in (a, b, c):
            dev.close()
        coord.stop()


def _poison(header: UpdateHeader) -> bytes:
    """3e38 on one coordinate, claiming the most samples: two rounds of it overflow fp32."""
    return encode_update(Update({"fc.bias": TensorDelta((10,), np.array([BIG], np.float32), np.array([0]))},
                                2**32 - 1), header)


def test_poison_that_overflows_the_aggregate_is_quarantined(
    tmp_path: Path, live_fed: FedBroker, faults_ledger: Any
) -> None:
    """With a bound loose enough to let it through, the attacker's second 3e38 push would make the
    aggregate Inf: the update is quarantined (logged, counted), the honest ones are folded, and the
    coordinator restarted over its folder mid-round replays the journal without crashing."""
    kw = {"norm_bound": 1e300, "max_samples": 2**32}
    coord = live_coordinator(tmp_path, live_fed, rounds=2, **kw)
    thread = coord.start()
    a, b, c = (Device(live_fed.devices[d], T) for d in SELECTED)
    try:
        shapes = _shapes(coord)
        for r in (1, 2):
            plan = a.plan(r)
            hd = {d.id: UpdateHeader(FEDERATION, r, d.id, plan.model_digest) for d in (a, b, c)}
            assert a.ack(a.send(_poison(hd["dev-a"]), r)).status == "accepted"
            if r == 2:  # the poison is journaled: the coordinator stops, a new one takes over its folder
                coord.stop()
                thread.join(30)
                coord = live_coordinator(tmp_path, live_fed, rounds=2, **kw)
                thread = coord.start()
                wait_until(lambda c=coord: c.open is not None and "dev-a" in c.open.accepted, 30, "the replay")
            for i, dev in enumerate((b, c)):
                assert dev.ack(dev.send(honest_update(shapes, hd[dev.id], seed=10 * r + i), r)).status == "accepted"
        result = _finished(coord, thread)
        assert float(result.global_state["fc.bias"][0]) > 1e38  # round 1's push went through (finite)
        last = result.history[-1]
        assert last["round"] == 2 and last["accepted"] == 2 and last["rejected"] == {"quarantined": 1}
        lines = [json.loads(x) for x in (tmp_path / "coord" / "quarantine.jsonl").read_text().splitlines()]
        assert [(x["round"], x["client"]) for x in lines] == [(2, "dev-a")] and "not finite" in lines[0]["reason"]
        again = live_coordinator(tmp_path, live_fed, rounds=2, **kw)  # a restart after the run: clean
        t3 = again.start()
        assert _finished(again, t3).rounds_done == 2
        faults_ledger.bad_input("update that makes the aggregate Inf (quarantined)", 1, 1)
        faults_ledger.attack("overflowing update, journaled, restart", 2, honest_lost=0, crashes=0)
    finally:
        for dev in (a, b, c):
            dev.close()
        coord.stop()


def _bomb(header: UpdateHeader) -> bytes:
    """About 2 KB on the wire, a 64 MiB zstd payload declared (a tensor the model lacks)."""
    pad = 16 * 2**20
    return encode_update(Update({"pad": TensorDelta((pad,), np.zeros(pad, np.float32))}, 50), header,
                         UpdateOptions(zstd=True, zstd_level=1))


def test_decompression_bombs_as_a_round_opens(tmp_path: Path, live_fed: FedBroker, faults_ledger: Any) -> None:
    """1,000 bombs from one device before the honest updates: the first is refused from its header
    (``oversize``: more than the model can hold, nothing decompressed), the device is cut off after
    max_malformed refusals (``cut_off``), and the round closes on quorum, not at its deadline."""
    n = 1000
    coord = live_coordinator(tmp_path, live_fed, rounds=1, quorum=2, min_devices=3, over_selection=1.5,
                             deadline_s=60.0)
    thread = coord.start()
    a, b, c = (Device(live_fed.devices[d], T) for d in SELECTED)
    try:
        plan = a.plan(1)
        shapes = _shapes(coord)
        bomb = _bomb(UpdateHeader(FEDERATION, 1, "dev-a", plan.model_digest))
        assert len(bomb) < 4000
        t0 = time.monotonic()
        a.send_chunks([a_chunk(bomb)] * n, 1, [0] * n)
        for i, dev in enumerate((b, c)):
            blob = honest_update(shapes, UpdateHeader(FEDERATION, 1, dev.id, plan.model_digest), seed=i)
            assert dev.ack(dev.send(blob, 1), 30).status == "accepted"
        result = _finished(coord, thread)
        assert time.monotonic() - t0 < 30
        rec = result.history[0]
        assert rec["accepted"] == 2 and rec["closed"].startswith("quorum")
        assert rec["rejected"].get("oversize") == 3 and rec["rejected"]["oversize"] + rec["rejected"].get("cut_off", 0) \
            + rec["rejected"].get("queue_full", 0) == n, rec["rejected"]
        faults_ledger.bad_input("decompression bombs (64 MiB declared in 2 KB)", n, n)
        faults_ledger.attack("decompression bombs as a round opens", n, honest_lost=0, crashes=0)
    finally:
        for dev in (a, b, c):
            dev.close()
        coord.stop()


def a_chunk(blob: bytes) -> bytes:
    from craft import chunks

    (one,) = chunks(blob, "dev-a", 1, size=len(blob) + 200)
    return one


def test_retained_junk_is_never_input_and_is_cleared(tmp_path: Path, live_fed: FedBroker, faults_ledger: Any) -> None:
    """Retained messages under the attacker's update and metrics topics: live, they are bad input
    (and cut the sender off for the round); when the broker re-sends them as retained (the coordinator
    subscribes again at each round's close) they are counted ``retained``, ignored and emptied, so a
    new subscriber finds nothing retained there."""
    n = 20
    coord = live_coordinator(tmp_path, live_fed, rounds=2, quorum=2, min_devices=3, over_selection=1.5)
    thread = coord.start()
    a, b, c = (Device(live_fed.devices[d], T) for d in SELECTED)
    try:
        shapes = _shapes(coord)
        a.plan(1)
        junk = [(T.update_chunk("dev-a", 1, i), bytes([i]) * 100_000) for i in range(n)]
        a.publish([*junk, (T.metrics("dev-a"), b"junk")], retain=True)
        for r in (1, 2):
            plan = a.plan(r)
            for i, dev in enumerate((b, c)):
                blob = honest_update(shapes, UpdateHeader(FEDERATION, r, dev.id, plan.model_digest), seed=i)
                assert dev.ack(dev.send(blob, r), 30).status == "accepted"
        result = _finished(coord, thread)
        assert result.counters["retained"] == n + 1 and [h["accepted"] for h in result.history] == [2, 2]
        probe = Recorder(live_fed.coordinator, [T.all_updates(), T.all_metrics()])
        try:  # retained messages come right after the SUBACK, before a message published later
            a.publish([(T.metrics("dev-a"), b"marker")])
            assert probe.wait_message(lambda m: m.payload == b"marker", 10) is not None
            assert [m.topic for m in probe.messages if m.retain and m.payload] == []
        finally:
            probe.close()
        faults_ledger.bad_input("retained junk under update/ and metrics/", n + 1, result.counters["retained"])
        faults_ledger.attack("retained junk", n + 1, honest_lost=0, crashes=0)
    finally:
        for dev in (a, b, c):
            dev.close()
        coord.stop()


def test_devices_survive_a_huge_finite_global_model(
    tmp_path: Path, live_fed: FedBroker, digits_shards: list, faults_ledger: Any
) -> None:
    """The reported attack with every bound off (``norm_auto = 0``, a weight cap above 2**32): round 1
    folds the attacker's 3e38 update, so round 2's model is finite but huge. The honest devices (real
    EdgeClients) get NaN gradient norms on it: each skips round 2 with a reported reason and neither
    exits; round 2 closes at its deadline, and the federation finishes."""
    from edge_client.client import EdgeClient
    from edge_client.config import EdgeSettings

    coord = live_coordinator(tmp_path, live_fed, rounds=2, norm_auto=0.0, max_samples=2**33, deadline_s=8.0)
    thread = coord.start()
    a = Device(live_fed.devices["dev-a"], T)
    devices = [EdgeClient(EdgeSettings(state_dir=str(tmp_path / d), client_index=i, device="cpu", heartbeat_s=1.0),
                          live_fed.devices[d], digits_shards[i]) for i, d in enumerate(("dev-b", "dev-c"))]
    try:
        for dev in devices:
            dev.start()
        plan = a.plan(1)
        assert a.ack(a.send(_huge(_shapes(coord), UpdateHeader(FEDERATION, 1, "dev-a", plan.model_digest)), 1)).status \
            == "accepted"
        result = _finished(coord, thread)
        assert [h["accepted"] for h in result.history] == [3, 0]
        for dev in devices:
            assert dev.wait(30) and dev.error is None and dev.finished, dev.error
            assert dev.rounds_trained == [1] and "round 2" in dev.skipped[2], dev.skipped
        faults_ledger.fault("huge finite global model (bounds off): devices skip the round, never exit", 1, True,
                            3, 3)
    finally:
        a.close()
        for dev in devices:
            dev.stop()
        coord.stop()
