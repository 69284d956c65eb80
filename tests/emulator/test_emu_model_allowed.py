"""An emulated fleet's devices agree to run the fleet's own model (the emulate config names it for both
sides), and to nothing else: the entry point joins ``[edge] allow_entry_points``."""

from __future__ import annotations

from emulator.options import load_emulate_config


def test_the_fleets_own_model_is_allowed_on_its_devices() -> None:
    cfg = load_emulate_config(None, {"data": {"dataset": "digits", "clients": 4, "model": "fleetmodel:build"}})
    assert cfg.edge.allow_entry_points == ("fleetmodel:build",)


def test_a_builtin_model_adds_nothing_and_listed_entries_stay() -> None:
    cfg = load_emulate_config(None, {"data": {"dataset": "digits", "clients": 4},
                                     "edge": {"allow_entry_points": ["pkg.mod:make"]}})
    assert cfg.edge.allow_entry_points == ("pkg.mod:make",)
    cfg = load_emulate_config(None, {"data": {"dataset": "digits", "clients": 4, "model": "pkg.mod:make"},
                                     "edge": {"allow_entry_points": ["pkg.mod:make"]}})
    assert cfg.edge.allow_entry_points == ("pkg.mod:make",)
