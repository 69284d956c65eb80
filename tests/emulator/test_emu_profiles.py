"""Device profiles, the fleet mix, availability timelines, trace files and the token bucket: pure logic."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.availability import device_timeline, load_trace, markov_intervals, with_crashes
from emulator.profiles import (
    BUILTIN_PROFILES,
    DEFAULT_MIX,
    DeviceProfile,
    assign_profiles,
    load_profiles,
    mix_counts,
    parse_mix,
)
from emulator.shaping import LinkShaper, TokenBucket
from flayer.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_configs_profiles_file_holds_exactly_the_builtins() -> None:
    ps = load_profiles(ROOT / "configs/profiles.toml")
    assert dict(ps.profiles) == BUILTIN_PROFILES
    assert dict(ps.mix) == DEFAULT_MIX
    assert set(BUILTIN_PROFILES) == {"jetson-orin", "laptop", "phone-4g", "flaky-field"}
    assert BUILTIN_PROFILES["flaky-field"].up_mbps == 1.0 and BUILTIN_PROFILES["flaky-field"].crash_prob > 0
    assert BUILTIN_PROFILES["jetson-orin"].p_off == 0  # always on


def test_profiles_file_adds_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text('[profile.sat]\nup_mbps = 0.1\nslowdown = 4\n[profile.laptop]\nslowdown = 2.0\n'
                 '[mix]\nsat = 1\nlaptop = 3\n')
    ps = load_profiles(f)
    assert ps.profiles["sat"].up_mbps == 0.1 and ps.profiles["sat"].slowdown == 4.0
    assert ps.profiles["laptop"].slowdown == 2.0 and ps.profiles["laptop"].up_mbps == 0.0  # replaced whole
    assert ps.profiles["phone-4g"] == BUILTIN_PROFILES["phone-4g"]
    assert mix_counts(8, ps.mix) == {"sat": 2, "laptop": 6}


@pytest.mark.parametrize("text, words", [
    ("[profile.x]\np_off = 1.5\n", ["p_off", "[0, 1]"]),
    ("[profile.x]\nspeed = 2\n", ["unknown key", "speed"]),
    ("[profile.x]\nslowdown = 0\n", ["slowdown", "> 0"]),
    ("[profile.x]\nup_mbps = -1\n", ["up_mbps", ">= 0"]),
    ("[profile.x]\nup_mbps = \"fast\"\n", ["up_mbps", "number"]),
    ("[mix]\nnokia = 1\n", ["unknown profile", "nokia"]),
    ("[mix]\nlaptop = 0\n", ["add up to 0"]),
    ("[fleet]\nx = 1\n", ["unknown table", "fleet"]),
])
def test_bad_profiles_files_name_what_is_wrong(tmp_path: Path, text: str, words: list[str]) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_profiles(f)
    assert str(f) in str(err.value)
    for w in words:
        assert w in str(err.value)


def test_mix_flag() -> None:
    assert parse_mix("laptop=0.5, phone-4g=0.5", BUILTIN_PROFILES) == {"laptop": 0.5, "phone-4g": 0.5}
    assert parse_mix("jetson-orin", BUILTIN_PROFILES) == {"jetson-orin": 1.0}
    for bad in ("laptop=x", "toaster=1", ""):
        with pytest.raises(ConfigError):
            parse_mix(bad, BUILTIN_PROFILES)


@given(st.integers(1, 300), st.dictionaries(st.sampled_from(sorted(BUILTIN_PROFILES)), st.floats(0.01, 10),
                                            min_size=1), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_assignment_has_exact_counts_and_is_reproducible(n: int, mix: dict[str, float], seed: int) -> None:
    counts = mix_counts(n, mix)
    assert sum(counts.values()) == n
    total = sum(mix.values())
    for k, c in counts.items():
        assert abs(c - mix[k] / total * n) < 1.0  # largest remainder: within one device of the share
    a = assign_profiles(n, mix, seed)
    assert a == assign_profiles(n, mix, seed)
    assert {k: a.count(k) for k in set(a)} == {k: c for k, c in counts.items() if c}


def _check_events(events: list[tuple[float, str]], profile: DeviceProfile) -> None:
    up = False
    last = -1.0
    crashed_at = None
    for t, ev in events:
        assert t >= last
        last = t
        if ev == "online":
            assert not up
            if crashed_at is not None:
                assert t == pytest.approx(crashed_at + profile.restart_s)  # a reboot
            up, crashed_at = True, None
        elif ev == "crash":
            assert up
            up, crashed_at = False, t
        else:
            assert ev == "offline"
            up, crashed_at = False, None


def test_markov_timeline_is_seeded_and_keeps_the_chains_share() -> None:
    p = DeviceProfile("x", step_s=1.0, p_off=0.2, p_on=0.3, crash_prob=0.01, restart_s=2.0)
    take = 4000
    a = [e for _, e in zip(range(take), device_timeline(p, 7, "dev-001"))]
    assert a == [e for _, e in zip(range(take), device_timeline(p, 7, "dev-001"))]
    assert a != [e for _, e in zip(range(take), device_timeline(p, 7, "dev-002"))]
    assert a != [e for _, e in zip(range(take), device_timeline(p, 8, "dev-001"))]
    _check_events(a, p)
    # long-run share of time online (crash downtime is small) vs the stationary p_on / (p_on + p_off)
    rng = np.random.default_rng(0)
    spans = [s for _, s in zip(range(20000), markov_intervals(p, rng))]
    horizon = spans[-1][1]
    online = sum(e - s for s, e in spans)
    assert online / horizon == pytest.approx(p.online_share, abs=0.02)
    assert p.online_share == pytest.approx(0.6)


def test_always_on_never_on_and_crash_only_inside_intervals() -> None:
    always = DeviceProfile("a")  # p_off = 0
    assert list(device_timeline(always, 0, "d")) == [(0.0, "online")]
    never = DeviceProfile("n", p_off=0.5, p_on=0.0)
    assert list(device_timeline(never, 0, "d")) == []
    crashy = DeviceProfile("c", step_s=1.0, crash_prob=0.5, restart_s=3.0)
    ev = list(with_crashes([(10.0, 40.0)], crashy, np.random.default_rng(1)))
    _check_events(ev, crashy)
    assert ev[0] == (10.0, "online") and ev[-1] == (40.0, "offline")
    assert any(e == "crash" for _, e in ev)
    assert all(10.0 <= t <= 40.0 for t, _ in ev)


def test_trace_file(tmp_path: Path) -> None:
    ids = [f"dev-{i:03d}" for i in range(4)]
    f = tmp_path / "t.csv"
    f.write_text("# availability\ndevice_id,start_s,end_s\ndev-000,0,60\ndev-000,60,90\n2,100,inf\n"
                 "dev-000,120,130\n")
    tr = load_trace(f, ids, time_scale=10.0)
    assert tr == {"dev-000": [(0.0, 9.0), (12.0, 13.0)], "dev-002": [(10.0, math.inf)]}  # merged, scaled
    p = DeviceProfile("a")
    assert list(device_timeline(p, 0, "dev-002", tr["dev-002"])) == [(10.0, "online")]
    assert list(device_timeline(p, 0, "dev-000", tr["dev-000"])) == [
        (0.0, "online"), (9.0, "offline"), (12.0, "online"), (13.0, "offline")]


@pytest.mark.parametrize("body, words", [
    ("device,start,end\n", ["header"]),
    ("device_id,start_s,end_s\ndev-009,0,1\n", [":2", "unknown device"]),
    ("device_id,start_s,end_s\n7,0,1\n", [":2", "index 7"]),
    ("device_id,start_s,end_s\ndev-000,5,1\n", [":2", "start_s < end_s"]),
    ("device_id,start_s,end_s\ndev-000,x,1\n", [":2", "not a number"]),
    ("device_id,start_s,end_s\ndev-000,0,1,2\n", [":2", "3 fields"]),
    ("device_id,start_s,end_s\ndev-000,0,10\ndev-000,5,20\n", ["overlap", "dev-000"]),
])
def test_bad_trace_files(tmp_path: Path, body: str, words: list[str]) -> None:
    f = tmp_path / "t.csv"
    f.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_trace(f, [f"dev-{i:03d}" for i in range(4)])
    for w in words:
        assert w in str(err.value)


@given(st.floats(1e3, 1e8), st.floats(0, 1e5), st.lists(st.integers(1, 200_000), min_size=1, max_size=30))
@settings(max_examples=80, deadline=None)
def test_token_bucket_waits_at_least_size_over_rate(rate: float, burst: float, sizes: list[int]) -> None:
    """Back-to-back messages (each sent after its wait) take >= (total - burst) / rate, and never more
    than total / rate (no idle time is wasted)."""
    now = [0.0]
    bucket = TokenBucket(rate, burst, clock=lambda: now[0])
    for n in sizes:
        now[0] += bucket.take(n)  # the sender sleeps, then sends
    total = sum(sizes)
    assert now[0] >= (total - burst) / rate - 1e-9
    assert now[0] <= total / rate + 1e-9


def test_link_shaper_adds_latency_and_counts_bytes() -> None:
    now = [0.0]
    seen: list[tuple[int, str]] = []
    p = DeviceProfile("x", up_mbps=1.0, up_latency_ms=100.0, down_latency_ms=20.0)
    shaper = LinkShaper(p, clock=lambda: now[0], on_bytes=lambda n, d: seen.append((n, d)))
    assert shaper(125_000, "up") == pytest.approx(1.0 + 0.1)  # 1 Mbit at 1 Mbit/s, plus latency
    assert shaper(10_000_000, "down") == pytest.approx(0.02)  # down not rate-limited: latency only
    assert seen == [(125_000, "up"), (10_000_000, "down")]
    with pytest.raises(ValueError):
        shaper(1, "sideways")


def test_gone_within_matches_the_emulated_timelines() -> None:
    """The secure-round dropout the emulator predicts from a profile is what its availability chain does:
    the share of devices that go off or crash within the window after coming online."""
    from emulator.profiles import BUILTIN_PROFILES

    window = 60.0
    for name in ("laptop", "phone-4g", "flaky-field"):
        p = BUILTIN_PROFILES[name]
        gone = 0
        trials = 1500
        for k in range(trials):
            events = iter(device_timeline(p, 3, f"dev-{k}"))
            start = next(t for t, e in events if e == "online")
            t_next, e_next = next(events, (math.inf, ""))
            gone += t_next <= start + window and e_next in ("offline", "crash")
        assert gone / trials == pytest.approx(p.gone_within(window), abs=0.04), name
    assert BUILTIN_PROFILES["jetson-orin"].gone_within(window) == 0.0


def test_secure_dropout_for_a_fleet_is_its_mean_rounded_up_and_bounded() -> None:
    from emulator.profiles import BUILTIN_PROFILES, MAX_SECURE_DROPOUT, secure_dropout_for

    flaky = BUILTIN_PROFILES["flaky-field"]
    expect = 1 - (0.9 * 0.95) ** 3  # 30 s = 3 steps of 10 s
    assert flaky.gone_within(30.0) == pytest.approx(expect)
    fleet = ["jetson-orin"] * 3 + ["flaky-field"]
    assert secure_dropout_for(BUILTIN_PROFILES, fleet, 30.0) == math.ceil(expect / 4 * 100) / 100
    assert secure_dropout_for(BUILTIN_PROFILES, ["jetson-orin"] * 5, 600.0) == 0.0
    assert secure_dropout_for(BUILTIN_PROFILES, ["flaky-field"] * 5, 600.0) == MAX_SECURE_DROPOUT
    assert secure_dropout_for(BUILTIN_PROFILES, [], 60.0) == 0.0
