"""Secure rounds in the emulator: unless ``[privacy] secure_dropout`` is set, the threshold and the neighbour
graph are chosen for the dropouts the fleet's profiles predict within a round's deadline."""

from __future__ import annotations

import types
from pathlib import Path

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
