"""Secure rounds in the emulator: unless ``[privacy] secure_dropout`` is set, the threshold and the neighbour
graph are chosen for the dropouts the fleet's profiles predict within a round's deadline."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from emulator.launcher import _Launch
from emulator.options import load_emulate_config
from emulator.profiles import BUILTIN_PROFILES, secure_dropout_for

FLEET = ["jetson-orin", "laptop", "phone-4g", "flaky-field", "flaky-field"]


def _choose(cfg, trace=None):  # type: ignore[no-untyped-def]
    notes: list[str] = []
    fake = types.SimpleNamespace(cfg=cfg, note=notes.append)
    run = _Launch._secure_dropout(fake, cfg.run, BUILTIN_PROFILES, FLEET, 60.0, trace)  # type: ignore[arg-type]
    return run.privacy.secure_dropout, notes


def test_an_unset_secure_dropout_comes_from_the_profiles() -> None:
    cfg = load_emulate_config(None, {"privacy": {"secure_aggregation": True}})
    assert cfg.run.privacy.secure_dropout == 0.1 and not cfg.extra["secure_dropout_given"]
    rate, notes = _choose(cfg)
    assert rate == secure_dropout_for(BUILTIN_PROFILES, FLEET, 60.0)
    assert 0.1 < rate <= 0.45 and "dropout rate of" in notes[0], (rate, notes)


def test_a_set_secure_dropout_is_kept(tmp_path: Path) -> None:
    flags = load_emulate_config(None, {"privacy": {"secure_aggregation": True, "secure_dropout": 0.05}})
    assert _choose(flags) == (0.05, [])
    toml = tmp_path / "e.toml"
    toml.write_text("[privacy]\nsecure_aggregation = true\nsecure_dropout = 0.2\n")
    assert _choose(load_emulate_config(toml, {})) == (0.2, [])


def test_no_secure_rounds_or_a_trace_keep_the_setting() -> None:
    plain = load_emulate_config(None, {})
    assert _choose(plain) == (0.1, [])
    rate, notes = _choose(load_emulate_config(None, {"privacy": {"secure_aggregation": True}}), trace={})
    assert rate == 0.1 and "trace" in notes[0]


def _choose_for(cfg, fleet, cohort):  # type: ignore[no-untyped-def]
    notes: list[str] = []
    fake = types.SimpleNamespace(cfg=cfg, note=notes.append)
    run = _Launch._secure_dropout(fake, cfg.run, BUILTIN_PROFILES, fleet, 120.0, None, cohort)  # type: ignore[arg-type]
    return run.privacy.secure_dropout, notes


def test_the_profiles_dropout_is_capped_at_the_highest_the_cohort_is_accepted_at() -> None:
    """A churning mix predicts 0.45; the coordinator refuses a cohort of 99 at it (failure 0.21 > 0.01), so every
    round would be refused: the launcher uses the highest dropout the cohort is accepted at, and says so."""
    from flayer.engine.secure_plan import failure_problem, round_degree

    cfg = load_emulate_config(None, {"privacy": {"secure_aggregation": True}})
    churn = ["jetson-orin"] * 20 + ["laptop"] * 15 + ["phone-4g"] * 30 + ["flaky-field"] * 35
    predicted = secure_dropout_for(BUILTIN_PROFILES, churn, 120.0)
    k, t = round_degree(99, predicted, 0.0)
    assert predicted == 0.45 and failure_problem(99, k, t, predicted, 0.0) is not None  # refused as predicted
    rate, notes = _choose_for(cfg, churn, 99)
    assert rate == 0.37, rate
    k, t = round_degree(99, rate, 0.0)
    assert failure_problem(99, k, t, rate, 0.0) is None  # accepted ...
    k, t = round_degree(99, 0.38, 0.0)
    assert failure_problem(99, k, t, 0.38, 0.0) is not None  # ... and the highest on the 0.01 grid
    assert "predict a dropout rate of 0.45" in notes[0] and "cohort of 99 is accepted up to 0.37: using 0.37" in notes[0]
    big_rate, big_notes = _choose_for(cfg, churn, 400)  # a larger cohort takes more
    assert 0.37 < big_rate <= 0.45 and big_notes
    assert _choose_for(cfg, FLEET, 5)[0] == secure_dropout_for(BUILTIN_PROFILES, FLEET, 120.0)  # small: never refused


def test_a_cohort_accepted_at_no_dropout_is_refused_before_the_run() -> None:
    from flayer.config import ConfigError

    cfg = load_emulate_config(None, {"privacy": {"secure_aggregation": True, "secure_corrupt_fraction": 0.3}})
    with pytest.raises(ConfigError, match=r"cohort of 12 devices is accepted at none.*select more devices"):
        _choose_for(cfg, ["flaky-field"] * 12, 12)
