"""Bad input against a live coordinator (the real server loop on a real Mosquitto), published by
authorised devices with their real credentials: random and mutated payloads, truncated chunks and
chunk sets, wrong checksums and digests, NaN and Inf, huge norms, wrong shapes, senders and base
models, updates for past and future rounds, from an unselected device, replays, and a flood of
unfinished blobs. For each: the coordinator keeps running, rejects it with a logged reason and a
named counter (metrics.jsonl), and the next round's global model is bit-identical to the one the
honest updates alone give."""

from __future__ import annotations

import logging
import math
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from craft import (
    DIGEST_AT, Device, chunks, honest_update, patch, read_field, sparse_update, with_bad_value,
)
from faultlib import FEDERATION, wait_until
from fedtestlib import FedBroker, federation_toml, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.intake import clip_update
from coordinator.publish import model_blob
from coordinator.server import Coordinator
from flayer.simulation import initial_global_state
from mqtt_broker import mosquitto_available
from protocol import Topics, UpdateHeader, decode_update

pytestmark = [pytest.mark.faults, pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
T = Topics(FEDERATION)
SELECTED = ["dev-a", "dev-b", "dev-c"]
NAN, POS_INF, NEG_INF = struct.pack("<f", float("nan")), struct.pack("<f", float("inf")), struct.pack("<f", -math.inf)


@pytest.fixture
def fed(tmp_path: Path):  # type: ignore[no-untyped-def]
    fb = start_fed_broker(tmp_path, "mosquitto", [*SELECTED, "dev-x"], federation=FEDERATION)
    yield fb
    fb.broker.stop()


def _coordinator(tmp: Path, fb: FedBroker, rounds: int, **fed: Any) -> Coordinator:
    kw: dict[str, Any] = dict(quorum=3, min_devices=3, over_selection=1.0, deadline_s=120.0, **fed)
    path = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                           strategy="fedavg", rounds=rounds, dataset="digits", **kw)
    return Coordinator(load_coordinator_config(path), fb.coordinator)


def _total(coord: Coordinator) -> int:
    return sum(dict(coord.counters).values())


class Campaign:
    """Sends bad inputs one case at a time and checks the counters each one moved."""

    def __init__(self, coord: Coordinator, thread: Any, ledger: Any) -> None:
        self.coord, self.thread, self.ledger = coord, thread, ledger
        self.expected: Counter[str] = Counter()  # this round's counters, as the cases predict them
        self.flexible = 0  # random mutations: each counted bad_chunk at once or incomplete at the close
        self.tried = 0

    def case(self, what: str, send: Callable[[], None], now: dict[str, int], later: int = 0) -> None:
        """``send`` publishes the case's payloads; ``now``: the counters that must move at once;
        ``later``: unfinished blobs it leaves, counted ``incomplete`` when the round closes."""
        before = Counter(dict(self.coord.counters))
        send()
        want = sum(now.values())
        wait_until(lambda: _total(self.coord) - sum(before.values()) >= want, 30, f"the counters of {what}")
        time.sleep(0.05)  # anything extra would show up now
        moved = Counter(dict(self.coord.counters)) - before
        assert moved == Counter(now), f"{what}: counters moved {dict(moved)}, expected {now}"
        self._done(what, want + later, Counter(now) + Counter({"incomplete": later}))

    def mutations(self, what: str, send: Callable[[], None], n: int) -> None:
        """Payloads each counted ``bad_chunk`` at once or ``incomplete`` at the close (not known which)."""
        send()
        self.flexible += n
        self._done(what, n, Counter())

    def sync(self, dev: Device) -> None:
        """Wait until the coordinator has handled everything ``dev`` sent: a garbage metrics message
        sent after it (handled in order) is counted."""
        before = Counter(dict(self.coord.counters))
        dev.publish([(T.metrics(dev.id), b"sync")])
        wait_until(lambda: self.coord.counters["bad_message"] > before["bad_message"], 30, "the sync marker")
        moved = Counter(dict(self.coord.counters)) - before
        assert set(moved) <= {"bad_message", "bad_chunk"} and moved["bad_message"] == 1, moved  # + late mutations
        self._done("garbage metrics message", 1, Counter({"bad_message": 1}))

    def _done(self, what: str, n: int, counters: Counter[str]) -> None:
        assert self.thread.is_alive(), f"the coordinator died on {what}"
        self.expected += counters
        self.tried += n
        self.ledger.bad_input(what, n, n)  # asserted below: each one counted, with a logged reason

    def check_round(self, rejected: dict[str, int]) -> Counter[str]:
        """The round's metrics line holds exactly the predicted counters; returns them."""
        got, want = Counter(rejected), self.expected
        flex = got["bad_chunk"] + got["incomplete"] - want["bad_chunk"] - want["incomplete"]
        assert flex == self.flexible, f"random mutations: {flex} counted, {self.flexible} sent ({dict(got)})"
        assert got["bad_chunk"] >= want["bad_chunk"] and got["incomplete"] >= want["incomplete"]
        fixed = {k: v for k, v in got.items() if k not in ("bad_chunk", "incomplete")}
        assert fixed == {k: v for k, v in want.items() if k not in ("bad_chunk", "incomplete") and v}, (got, want)
        self.expected, self.flexible = Counter(), 0
        return got


