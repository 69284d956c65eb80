"""The example alert rules (deploy/prometheus/): valid for the real Prometheus (``promtool check rules``), each alert
firing on its case and silent on a healthy federation (``promtool test rules``), and the example scrape
configuration loadable (``promtool check config``). Debian's prometheus package provides promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from coordinator.exporter import REFUSAL_REASONS, FleetMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="promtool is not installed (Debian package prometheus; make test installs it)")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60,
                          check=False)


def test_promtool_checks_the_rules_and_the_scrape_config() -> None:
    got = _promtool("check", "rules", "flayer-alerts.yml")
    assert got.returncode == 0 and "SUCCESS: 5 rules found" in got.stdout, got
    got = _promtool("check", "config", "flayer-scrape.yml")
    assert got.returncode == 0, got


def test_each_alert_fires_on_its_case_only() -> None:
    got = _promtool("test", "rules", "flayer-alerts.test.yml")
    assert got.returncode == 0 and "SUCCESS" in got.stdout, got.stdout + got.stderr


def test_a_wrong_rule_is_refused(tmp_path: Path) -> None:
    """The check can fail: a rule with a broken expression."""
    bad = tmp_path / "bad.yml"
    bad.write_text((DEPLOY / "flayer-alerts.yml").read_text().replace("> 3 * flayer_deadline_seconds", "> > 3"))
    got = subprocess.run(["promtool", "check", "rules", str(bad)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert got.returncode != 0


def test_the_rules_name_only_metrics_and_reasons_the_coordinator_exports() -> None:
    text = (DEPLOY / "flayer-alerts.yml").read_text()
    exported = {m.name for m in FleetMetrics("f", "fedavg", "sync", 1.0, 1).registry.collect()}
    exported |= {f"{n}_total" for n in exported}
    used = set(re.findall(r"\b(flayer_[a-z_]+)\b", text))
    assert used and used <= exported, used - exported
    reasons = {r for group in re.findall(r'reason=~?"([a-z_|]+)"', text) for r in group.split("|")}
    assert reasons and reasons <= set(REFUSAL_REASONS), reasons - set(REFUSAL_REASONS)
