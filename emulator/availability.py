"""When each emulated device is online, when it crashes and when it reboots: a seeded timeline.

Online intervals come from one of two sources:

- the device profile's two-state Markov chain (``step_s``, ``p_off``, ``p_on``): every ``step_s``
  seconds an online device goes offline with probability ``p_off`` and an offline one comes back
  with probability ``p_on``, so the times spent online and offline are geometric (means
  ``step_s / p_off`` and ``step_s / p_on``). The first state is drawn from the chain's stationary
  distribution;
- a trace file, in the style of FedScale's client availability traces (per device, when it becomes
  active and inactive), as CSV with the header ``device_id,start_s,end_s`` and one row per online
  interval ``[start_s, end_s)`` in seconds since the fleet started (``end_s`` may be ``inf``).
  ``device_id`` is a device's id (``dev-007``) or its index (``7``). Lines starting with ``#`` are
  comments. A device the trace lists is offline outside its intervals; a device it does not list
  follows its profile. ``time_scale`` divides every time (e.g. 60: a trace minute per second).

Crashes (``crash_prob`` per ``step_s`` while online, so a geometric number of steps to the next one)
happen inside online intervals; the device reboots ``restart_s`` later if its interval has not ended.

Every draw comes from a generator seeded by (run seed, device id): the same timeline on every run and
every shard. :func:`device_timeline` yields ``(t, event)`` with ``event`` in ``online``, ``offline``,
``crash`` and nondecreasing ``t`` (an ``online`` after a ``crash`` is the reboot); a device is
offline until its first ``online``.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from flayer.config import ConfigError
from flayer.strategies.base import derive_seed

from .profiles import DeviceProfile

__all__ = [
    "TRACE_HEADER",
    "Interval",
    "device_timeline",
    "load_trace",
    "markov_intervals",
    "online_at",
    "with_crashes",
]

Interval = tuple[float, float]  # [start, end) in seconds; end may be inf
TRACE_HEADER = ("device_id", "start_s", "end_s")
INF = math.inf


def _steps(rng: np.random.Generator, p: float) -> float:
    """Steps until an event of probability ``p`` per step happens (geometric, >= 1; inf when p = 0)."""
    return float(rng.geometric(p)) if p > 0 else INF


def markov_intervals(profile: DeviceProfile, rng: np.random.Generator) -> Iterator[Interval]:
    """Online intervals of the profile's on/off chain, forever (or until it goes off for good)."""
    online = rng.random() < profile.online_share
    t = 0.0
    while True:
        if online:
            end = t + _steps(rng, profile.p_off) * profile.step_s
            yield (t, end)
            if end == INF:
                return
            t = end
        else:
            k = _steps(rng, profile.p_on)
            if k == INF:
                return
            t += k * profile.step_s
        online = not online


def with_crashes(intervals: Iterable[Interval], profile: DeviceProfile,
                 rng: np.random.Generator) -> Iterator[tuple[float, str]]:
    """Events (t, online | offline | crash) for ``intervals`` with the profile's crash process."""
    for start, end in intervals:
        yield (start, "online")
        t = start
        while True:
            crash_at = t + _steps(rng, profile.crash_prob) * profile.step_s
            if crash_at >= end:
                break
            yield (crash_at, "crash")
            t = crash_at + profile.restart_s
            if t >= end:
                break
            yield (t, "online")
        if end < INF:
            yield (end, "offline")


def device_timeline(profile: DeviceProfile, seed: int, device_id: str,
                    trace: Sequence[Interval] | None = None) -> Iterator[tuple[float, str]]:
    """The device's events: online intervals from ``trace`` when given, else from its profile's
    chain, with the profile's crashes. A device is offline until its first ``online``."""
    intervals: Iterable[Interval] = trace if trace is not None else markov_intervals(
        profile, np.random.default_rng(derive_seed(seed, device_id, "emulator-availability")))
    crash_rng = np.random.default_rng(derive_seed(seed, device_id, "emulator-crash"))
    yield from with_crashes(intervals, profile, crash_rng)


def online_at(intervals: Sequence[Interval], t: float) -> bool:
    return any(s <= t < e for s, e in intervals)


def _device_key(text: str, ids: Mapping[str, int], n: int, where: str) -> str:
    text = text.strip()
    if text in ids:
        return text
    if text.isdigit():
        i = int(text)
        if i < n:
            return next(k for k, v in ids.items() if v == i)
        raise ConfigError(f"{where}: device index {i} is not in the fleet (0..{n - 1})")
    example = next(iter(ids), "dev-0")
    raise ConfigError(f"{where}: unknown device {text!r} (give a device id such as {example!r} "
                      f"or its index)")


def _number(text: str, what: str, where: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ConfigError(f"{where}: {what} {text!r} is not a number") from None
    if math.isnan(v):
        raise ConfigError(f"{where}: {what} is NaN")
    return v


def load_trace(path: str | Path, device_ids: Sequence[str],
               time_scale: float = 1.0) -> dict[str, list[Interval]]:
    """The online intervals per device of a trace file (see module docstring), sorted, touching
    intervals merged; overlapping ones, unknown devices, bad numbers are errors naming the line."""
    path = Path(path)
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ConfigError(f"trace time scale must be a positive number, got {time_scale}")
    ids = {d: i for i, d in enumerate(device_ids)}
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"trace file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"trace file {path} is unreadable: {exc}") from None
    rows = [(i, r) for i, r in enumerate(csv.reader(text.splitlines()), 1)
            if r and not r[0].lstrip().startswith("#") and any(c.strip() for c in r)]
    if not rows or tuple(c.strip() for c in rows[0][1]) != TRACE_HEADER:
        raise ConfigError(f"{path}: the first line must be the header {','.join(TRACE_HEADER)}")
    out: dict[str, list[Interval]] = {}
    for lineno, row in rows[1:]:
        where = f"{path}:{lineno}"
        if len(row) != 3:
            raise ConfigError(f"{where}: expected 3 fields ({','.join(TRACE_HEADER)}), got {len(row)}")
        dev = _device_key(row[0], ids, len(device_ids), where)
        start, end = _number(row[1], "start_s", where), _number(row[2], "end_s", where)
        if not (0 <= start < end) or start == INF:
            raise ConfigError(f"{where}: need 0 <= start_s < end_s, got {row[1].strip()}, {row[2].strip()}")
        out.setdefault(dev, []).append((start / time_scale, end / time_scale))
    for dev, spans in out.items():
        spans.sort()
        merged: list[Interval] = [spans[0]]
        for s, e in spans[1:]:
            ps, pe = merged[-1]
            if s < pe:
                raise ConfigError(f"{path}: intervals of {dev} overlap "
                                  f"([{ps * time_scale:g}, {pe * time_scale:g}) "
                                  f"and [{s * time_scale:g}, {e * time_scale:g}))")
            if s == pe:
                merged[-1] = (ps, e)
            else:
                merged.append((s, e))
        out[dev] = merged
    return out