def _mutations(rng: np.random.Generator, payload: bytes) -> bytes:
    """One to three random bit flips, a truncation, an extension or a boundary value in a length field."""
    b = bytearray(payload)
    op = int(rng.integers(0, 4))
    if op == 0:
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, 110 if rng.random() < 0.7 else len(b)))
            b[i] ^= 1 << int(rng.integers(0, 8))
    elif op == 1:
        del b[int(rng.integers(0, len(b))):]
    elif op == 2:
        b += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    else:
        at = int(rng.choice([8, 12, 16, 20, 28, 68, 69]))
        b[at:at + 4] = int(rng.choice([0, 1, 2**31, 2**32 - 1, len(b)])).to_bytes(4, "little")
    return bytes(b)


def test_bad_inputs_are_rejected_counted_logged_and_leave_the_model_unaffected(
        tmp_path: Path, fed: FedBroker, caplog: pytest.LogCaptureFixture, faults_ledger: Any) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator")
    coord = _coordinator(tmp_path, fed, rounds=2, norm_bound=5.0, max_update_bytes=600_000)
    thread = coord.start()
    a, b, c = (Device(fed.devices[d], T) for d in SELECTED)
    x = Device(fed.devices["dev-x"], T, online=False)  # authorised, never online: never selected
    shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
    camp = Campaign(coord, thread, faults_ledger)
    rng = np.random.default_rng(7)
    try:
        plan1 = a.plan(1)
        assert sorted(plan1.selected) == SELECTED
        h = {d.id: UpdateHeader(FEDERATION, 1, d.id, plan1.model_digest) for d in (a, b, c, x)}
        honest = {d: honest_update(shapes, hd, seed=i) for i, (d, hd) in enumerate(h.items())}
        parts_a = chunks(honest["dev-a"], "dev-a", 1)
        assert len(parts_a) == 4

        def variant(seed: int, **kw: Any) -> bytes:
            return honest_update(shapes, h["dev-a"], seed=100 + seed, **kw)

        # ---- chunk level: the envelope, its checksum, the blob digest, the chunk set
        camp.case("random bytes", lambda: a.send_chunks(
            [rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes() for _ in range(9)] + [b""], 1),
            {"bad_chunk": 10})
        camp.case("garbage status, metrics and topic", lambda: a.publish(
            [(T.status("dev-a"), b"\x00garbage"), (T.metrics("dev-a"), b"FLEW" + bytes(90)),
             (T.metrics("dev-a"), rng.bytes(200)), (f"{T.prefix}/update/dev-a/x/0", parts_a[0]),
             (f"{T.prefix}/update/dev-a/1/-1", parts_a[0])]), {"bad_message": 5})
        camp.case("truncated chunks", lambda: a.send_chunks([parts_a[1][:-10], parts_a[2][:30]], 1, [1, 2]),
                  {"bad_chunk": 2})
        camp.case("bit flips in chunk bodies", lambda: a.send_chunks(
            [p[:500] + bytes([p[500] ^ 4]) + p[501:] for p in parts_a[:3]], 1), {"bad_chunk": 3})
        camp.case("wrong chunk checksum", lambda: a.send_chunks(
            [patch(parts_a[3], "crc", read_field(parts_a[3], "crc") ^ 1)], 1, [3]), {"bad_chunk": 1})
        v1 = variant(1)
        camp.case("wrong blob digest (4 chunks)", lambda: a.send_chunks(
            chunks(v1, "dev-a", 1, digest="ab" * 32), 1), {"bad_chunk": 1})
        camp.case("wrong blob digest (1 chunk)", lambda: a.send_chunks(
            chunks(v1, "dev-a", 1, size=1 << 20, digest="cd" * 32), 1), {"bad_chunk": 1})
        camp.case("truncated chunk set (3 of 4)", lambda: a.send_chunks(chunks(variant(2), "dev-a", 1)[:3], 1),
                  {}, later=1)
        # a chunk that contradicts the device's own blob (count field) -- then the honest chunks come
        camp.case("chunk contradicting the blob's other chunks", lambda: a.send_chunks(
            [patch(parts_a[0], "count", 5)], 1), {}, later=1)
        for i in range(20):
            vp = chunks(variant(10 + i), "dev-a", 1)
            k = int(rng.integers(0, 4))
            camp.mutations(f"random mutation {i}", lambda vp=vp, k=k: a.send_chunks([_mutations(rng, vp[k])], 1, [k]),
                           1)
        camp.sync(a)
        # ---- blob level: decodes, but is not an acceptable update
        fc = ("fc.bias", (10,))
        for what, bits in (("NaN value", NAN), ("+Inf value", POS_INF), ("-Inf value", NEG_INF)):
            blob = with_bad_value(h["dev-a"], *fc, bits)
            camp.case(what, lambda blob=blob: a.send(blob, 1), {"malformed": 1})  # the decoder refuses them
            ack = a.ack(_digest(blob))
            assert ack.status == "rejected" and "NaN or Inf" in ack.reason
        huge = variant(3, scale=10.0)
        camp.case("huge norm (norm_bound 5, reject)", lambda: a.send(huge, 1), {"norm": 1})
        assert a.ack(_digest(huge)).status == "rejected"
        camp.case("wrong tensor shape", lambda: a.send(sparse_update(h["dev-a"], "fc.bias", (11,), [0.1]), 1),
                  {"malformed": 1})
        camp.case("unknown tensor", lambda: a.send(sparse_update(h["dev-a"], "evil.weight", (4,), [0.1]), 1),
                  {"malformed": 1})
        camp.case("round inside the blob differs", lambda: a.send(
            sparse_update(UpdateHeader(FEDERATION, 7, "dev-a", plan1.model_digest), *fc, [0.1]), 1), {"malformed": 1})
        camp.case("another device's name inside the blob", lambda: a.send(
            sparse_update(UpdateHeader(FEDERATION, 1, "dev-b", plan1.model_digest), *fc, [0.1]), 1),
            {"wrong_sender": 1})
        camp.case("deltas against another model", lambda: a.send(
            sparse_update(UpdateHeader(FEDERATION, 1, "dev-a", "ee" * 32), *fc, [0.1]), 1), {"wrong_model": 1})
        big = rng.bytes(700_000)
        camp.case("oversize (700 kB > max_update_bytes)", lambda: a.send_chunks(chunks(big, "dev-a", 1)[:1], 1),
                  {"oversize": 1})
        # ---- who and when: future round, unselected device
        future = honest_update(shapes, UpdateHeader(FEDERATION, 2, "dev-a", plan1.model_digest), seed=40)
        camp.case("update for a future round", lambda: a.send(future, 2), {"future_round": 1})
        assert a.ack(_digest(future)).status == "rejected"
        camp.case("update from an unselected device", lambda: x.send(honest["dev-x"], 1), {"not_selected": 1})
        assert x.ack(_digest(honest["dev-x"])).status == "not_selected"
        # ---- the honest updates, in a known order, and replays of an accepted one
        assert a.ack(a.send(honest["dev-a"], 1)).status == "accepted"
        camp.case("replays of an accepted update", lambda: [a.send(honest["dev-a"], 1) for _ in range(2)],
                  {"duplicate": 2})
        assert b.ack(b.send(honest["dev-b"], 1)).status == "accepted"
        assert c.ack(c.send(honest["dev-c"], 1)).status == "accepted"

        plan2 = a.plan(2)
        g0 = initial_global_state(coord.strategy, 0)
        g1 = _fold(coord, g0, [honest[d] for d in SELECTED])
        assert plan2.model_digest == model_blob(g1).digest, "round 1's bad inputs changed the model"
        round1 = camp.check_round(wait_until(lambda: coord.history[:1], 10, "round 1's metrics")[0]["rejected"])

        # ---- round 2: the past (a replay of round 1, a late update), the future, noise; then honest
        h2 = {d.id: UpdateHeader(FEDERATION, 2, d.id, plan2.model_digest) for d in (a, b, c)}
        camp.case("replay of last round's accepted update", lambda: a.send(honest["dev-a"], 1), {"duplicate": 1})
        camp.case("update for a past round", lambda: x.send(honest["dev-x"], 1), {"late": 1})
        assert x.ack(_digest(honest["dev-x"])).status == "late"
        camp.case("update for a round past the last", lambda: a.send(
            honest_update(shapes, UpdateHeader(FEDERATION, 3, "dev-a", plan2.model_digest), seed=41), 3),
            {"future_round": 1})
        camp.case("random bytes (round 2)", lambda: b.send_chunks([rng.bytes(64) for _ in range(5)], 2),
                  {"bad_chunk": 5})
        honest2 = {d: honest_update(shapes, hd, seed=50 + i) for i, (d, hd) in enumerate(h2.items())}
        for dev in (a, b, c):
            assert dev.ack(dev.send(honest2[dev.id], 2)).status == "accepted"
        thread.join(60)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished
        g2 = _fold(coord, g1, [honest2[d] for d in SELECTED])
        assert all(torch.equal(result.global_state[k], g2[k]) for k in g2), "round 2's bad inputs changed the model"

        # every rejection: a counter in metrics.jsonl (per round and cumulative) and a logged reason
        lines = result.history
        total = round1 + camp.check_round(lines[1]["rejected"])
        assert {k: v for k, v in result.counters.items() if v} == dict(total)
        assert sum(total.values()) == camp.tried
        logged = [r for r in caplog.records if r.name == "coordinator.inbox" and r.levelno == logging.WARNING]
        assert len(logged) == camp.tried
        assert Counter(r.getMessage().split(":")[0] for r in logged) == total
        assert [r["accepted"] for r in lines] == [3, 3]
    finally:
        for d in (a, b, c, x):
            d.close()
        coord.stop()


