"""Device profiles: how fast an emulated device computes, what link it has, when it is online and
how often it crashes; and the mix that says which share of the fleet gets which profile.

A profiles file (TOML; ``configs/profiles.toml`` holds the four built-ins written out)::

    [profile.phone-4g]
    slowdown = 3.0          # compute takes 3x the CPU time the local round took on this host
    up_mbps = 5.0           # uplink bandwidth, Mbit/s (0: not shaped)
    down_mbps = 20.0        # downlink bandwidth, Mbit/s (0: not shaped)
    up_latency_ms = 60.0    # added to every message sent ...
    down_latency_ms = 60.0  # ... and to every model chunk received
    burst_kb = 0.0          # token bucket depth (0: every byte waits for its share of bandwidth)
    step_s = 10.0           # availability: a two-state Markov chain advancing every step_s seconds
    p_off = 0.05            #   P(online -> offline) per step (mean time online = step_s / p_off)
    p_on = 0.25             #   P(offline -> online) per step (mean time offline = step_s / p_on)
    crash_prob = 0.0        # P(crash) per step while online: the connection drops without a word
    restart_s = 15.0        # a crashed device reboots after this long and resumes from its disk

    [mix]                   # share of the fleet per profile (normalised; exact counts, seeded shuffle)
    jetson-orin = 0.25
    phone-4g = 0.75

The built-in profiles are available without any file; a file's profiles add to them or replace one
of the same name. Every value is checked, and errors name the file, the profile and the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flayer.config import ConfigError, from_mapping, read_toml
from flayer.strategies.base import derive_seed

__all__ = [
    "BUILTIN_PROFILES",
    "DEFAULT_MIX",
    "MAX_SECURE_DROPOUT",
    "DeviceProfile",
    "ProfileSet",
    "assign_profiles",
    "load_profiles",
    "mix_counts",
    "parse_mix",
    "secure_dropout_for",
]


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    slowdown: float = 1.0  # a local round takes slowdown x the CPU time it took on this host
    up_mbps: float = 0.0
    down_mbps: float = 0.0
    up_latency_ms: float = 0.0
    down_latency_ms: float = 0.0
    burst_kb: float = 0.0
    step_s: float = 10.0
    p_off: float = 0.0
    p_on: float = 1.0
    crash_prob: float = 0.0
    restart_s: float = 10.0

    def __post_init__(self) -> None:
        def finite(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"profile {self.name!r}: {name} must be a finite number, got {v!r}")
            return float(v)

        if not self.name or any(c.isspace() for c in self.name):
            raise ConfigError(f"profile name {self.name!r} must be non-empty without white space")
        if not finite("slowdown") > 0:
            raise ConfigError(f"profile {self.name!r}: slowdown must be > 0, got {self.slowdown}")
        for key in ("up_mbps", "down_mbps", "up_latency_ms", "down_latency_ms", "burst_kb"):
            if finite(key) < 0:
                raise ConfigError(f"profile {self.name!r}: {key} must be >= 0 (0 = not shaped), got "
                                  f"{getattr(self, key)}")
        if not finite("step_s") > 0 or not finite("restart_s") >= 0:
            raise ConfigError(f"profile {self.name!r}: step_s must be > 0 and restart_s >= 0")
        for key in ("p_off", "p_on", "crash_prob"):
            if not 0.0 <= finite(key) <= 1.0:
                raise ConfigError(f"profile {self.name!r}: {key} is a probability per step, in [0, 1]; got "
                                  f"{getattr(self, key)}")

    @property
    def online_share(self) -> float:
        """The Markov chain's stationary probability of being online."""
        return 1.0 if self.p_off == 0 else self.p_on / (self.p_on + self.p_off)

    def gone_within(self, window_s: float) -> float:
        """The chance that a device of this profile, online now, is off or crashed ``window_s`` seconds later
        at least once (its Markov steps: 1 - ((1 - p_off)(1 - crash_prob))^(window_s / step_s))."""
        stay = (1.0 - self.p_off) * (1.0 - self.crash_prob)
        return 1.0 - stay ** (max(0.0, window_s) / self.step_s)

    def describe(self) -> str:
        def rate(mbps: float) -> str:
            return f"{mbps:g} Mbit/s" if mbps > 0 else "unshaped"

        if self.p_off == 0:
            avail = "always on"
        elif self.p_on > 0:
            avail = f"on ~{self.step_s / self.p_off:.0f}s / off ~{self.step_s / self.p_on:.0f}s"
        else:
            avail = "goes off for good"
        crash = ""
        if self.crash_prob > 0:
            crash = f", crash p={self.crash_prob:g}/step, reboot {self.restart_s:g}s"
        return (f"x{self.slowdown:g} compute, up {rate(self.up_mbps)} +{self.up_latency_ms:g} ms, "
                f"down {rate(self.down_mbps)} +{self.down_latency_ms:g} ms, {avail}{crash}")


