"""Connections and open files (docs/explanation/broker.md): every listener's max_connections in mosquitto.conf, the
automatic limit under a low hard open-file limit, and what the broker's unit allows it."""

from __future__ import annotations

from pathlib import Path

import pytest

import mqtt_broker.config as broker_config
from mqtt_broker.config import BrokerConfig, BrokerConfigError
from mqtt_broker.mosquitto_conf import render_mosquitto_conf


def test_every_listener_gets_the_limit(tmp_path: Path) -> None:
    cfg = BrokerConfig(tls=True, port=1883, tls_port=8883, max_connections=300)
    text = render_mosquitto_conf(cfg, tmp_path, tmp_path / "passwd", tmp_path / "acl", (tmp_path,) * 3)
    assert text.count("\nmax_connections 300\n") == 2
    assert cfg.open_files_needed == 2 * 300 + 64 == cfg.open_files_wanted


def test_the_automatic_limit_fits_the_hard_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker_config, "hard_open_files", lambda: 4096)
    cfg = BrokerConfig(tls=True, port=1883, tls_port=8883)
    assert cfg.max_connections == 0 and cfg.connection_limit == (4096 - 64) // 2
    assert cfg.open_files_needed <= 4096 and cfg.open_files_wanted == 2 * 5000 + 64  # what a unit allows it
    monkeypatch.setattr(broker_config, "hard_open_files", lambda: 1 << 20)
    assert BrokerConfig().connection_limit == 5000


def test_a_bad_limit_is_refused() -> None:
    with pytest.raises(BrokerConfigError, match="max_connections must be an integer in"):
        BrokerConfig(max_connections=-1)
