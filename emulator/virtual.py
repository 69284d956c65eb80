"""The fleet on a simulated clock: the round engine, the device profiles and their availability, in
one process, in seconds of CPU instead of minutes of wall time (``flayer emulate --virtual``).

It drives :mod:`flayer.engine` as the coordinator does -- synchronous rounds (over-selection among
the devices online, close at quorum + grace or at the deadline, late updates refused) or
asynchronous buffered ones (slots, staleness, a new version every ``buffer`` updates) -- and each
selected device runs the real local round (:func:`flayer.engine.client_round`) on the model version
it was given. Only time is simulated, from the device's profile and availability timeline
(:func:`emulator.availability.device_timeline`, the same seeded timelines the emulator plays):

- a job is download (model bytes over ``down_mbps`` + latency), compute (``slowdown`` x the thread
  CPU time the local round took here, or ``slowdown x sample_cost_s x samples x epochs`` when a cost
  is given) and upload (the encoded update over ``up_mbps`` + latency);
- what crosses the links is what the real stack sends (:class:`VirtualLinks`, given by
  ``flayer emulate --virtual`` from the config: :class:`emulator.thinsim.ThinLinks`): the update encoded
  with the plan's value codec (and zstd), with error feedback when on, folded as the coordinator
  decodes it; with ``[edge] upload = "fit"`` fitted to a byte budget computed as the edge client
  computes it (:func:`edge_client.linkfit.upload_budget`: its uplink rate -- ``uplink_kbps``, else the
  estimate from its own earlier uploads, :func:`edge_client.linkfit.rate_estimate` -- over the time
  left until the plan's expected close, :func:`flayer.engine.versions.expected_close`, within ``max_update_bytes``); with
  delta downloads, the delta chain from the model the device holds. Without links: fp32 uploads and
  the whole model every time;
- download and compute must fit in one online stretch: a device going offline or crashing loses
  them (as the emulator's devices do: their state is saved only after training). Synchronous rounds
  retry at the next online stretch while the round is open; an asynchronous slot is freed when its
  holder goes offline, so the device gets a new slot, on the newest version, once back;
- an upload interrupted by going offline is sent again, from its start, once the device is back
  (the stored upload); whether it still counts is decided when it arrives.

What is not simulated: MQTT, chunking and retransmissions, the broker, contention between devices
(each computes as if alone), and synchronous ``min_updates``/``extend_s``. Compare its accepted
counts per profile with the emulator's before trusting a plan (docs/explanation/async-rounds.md).
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flayer.engine import (
    Bounds,
    OpenAggregate,
    admit,
    assign_slots,
    check,
    client_round,
    expected_close,
    initial_global_state,
    select_devices,
)
from flayer.simulation import weighted
from flayer.strategies.base import ClientState, LocalResult, RoundContext, Strategy
from flayer.train import ClientData, evaluate
from flayer.update import Update, state_numpy
from protocol import update_sizer
from protocol.blobs import encode_state

from .profiles import DeviceProfile
from .virtual_parts import (
    INF,
    FleetTiming,
    Interval,
    VirtualLinks,
    VirtualResult,
    link_s,
    next_online,
    online_intervals,
)

__all__ = ["FleetTiming", "VirtualLinks", "VirtualResult", "online_intervals", "run_virtual"]

log = logging.getLogger(__name__)


@dataclass
class _Job:
    device: int
    base: int
    result: LocalResult
    trained_at: float
    arrive: float | None
    update: Update  # as the coordinator decodes it


class _Fleet:
    def __init__(self, strategy: Strategy, clients: Sequence[ClientData], profiles: Sequence[DeviceProfile],
                 ids: Sequence[str], intervals: Sequence[Sequence[Interval]], seed: int, timing: FleetTiming,
                 sizer: Callable[[Update], int], device: torch.device, links: VirtualLinks | None = None) -> None:
        self.strategy, self.clients, self.profiles, self.ids = strategy, clients, profiles, list(ids)
        self.intervals, self.seed, self.timing, self.sizer, self.device = intervals, seed, timing, sizer, device
        self.links = links
        self.rate: list[float | None] = [None] * len(clients)  # each device's uplink estimate, bytes/s
        self.durations: list[float] = []  # the last rounds' (versions') lengths: the plans' close_by
        self.states: list[ClientState] = [strategy.initial_state() for _ in clients]
        self.free_at = [0.0] * len(clients)
        self.count: dict[str, Counter[str]] = {p.name: Counter() for p in profiles}
        for p in profiles:
            self.count[p.name]["devices"] += 1
        self.g = initial_global_state(strategy, seed)
        self.model_bytes = len(encode_state(state_numpy(self.g)))
        self.digests = [_digest(self.g)]
        self.records: list[dict[str, Any]] = []

    def online(self, t: float) -> list[int]:
        return [i for i, iv in enumerate(self.intervals) if any(s <= t < e for s, e in iv)]

    def next_change(self, t: float) -> float:
        """The next time any device comes online or goes offline after ``t``."""
        return min((b for iv in self.intervals for s, e in iv for b in (s, e) if b > t), default=INF)

    def job(self, i: int, base: int, start: float, retry_until: float, aim: float = INF) -> _Job | None:
        """Device ``i`` trains on the current model (version ``base``) from ``start``; None when it never
        gets through download and compute (its state stays as it was). ``aim``: when its update should
        arrive (the plan's expected close), for fitted uploads."""
        p, data = self.profiles[i], self.clients[i]
        ctx = RoundContext(round=base, client=i, seed=self.seed, device=self.device)
        c0 = time.thread_time()
        _, result = client_round(self.strategy, self.g, self.states[i], data, ctx)
        assert result is not None
        cost = self.timing.sample_cost_s
        compute = p.slowdown * (time.thread_time() - c0 if cost is None else
                                cost * data.num_train * int(self.strategy.train.local_epochs))
        down = self.links.download(base, i, hold=False) if self.links is not None else self.model_bytes
        need = (link_s(down, p.down_mbps, p.down_latency_ms) if down else 0.0) + compute
        t, trained = start, None
        while (iv := next_online(self.intervals[i], t)) is not None and iv[0] < retry_until:
            if iv[0] + need <= iv[1]:
                trained = iv[0] + need
                break
            t = iv[1]
        if trained is None:
            self.free_at[i] = t
            return None
        self.states[i] = result.state
        self.count[p.name]["trained"] += 1
        self.count[p.name]["bytes_down"] += down
        update, nbytes = self._upload(i, base, result.update, aim - trained)
        up = link_s(nbytes, p.up_mbps, p.up_latency_ms)
        t, arrive = trained, None
        while (iv := next_online(self.intervals[i], t)) is not None:
            if iv[0] + up <= iv[1]:
                arrive = iv[0] + up
                break
            t = iv[1]
        self.free_at[i] = INF if arrive is None else arrive
        if arrive is not None:
            self.count[p.name]["bytes_up"] += nbytes
        if arrive is not None and self.links is not None and self.links.fit:
            from edge_client.linkfit import rate_estimate

            self.rate[i] = rate_estimate(self.rate[i], nbytes, arrive - trained)  # publish to ack, re-sends included
        return _Job(i, base, result, trained, arrive, update)

    def _upload(self, i: int, base: int, update: Update, seconds_left: float) -> tuple[Update, int]:
        """(the update as the coordinator decodes it, its bytes): fitted to the budget the edge client
        would compute (module docstring) when uploads are fitted."""
        if self.links is None:
            return update, self.sizer(update)
        budget, rate = 0, None
        if self.links.fit:
            from edge_client.linkfit import upload_budget

            tm = self.timing
            rate = tm.uplink_kbps * 1000 / 8 if tm.uplink_kbps > 0 else self.rate[i]
            budget = upload_budget(rate, seconds_left)
            if budget and tm.max_update_bytes:
                budget = min(budget, tm.max_update_bytes)
        self.links.download(base, i)  # the device holds the model it trained on
        return self.links.upload(base, i, update, budget, unmeasured=self.links.fit and rate is None)

    def round_length(self, seconds: float) -> None:
        self.durations = [*self.durations[-4:], seconds]  # as the coordinator keeps them (coordinator.server)

    def fold(self, agg: OpenAggregate, job: _Job, staleness: int, bounds: Bounds) -> bool:
        up = job.update
        verdict = admit(up, check(up, agg.shapes), bounds, staleness)
        name = self.profiles[job.device].name
        if not verdict.accepted:
            self.count[name][verdict.counter or "refused"] += 1
            return False
        agg.fold(verdict, self.ids[job.device])
        self.count[name]["accepted"] += 1
        return True

    def publish(self, agg: OpenAggregate, t: float, extra: Mapping[str, Any]) -> None:
        new = agg.result()
        self.g = self.links.publish(len(self.digests), self.g, new) if self.links is not None else new
        self.digests.append(_digest(self.g))
        evals = [client_round(self.strategy, self.g, self.states[i], d,
                              RoundContext(round=len(self.digests), client=i, seed=self.seed, device=self.device),
                              train=False)[0] for i, d in enumerate(self.clients)]
        acc, loss = weighted(evals)
        t_ = agg.tally
        self.records.append({"round": len(self.records) + 1, "t": round(t, 3), "acc": acc, "loss": loss,
                             "accepted": t_.accepted, "staleness_mean": t_.mean_staleness,
                             "train_loss": t_.train_loss, **extra})
        log.info("version %d at t=%.0fs: acc %.4f, %d update(s)", len(self.records) + 1, t, acc, t_.accepted)


def _digest(state: Mapping[str, torch.Tensor]) -> str:
    from protocol import blob_digest

    return blob_digest(encode_state(state_numpy(state)))


def _wait_for(fleet: _Fleet, t: float, needed: int) -> float:
    while t < INF and len(fleet.online(t)) < needed:
        t = fleet.next_change(t)
    return t


def _run_sync(fleet: _Fleet, rounds: int) -> None:
    tm, t = fleet.timing, 0.0
    bounds = Bounds(max_samples=tm.max_samples)
    for r in range(1, rounds + 1):
        t = _wait_for(fleet, t, tm.min_devices)
        if t >= tm.budget_s:
            return
        online = [fleet.ids[i] for i in fleet.online(t)]
        selected = [fleet.ids.index(d) for d in select_devices(online, tm.quorum, tm.over_selection, fleet.seed, r)]
        deadline = t + tm.deadline_s
        expect = expected_close("sync", t, deadline, fleet.durations, 0)
        aim = deadline if expect is None else expect
        jobs = [j for i in selected if (j := fleet.job(i, r, max(t, fleet.free_at[i]), deadline, aim)) is not None]
        arrived = sorted((j for j in jobs if j.arrive is not None), key=lambda j: (j.arrive, j.device))
        quorum = max(1, min(tm.quorum, len(selected)))
        close = deadline
        if len(arrived) >= quorum:
            close = min(close, arrived[quorum - 1].arrive + tm.grace_s)  # type: ignore[operator]
        if arrived and len(arrived) == len(selected):
            close = min(close, max(j.arrive or 0.0 for j in arrived))
        agg = OpenAggregate(fleet.strategy, fleet.g)
        for j in arrived:
            if j.arrive <= close:  # type: ignore[operator]
                fleet.fold(agg, j, 0, bounds)
            else:
                fleet.count[fleet.profiles[j.device].name]["late"] += 1
        for j in jobs:
            if j.arrive is None:
                fleet.count[fleet.profiles[j.device].name]["lost"] += 1
        fleet.publish(agg, close, {"selected": len(selected)})
        fleet.round_length(close - t)
        t = close
        if t >= tm.budget_s:
            return


def _run_async(fleet: _Fleet, rounds: int) -> None:
    tm, a = fleet.timing, fleet.timing.asynchronous
    bounds = Bounds(max_samples=tm.max_samples, max_staleness=a.max_staleness, staleness_rule=a.staleness)
    t = _wait_for(fleet, 0.0, tm.min_devices)
    arrivals: list[tuple[float, int, int, _Job]] = []
    try:
        _async_loop(fleet, rounds, t, bounds, arrivals)
    finally:  # what was still on its way when the run ended
        for _, _, i, _ in arrivals:
            fleet.count[fleet.profiles[i].name]["in_flight"] += 1


def _async_loop(fleet: _Fleet, rounds: int, t: float, bounds: Bounds,
                arrivals: list[tuple[float, int, int, _Job]]) -> None:
    tm, a = fleet.timing, fleet.timing.asynchronous
    version, given, seq, opened_at = 1, 0, 0, t
    agg = OpenAggregate(fleet.strategy, fleet.g)
    folded: dict[int, set[int]] = {}
    held: dict[int, float] = {}  # device -> when its slot is freed (offline, expiry, or its update arriving)
    while t < tm.budget_s and version <= rounds:
        for i in [i for i, until in held.items() if until <= t]:
            del held[i]
        online = fleet.online(t)
        idle = [fleet.ids[i] for i in online
                if i not in held and fleet.free_at[i] <= t and i not in folded.get(version, set())]
        cap = a.concurrency or len(online)
        for dev in assign_slots(idle, cap - len(held), fleet.seed, version, given):
            i = fleet.ids.index(dev)
            given += 1
            expect = expected_close("async", opened_at, opened_at + tm.deadline_s, fleet.durations, a.max_staleness)
            aim = opened_at + tm.deadline_s if expect is None else expect
            job = fleet.job(i, version, t, t + 1e-9, aim)
            iv = next_online(fleet.intervals[i], t)
            offline_at = iv[1] if iv is not None else t
            if job is None:
                held[i] = offline_at
                continue
            end = job.arrive if job.arrive is not None and job.arrive <= offline_at else offline_at
            held[i] = min(end, t + tm.deadline_s)
            if job.arrive is not None:
                heapq.heappush(arrivals, (job.arrive, seq, i, job))
                seq += 1
            else:
                fleet.count[fleet.profiles[i].name]["lost"] += 1
        nxt = min([arrivals[0][0]] if arrivals else [INF])
        nxt = min(nxt, min(held.values(), default=INF), fleet.next_change(t))
        if nxt == INF or nxt >= tm.budget_s:
            return
        t = nxt
        while arrivals and arrivals[0][0] <= t and version <= rounds:
            _, _, i, job = heapq.heappop(arrivals)
            held.pop(i, None)
            if fleet.fold(agg, job, version - job.base, bounds):
                folded.setdefault(job.base, set()).add(i)
            if agg.tally.accepted >= a.buffer:
                fleet.publish(agg, t, {"selected": len(held)})
                fleet.round_length(t - opened_at)
                version, given, opened_at = version + 1, 0, t
                agg = OpenAggregate(fleet.strategy, fleet.g)


def run_virtual(strategy: Strategy, clients: Sequence[ClientData], profiles: Sequence[DeviceProfile],
                ids: Sequence[str], timelines: Sequence[Iterator[tuple[float, str]]], rounds: int, seed: int,
                timing: FleetTiming, sizer: Callable[[Update], int] | None = None,
                device: torch.device | None = None, links: VirtualLinks | None = None) -> VirtualResult:
    """Run ``rounds`` model versions (or until ``timing.budget_s``) of ``strategy`` over ``clients``,
    device ``i`` having ``profiles[i]`` and availability ``timelines[i]`` (module docstring); ``links``:
    what crosses them (None: fp32 uploads sized by ``sizer``, the whole model down)."""
    if strategy.needs_calibration():
        raise ValueError(f"strategy {strategy.name!r} calibrates in round 0; the virtual fleet does not run "
                         f"calibrations yet: use flayer emulate, or set the option the calibration decides")
    c0 = time.process_time()
    horizon = timing.budget_s if math.isfinite(timing.budget_s) else 10 * 24 * 3600.0
    intervals = [online_intervals(tl, horizon) for tl in timelines]
    fleet = _Fleet(strategy, clients, profiles, ids, intervals, seed, timing, sizer or update_sizer(),
                   device or torch.device("cpu"), links)
    (_run_async if timing.mode == "async" else _run_sync)(fleet, rounds)
    finals = []
    for i, data in enumerate(clients):
        ctx = RoundContext(round=rounds + 1, client=i, seed=seed, device=fleet.device)
        model = strategy.personal_model(fleet.g, fleet.states[i], data, ctx)
        finals.append(evaluate(model, data.test, fleet.device))
    total = sum(f[1] for f in finals)
    per_profile = {}
    for name, c in fleet.count.items():
        done = c["trained"] - c["in_flight"]  # updates whose fate is known
        per_profile[name] = {**dict(c), "accepted_share": c["accepted"] / done if done else None}
    return VirtualResult(fleet.records, per_profile, sum(f[0] for f in finals) / total if total else 0.0,
                         [f[0] / f[1] if f[1] else 0.0 for f in finals], fleet.digests, time.process_time() - c0)