BUILTIN_PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    # a Jetson Orin on wired Ethernet: always on; its GPU outruns this host (factors < 1 cannot speed up)
    DeviceProfile("jetson-orin", slowdown=0.5, up_mbps=50.0, down_mbps=100.0, up_latency_ms=5.0,
                  down_latency_ms=5.0),
    # a laptop on Wi-Fi: the host's own speed, closed now and then
    DeviceProfile("laptop", slowdown=1.0, up_mbps=20.0, down_mbps=50.0, up_latency_ms=20.0,
                  down_latency_ms=20.0,
                  step_s=10.0, p_off=0.01, p_on=0.2),
    # a phone on 4G: slow uplink, a third of the host's speed, often away
    DeviceProfile("phone-4g", slowdown=3.0, up_mbps=5.0, down_mbps=20.0, up_latency_ms=60.0,
                  down_latency_ms=60.0,
                  step_s=10.0, p_off=0.05, p_on=0.25),
    # a field sensor on a poor radio link: 1 Mbit/s up, long latency, flaps, crashes and reboots
    DeviceProfile("flaky-field", slowdown=2.0, up_mbps=1.0, down_mbps=4.0, up_latency_ms=300.0,
                  down_latency_ms=300.0,
                  step_s=10.0, p_off=0.1, p_on=0.2, crash_prob=0.05, restart_s=15.0),
)}

DEFAULT_MIX: dict[str, float] = {"jetson-orin": 0.25, "laptop": 0.25, "phone-4g": 0.3, "flaky-field": 0.2}


@dataclass(frozen=True)
class ProfileSet:
    profiles: Mapping[str, DeviceProfile]
    mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))

    def __post_init__(self) -> None:
        check_mix(self.mix, self.profiles, "mix")

    def with_mix(self, mix: Mapping[str, float]) -> ProfileSet:
        return ProfileSet(self.profiles, dict(mix))


def check_mix(mix: Mapping[str, float], profiles: Mapping[str, DeviceProfile], where: str) -> None:
    if not mix:
        raise ConfigError(f"{where}: empty; give at least one profile=share")
    for name, share in mix.items():
        if name not in profiles:
            raise ConfigError(f"{where}: unknown profile {name!r}; known: {', '.join(sorted(profiles))}")
        number = isinstance(share, (int, float)) and not isinstance(share, bool)
        if not number or not (math.isfinite(share) and share >= 0):
            raise ConfigError(f"{where}: the share of {name!r} must be a number >= 0, got {share!r}")
    if sum(mix.values()) <= 0:
        raise ConfigError(f"{where}: the shares add up to 0")


MAX_SECURE_DROPOUT = 0.45  # [privacy] secure_dropout must stay below 0.5


def secure_dropout_for(profiles: Mapping[str, DeviceProfile], assigned: Sequence[str], window_s: float) -> float:
    """The dropout rate a secure round's threshold is chosen to survive on this fleet: the mean over its
    devices (``assigned``: each device's profile) of the chance of going off or crashing within
    ``window_s`` (the round's deadline: the protocol runs from the key adverts to the unmasking inside
    it), rounded up to 0.01 and at most MAX_SECURE_DROPOUT."""
    if not assigned:
        return 0.0
    mean = sum(profiles[name].gone_within(window_s) for name in assigned) / len(assigned)
    return min(MAX_SECURE_DROPOUT, math.ceil(mean * 100 - 1e-9) / 100)


