"""TLS without a plain door: with TLS on, the plain (password only) listener binds to loopback or is
off unless ``insecure_plain`` asks for it (with a warning); each listener's host has its own setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from mqtt_broker import BrokerConfig, mosquitto_available, start_broker
from mqtt_broker.config import BrokerConfigError
from mqtt_broker.mosquitto_conf import render_mosquitto_conf

P = Path("/x")


def _listeners(cfg: BrokerConfig) -> list[str]:
    tls = (P, P, P) if cfg.tls else None
    return [ln for ln in render_mosquitto_conf(cfg, P, P, P, tls).splitlines() if ln.startswith("listener ")]


def test_plain_listener_stays_on_loopback_with_tls() -> None:
    assert _listeners(BrokerConfig(host="0.0.0.0", port=1883)) == ["listener 1883 0.0.0.0"]  # no TLS: as asked
    cfg = BrokerConfig(host="0.0.0.0", port=1883, tls=True, tls_port=8883)
    assert _listeners(cfg) == ["listener 1883 127.0.0.1", "listener 8883 0.0.0.0"] and cfg.warning is None
    assert cfg.connect_host == "127.0.0.1"
    split = BrokerConfig(host="127.0.0.1", tls_host="0.0.0.0", port=1883, tls=True, tls_port=8883)
    assert _listeners(split) == ["listener 1883 127.0.0.1", "listener 8883 0.0.0.0"]


def test_plain_listener_off_or_explicitly_open() -> None:
    off = BrokerConfig(host="0.0.0.0", port=1883, tls=True, tls_port=8883, plain=False)
    assert _listeners(off) == ["listener 8883 0.0.0.0"]
    with pytest.raises(BrokerConfigError, match="only with TLS"):
        BrokerConfig(plain=False)
    risky = BrokerConfig(host="0.0.0.0", port=1883, tls=True, tls_port=8883, insecure_plain=True)
    assert _listeners(risky) == ["listener 1883 0.0.0.0", "listener 8883 0.0.0.0"]
    assert risky.warning is not None and "password alone" in risky.warning


@pytest.mark.integration
@pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")
def test_mosquitto_with_tls_on_every_interface_keeps_plain_on_loopback(tmp_path: Path) -> None:
    cfg = BrokerConfig(federation="lst", host="0.0.0.0", tls=True, persistence=False)
    with start_broker(cfg, tmp_path / "b", kind="mosquitto", timeout=30) as broker:
        conf = (tmp_path / "b" / "mosquitto.conf").read_text()
        assert f"listener {broker.config.port} 127.0.0.1" in conf
        assert f"listener {broker.config.tls_port} 0.0.0.0" in conf