def _digest(blob: bytes) -> str:
    from protocol import blob_digest

    return blob_digest(blob)


def _fold(coord: Coordinator, g: dict[str, torch.Tensor], blobs: list[bytes]) -> dict[str, torch.Tensor]:
    agg = coord.strategy.aggregator(g, coord.fs.norm_bound)
    for blob in blobs:
        agg.fold(decode_update(blob).update)
    return agg.result()


def test_a_flood_of_unfinished_blobs_does_not_lock_out_other_devices(tmp_path: Path, fed: FedBroker,
                                                                     faults_ledger: Any) -> None:
    coord = _coordinator(tmp_path, fed, rounds=1)
    thread = coord.start()
    a, b, c = (Device(fed.devices[d], T) for d in SELECTED)
    n = 4200  # more than the collector's whole budget of unfinished blobs (4096)
    try:
        plan = a.plan(1)
        shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
        flood = []
        for i in range(n):  # two-chunk blobs of which only the first chunk ever comes
            blob = sparse_update(UpdateHeader(FEDERATION, 1, "dev-a", plan.model_digest), "fc.bias", (10,),
                                 [0.001 * (i + 1)] * 10)
            flood.append(chunks(blob, "dev-a", 1, size=len(blob) // 2 + 80)[0])
        a.send_chunks(flood, 1, [0] * n)
        a.publish([(T.metrics("dev-a"), b"after the flood")])  # arrives after it: a marker
        wait_until(lambda: coord.counters["bad_message"] or not thread.is_alive(), 60, "the flood")
        honest = {d.id: honest_update(shapes, UpdateHeader(FEDERATION, 1, d.id, plan.model_digest), seed=i)
                  for i, d in enumerate((a, b, c))}
        for dev in (b, c, a):
            assert dev.ack(dev.send(honest[dev.id], 1), 15).status == "accepted", f"{dev.id} was locked out"
        thread.join(60)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished
        assert result.history[0]["rejected"] == {"incomplete": n, "bad_message": 1}
        g1 = _fold(coord, initial_global_state(coord.strategy, 0), [honest[d] for d in ("dev-b", "dev-c", "dev-a")])
        assert all(torch.equal(result.global_state[k], g1[k]) for k in g1)
        faults_ledger.bad_input("flood of unfinished blobs", n, result.history[0]["rejected"]["incomplete"])
    finally:
        for d in (a, b, c):
            d.close()
        coord.stop()


@pytest.mark.parametrize("policy", [None, "reject", "clip"])
def test_huge_norm_with_and_without_a_bound(tmp_path: Path, fed: FedBroker, policy: str | None,
                                            faults_ledger: Any) -> None:
    """No bound: a large (finite) update is within a device's role and is folded. ``reject``: refused
    (counter ``norm``). ``clip``: scaled down to the bound and folded (counter ``clipped``)."""
    kw = {} if policy is None else {"norm_bound": 5.0, "norm_policy": policy}
    coord = _coordinator(tmp_path, fed, rounds=1, **kw)
    thread = coord.start()
    a, b, c = (Device(fed.devices[d], T) for d in SELECTED)
    try:
        plan = a.plan(1)
        shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
        hd = {d.id: UpdateHeader(FEDERATION, 1, d.id, plan.model_digest) for d in (a, b, c)}
        huge = honest_update(shapes, hd["dev-a"], seed=9, scale=10.0)
        norm = float(np.sqrt(sum(float(np.dot(d.values.astype(np.float64), d.values))
                                 for d in decode_update(huge).update.deltas.values())))
        assert norm > 1000
        status = a.ack(a.send(huge, 1)).status
        assert status == ("rejected" if policy == "reject" else "accepted")
        blobs = {d.id: honest_update(shapes, hd[d.id], seed=i) for i, d in enumerate((b, c))}
        for dev in (b, c):
            assert dev.ack(dev.send(blobs[dev.id], 1)).status == "accepted"
        if policy == "reject":  # dev-a sends an honest update after all
            blobs["dev-a"] = honest_update(shapes, hd["dev-a"], seed=2)
            assert a.ack(a.send(blobs["dev-a"], 1)).status == "accepted"
        thread.join(60)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished
        g0 = initial_global_state(coord.strategy, 0)
        agg = coord.strategy.aggregator(g0, coord.fs.norm_bound)
        if policy != "reject":
            up = decode_update(huge).update
            agg.fold(clip_update(up, 5.0 / norm * (1 - 1e-6)) if policy == "clip" else up)
        for d in ("dev-b", "dev-c") if policy != "reject" else ("dev-b", "dev-c", "dev-a"):
            agg.fold(decode_update(blobs[d]).update)
        want = agg.result()
        assert all(torch.equal(result.global_state[k], want[k]) for k in want)
        assert all(bool(torch.isfinite(v).all()) for v in result.global_state.values())
        rejected, clipped = result.history[0]["rejected"], result.history[0]["clipped"]
        if policy == "reject":
            assert rejected == {"norm": 1} and clipped == 0
            faults_ledger.bad_input("huge norm (norm_bound, policy reject)", 1, 1)
        elif policy == "clip":
            assert rejected == {} and clipped == 1 and result.counters["clipped"] == 1
            faults_ledger.bad_input("huge norm (norm_bound, policy clip: clipped)", 1, 1)
        else:
            assert rejected == {} and clipped == 0
    finally:
        for d in (a, b, c):
            d.close()
        coord.stop()
