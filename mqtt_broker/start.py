"""Start a broker for a state folder: the kind (Mosquitto where installed, else the embedded one), the files,
and ports picked free that stay free until the broker holds them (:mod:`mqtt_broker.process` runs it)."""

from __future__ import annotations

import logging
from pathlib import Path

from mqtt_broker.config import BrokerConfig, BrokerConfigError, is_loopback
from mqtt_broker.fsutil import port_in_use
from mqtt_broker.process import (
    BrokerError,
    BrokerProcess,
    EmbeddedBroker,
    ManagedBroker,
    mosquitto_available,
    recorded_process,
)
from mqtt_broker.state import BrokerFiles, resolve_ports, write_broker_files

__all__ = ["KINDS", "start_broker"]

log = logging.getLogger(__name__)

KINDS = ("auto", "mosquitto", "embedded")

PORT_ATTEMPTS = 3  # starts on freshly picked ports before giving up


def start_broker(cfg: BrokerConfig, state_dir: str | Path, kind: str = "auto", detach: bool = False,
                 timeout: float = 15.0) -> ManagedBroker:
    """Write the files for ``cfg`` and start a broker on them: mosquitto when installed (or asked
    for), else the embedded one. Returns the started broker (use it as a context manager)."""
    if kind not in KINDS:
        raise BrokerConfigError(f"broker kind must be one of {KINDS}, got {kind!r}")
    from mqtt_broker.bridge import gateway_configured

    files = BrokerFiles.at(state_dir)
    if kind != "mosquitto" and gateway_configured(files.state_dir):
        if kind == "embedded" or not mosquitto_available():
            raise BrokerError("a field gateway's bridge needs mosquitto (the embedded broker has no bridges); "
                              "install mosquitto, or drop the gateway with --no-gateway")
        kind = "mosquitto"
    if kind == "auto":
        kind = "mosquitto" if mosquitto_available() else "embedded"
        if kind == "embedded":
            log.warning("mosquitto is not installed: starting the embedded broker (see docs/explanation/broker.md for its limits)")
    if kind == "embedded" and cfg.tls:
        raise BrokerError("the embedded broker has no TLS listener; install mosquitto for TLS")
    if kind == "embedded" and not is_loopback(cfg.host):
        raise BrokerError(f"the embedded broker listens on loopback only, not on {cfg.host!r}")
    running = recorded_process(state_dir) if files.run_record.exists() else None
    if running is not None:
        raise BrokerError(f"a {running.kind} broker already runs for {files.state_dir} "
                          f"(pid {running.pid}, port {running.port}); stop it first")
    stored = BrokerConfig.load(files.config) if files.config.exists() else None
    # ports picked free here (none asked for, none stored) can be taken by another server before the child binds
    # them: then the start fails and is tried again on newly picked ports (an asked-for port is kept)
    picked = not cfg.port and not (stored and stored.port)
    asked = cfg
    for attempt in range(PORT_ATTEMPTS if picked else 1):
        write_broker_files(cfg, state_dir)
        broker: ManagedBroker = BrokerProcess(state_dir, detach) if kind == "mosquitto" else EmbeddedBroker(state_dir, detach)
        try:
            return broker.start(timeout)
        except BrokerError:
            taken = _taken_ports(broker.config)
            if attempt == PORT_ATTEMPTS - 1 or not picked or not taken:
                raise
            log.warning("port(s) %s were taken by another server while the broker started; trying other ports", taken)
            cfg = resolve_ports(asked)  # picked afresh: none stored to reuse
    raise AssertionError("unreachable")


def _taken_ports(cfg: BrokerConfig) -> list[int]:
    """The broker's ports that some process listens on now (its own process has exited or was stopped)."""
    return [port for host, port in cfg.bound_ports if port_in_use(host, port)]
