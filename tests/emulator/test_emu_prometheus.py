"""A real Prometheus scrapes an emulated federation (``flayer emulate --metrics-port``): after the run, its
HTTP API holds the rounds counter equal to the round lines of the coordinator's ``metrics.jsonl`` and the
refusal counters equal to the coordinator's own (its ``end`` line), with the project's alert rules loaded.

A device outside the fleet (added to the emulator's broker while round 1 runs) sends junk, so the refusal
counters are not all zero. Prometheus and ``flayer emulate`` are child processes of the test, stopped by PID."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from emutestlib import emulate, finish, wait_until
from promlib import Prometheus, free_port, prometheus_available

from coordinator.exporter import REFUSAL_REASONS
from mqtt_broker import add_device, reload_recorded
from protocol import Topics
from protocol.metrics_schema import read_metrics
from transport.credentials import mqtt_connect_settings
from transport.link import MqttLink

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not prometheus_available(), reason="prometheus is not installed (Debian package "
                                                                    "prometheus; make test installs it)")]
# a local round on digits takes 0.1-2 s of CPU here (the first the longest): 5x keeps round 1 open for
# seconds, time for the junk to arrive in it
PROFILES = "[profile.slow]\nslowdown = 5.0\n[mix]\nslow = 1.0\n"


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def test_prometheus_scrapes_an_emulated_federation(tmp_path: Path) -> None:
    port, out = free_port(), tmp_path / "run"
    (tmp_path / "profiles.toml").write_text(PROFILES)
    (tmp_path / "emulate.toml").write_text("[federation]\nmetrics_linger_s = 30.0\n")
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    proc = emulate(["--config", str(tmp_path / "emulate.toml"), "--dataset", "digits", "--strategy", "fedavg",
                    "--partition", "iid", "--clients", "3", "--rounds", "3", "--quorum", "3", "--over-selection",
                    "1.0", "--min-devices", "3", "--profiles", str(tmp_path / "profiles.toml"), "--federation",
                    "promfed", "--metrics-port", str(port), "--deadline", "90", "--timeout", "240", "--out", str(out)],
                   tmp_path / "emulate.log")
    junk = None
    try:
        wait_until(lambda: "flayer_open_round 1.0" in _scrape(port), 120, "round 1 to open")
        creds = add_device(out / "broker", "junk")
        assert reload_recorded(out / "broker") is not None
        time.sleep(0.5)  # the broker reads its password file again
        junk = MqttLink(mqtt_connect_settings(creds), lambda ev: None, clean_session=True)
        junk.start()
        assert junk.connected.wait(10), "the junk device could not connect"
        topics = Topics("promfed")
        sent = [junk.publish(topics.update_chunk("junk", 1, i), b"not an envelope") for i in range(3)]
        sent.append(junk.publish(topics.status("junk"), b"not a status"))
        assert junk.wait_published(sent, 10.0)
        rc = finish(proc, 300)
        assert rc == 0, (tmp_path / "emulate.log").read_text()[-4000:]
        records = read_metrics(out / "coordinator" / "metrics.jsonl")
        rounds = [r for r in records if r["kind"] == "round"]
        counters = records[-1]["counters"]  # the coordinator's, in its end line
        assert records[-1]["kind"] == "end" and len(rounds) == 3
        assert counters.get("bad_chunk", 0) >= 1 and counters.get("bad_message", 0) >= 1, counters

        def last(expr: str) -> dict:
            return prom.query(f"last_over_time({expr}[10m])")

        # the coordinator waited for one more scrape of its final values (metrics_linger_s)
        wait_until(lambda: last("flayer_rounds_total") == {(): 3.0}, 30, "the final scrape")
        refused = {dict(k)["reason"]: v for k, v in last("flayer_updates_refused_total").items()}
        assert set(refused) == set(REFUSAL_REASONS)
        assert {k: v for k, v in refused.items() if v} == {k: float(v) for k, v in counters.items()
                                                          if v and k in REFUSAL_REASONS}
        assert last("flayer_updates_accepted_total") == {(): float(sum(r["accepted"] for r in rounds))}
        assert last("flayer_bytes_up_total") == {(): float(sum(r["bytes_up"] for r in rounds))}
        assert last("flayer_round_duration_seconds_count") == {(): 3.0}
        online = prom.query("max_over_time(flayer_devices_online[10m])")
        assert online[(("label", "slow"),)] == 3.0, online  # the emulated devices, by their profile
        assert last('flayer_last_round_devices{result="accepted"}') == {(("result", "accepted"),): 3.0}
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert len(rules) == 5 and all(r["health"] == "ok" for r in rules), rules
    finally:
        if junk is not None:
            junk.stop(timeout=1.0)
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        prom.stop()
