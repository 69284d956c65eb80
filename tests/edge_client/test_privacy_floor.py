"""The privacy floor a device pins (edge_client.privacy_floor): ``[privacy] require`` in device.toml is validated
with an error naming the file, the table and the key, and a plan below it is refused for the device alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_client.budget import DeviceBudgets
from edge_client.config import EdgeSettings, load_device_config
from edge_client.privacy_floor import floor_problem, parse_require
from flayer.config import ConfigError
from flayer.engine.privacy import RoundPrivacy

CENTRAL = RoundPrivacy("central", 1.0, 1.0, 1.0, 4).as_plan()
LOCAL = RoundPrivacy("local", 1.0, 1.0, 1.0, 4).as_plan()


def test_device_toml_require_is_read_and_validated(tmp_path: Path) -> None:
    base = 'credentials = "c.toml"\n[data]\nsource = "arrays"\npath = "x.npz"\n[privacy]\n'
    for text, want in (('require = "secure"', ("secure",)), ('require = ["secure", "local", "secure"]',
                                                              ("local", "secure")), ('require = "none"', ()),
                       ("require = []", ()), ("", ())):
        (tmp_path / "a.toml").write_text(base + text + "\n")
        assert load_device_config(tmp_path / "a.toml").edge.privacy_require == want, text
    for bad, match in (('require = "secur"', "'secur' is not one of"), ('require = ["none", "local"]', "'none'"),
                       ("require = 3", "require"), ('require = ["secure", 1]', "require")):
        (tmp_path / "b.toml").write_text(base + bad + "\n")
        with pytest.raises(ConfigError, match=match) as exc:
            load_device_config(tmp_path / "b.toml")
        assert "b.toml [privacy]" in str(exc.value) and "require" in str(exc.value), str(exc.value)
    with pytest.raises(ConfigError, match=r"\[privacy\] require"):
        EdgeSettings(privacy_require=("secure", "local"))  # not the sorted, parsed form


def test_floor_problem_reads_what_the_plan_asks() -> None:
    assert floor_problem((), "train", {}, False) is None  # no floor
    assert floor_problem(parse_require("private"), "train", CENTRAL, False) is None
    assert "no privacy" in floor_problem(parse_require("private"), "train", {}, True)
    assert "central-mode noise" in floor_problem(parse_require("local"), "train", CENTRAL, True)
    assert floor_problem(parse_require("local"), "train", LOCAL, False) is None
    assert "without secure aggregation" in floor_problem(parse_require("secure"), "train", CENTRAL, False)
    assert floor_problem(parse_require("secure"), "train", {}, True) is None  # secure aggregation without DP
    both = parse_require(["secure", "local"])
    assert floor_problem(both, "train", LOCAL, True) is None
    for privacy, secure in ((LOCAL, False), (CENTRAL, True), ({}, True)):
        assert 'require = ["local", "secure"]' in floor_problem(both, "train", privacy, secure)
    assert "calibration round" in floor_problem(parse_require("secure"), "calibrate", {}, True)  # sent in the clear


def _device(require: tuple[str, ...]) -> Any:
    dev = SimpleNamespace(id="dev-1", stored=SimpleNamespace(extra={}), skipped={}, _heartbeat_at=5.0,
                          _budget_state=(None, False),
                          settings=SimpleNamespace(device_budget=0.0, device_delta=0.0, privacy_require=require))
    for name in ("_ledger", "_own_privacy", "_budget_refuses", "_noise_problem", "_budget_problem", "_schema_problem",
                 "_pinned_schema"):
        setattr(dev, name, getattr(DeviceBudgets, name).__get__(dev))
    return dev


def _plan(round_: int, privacy: dict[str, Any], secure: bool, phase: str = "train") -> Any:
    return SimpleNamespace(round=round_, phase=phase, selected=("dev-1", "dev-2", "dev-3", "dev-4"), mode="sync", privacy=privacy,
                           secure={"session": "ab"} if secure else {})


def test_a_plan_below_the_floor_is_refused_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    dev = _device(("secure",))
    with caplog.at_level("WARNING", logger="edge_client.client"):
        assert dev._budget_refuses(_plan(1, CENTRAL, False)) and dev._budget_refuses(_plan(1, CENTRAL, False))
    assert dev.skipped == {1: "round skipped"} and dev._heartbeat_at == 0.0
    assert len([r for r in caplog.records if "refusing round 1" in r.getMessage()]) == 1
    assert not dev._budget_refuses(_plan(2, {}, True))  # a secure round without DP: what "secure" asks
    assert not dev._budget_refuses(_plan(3, {}, False, "final"))  # the final plan is no contribution
    local = _device(("local",))
    assert local._budget_refuses(_plan(1, {}, False, "calibrate"))  # asks for DP: no un-noised calibration report
    assert local._own_privacy() and not _device(("secure",))._own_privacy()