def load_profiles(path: str | Path | None = None) -> ProfileSet:
    """The built-in profiles, plus (or overridden by) those of ``path``, and its ``[mix]``."""
    profiles = dict(BUILTIN_PROFILES)
    if path is None:
        return ProfileSet(profiles)
    raw = read_toml(path)
    unknown = sorted(set(raw) - {"profile", "mix"})
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(unknown)}; known: [profile.NAME], [mix]")
    tables = raw.get("profile", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: 'profile' must be tables [profile.NAME]")
    for name, values in tables.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: [profile.{name}] must be a table")
        if "name" in values:
            raise ConfigError(f"{path}: [profile.{name}]: the table's name is the profile's name; "
                              f"drop 'name'")
        profiles[name] = from_mapping(DeviceProfile, {"name": name, **values}, f"{path} [profile.{name}]")
    mix = raw.get("mix", DEFAULT_MIX)
    if not isinstance(mix, dict):
        raise ConfigError(f"{path}: [mix] must be a table of profile = share")
    check_mix(mix, profiles, f"{path} [mix]")
    return ProfileSet(profiles, {k: float(v) for k, v in mix.items()})


def parse_mix(text: str, profiles: Mapping[str, DeviceProfile]) -> dict[str, float]:
    """``laptop=0.5,phone-4g=0.5`` (or one name alone: the whole fleet) -> {name: share}."""
    mix: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, share = item.partition("=")
        try:
            mix[name.strip()] = float(share) if sep else 1.0
        except ValueError:
            raise ConfigError(f"--mix {text!r}: {share!r} is not a number (expected NAME=SHARE,...)") \
                from None
    check_mix(mix, profiles, f"--mix {text!r}")
    return mix


def mix_counts(n: int, mix: Mapping[str, float]) -> dict[str, int]:
    """Devices per profile for a fleet of ``n``: shares scaled to ``n``, largest remainders rounded up
    (ties in the order of the mix)."""
    names = list(mix)
    total = sum(mix.values())
    quota = np.array([mix[k] / total * n for k in names])
    counts = np.floor(quota).astype(int)
    order = np.argsort(-(quota - counts), kind="stable")
    counts[order[: n - int(counts.sum())]] += 1
    return {k: int(c) for k, c in zip(names, counts)}


def assign_profiles(n: int, mix: Mapping[str, float], seed: int) -> list[str]:
    """Profile name of each device 0..n-1: exactly :func:`mix_counts` of each, in a seeded shuffle
    (the same on every shard of a fleet)."""
    names: list[str] = []
    for name, count in mix_counts(n, mix).items():
        names += [name] * count
    rng = np.random.default_rng(derive_seed(seed, "emulator-profiles"))
    return [names[int(i)] for i in rng.permutation(n)]


def profiles_toml(profiles: Sequence[DeviceProfile], mix: Mapping[str, float]) -> str:
    """A profiles file holding ``profiles`` and ``mix`` (what :func:`load_profiles` reads)."""
    lines: list[str] = []
    for p in profiles:
        lines.append(f"[profile.{p.name}]")
        for f in dataclasses.fields(p):
            if f.name != "name":
                lines.append(f"{f.name} = {float(getattr(p, f.name))!r}")
        lines.append("")
    lines.append("[mix]")
    lines += [f"{k} = {float(v)!r}" for k, v in mix.items()]
    return "\n".join(lines) + "\n"


def describe_fleet(assigned: Sequence[str]) -> str:
    """``jetson-orin 5, laptop 5, ...`` (profiles by name)."""
    counts: dict[str, int] = {}
    for name in assigned:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} {counts[k]}" for k in sorted(counts))


def profile_from_dict(data: Mapping[str, Any], where: str) -> DeviceProfile:
    return from_mapping(DeviceProfile, data, where)
