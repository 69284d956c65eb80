"""A broker's start returns only once the started process itself listens on its port.

A port found free when the broker's files are written can be taken by another server before the child binds it
(tests on two workers, or a fleet host running other services, pick ports at the same time). A readiness check
that only connects then greets that other server, and the caller's users are refused by it (CONNACK 135) or,
worse, talk to it. Here the window is made certain: another process listens on the configured port and the
pre-start check is told the port is free."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mqtt_broker import BrokerConfig, BrokerError, mosquitto_available, start_broker
from mqtt_broker import process as broker_process
from mqtt_broker.fsutil import holds_listener, listens

pytestmark = pytest.mark.integration
KINDS = ["embedded"] + (["mosquitto"] if mosquitto_available() else [])


@pytest.mark.parametrize("kind", KINDS)
def test_start_refuses_a_port_another_server_took_after_the_check(kind: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    foreign = socket.socket()
    foreign.bind(("127.0.0.1", 0))
    foreign.listen()
    port = foreign.getsockname()[1]
    monkeypatch.setattr(broker_process, "port_in_use", lambda host, p: False)  # the race's window, held open
    try:
        with pytest.raises(BrokerError, match="exited|not accept"):
            broker = start_broker(BrokerConfig(federation="race", port=port, persistence=False), tmp_path, kind=kind,
                                  timeout=8)
            broker.stop()  # reached only when start wrongly reported the foreign listener as its own
    finally:
        foreign.close()


def test_holds_listener_tells_the_owner_of_a_listening_port() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    try:
        assert holds_listener(os.getpid(), port) is False  # bound, not listening
        s.listen()
        assert holds_listener(os.getpid(), port) is True
        assert listens(os.getpid(), "127.0.0.1", port, connect=True)
        assert holds_listener(os.getppid(), port) is False  # another process: not the owner
    finally:
        s.close()
    assert holds_listener(os.getpid(), port) is False


@pytest.mark.parametrize("kind", KINDS)
def test_a_picked_port_taken_before_the_start_is_replaced_by_another(kind: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Port 0 means "any free port": when the one picked is taken before the broker binds it, the start goes on
    with another, and the users' credentials name the port the broker serves."""
    from broker_testlib import connect_probe

    from mqtt_broker import load_credentials
    from mqtt_broker import state as broker_state

    foreign = socket.socket()
    foreign.bind(("127.0.0.1", 0))
    foreign.listen()
    taken = foreign.getsockname()[1]
    picks = iter([taken])
    real = broker_state.free_port
    monkeypatch.setattr(broker_state, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    try:
        broker = start_broker(BrokerConfig(federation="race", persistence=False), tmp_path, kind=kind, timeout=8)
        try:
            assert broker.port != taken and holds_listener(broker.pid, broker.port)
            assert load_credentials(tmp_path, "coordinator").port == broker.port
            connect_probe(load_credentials(tmp_path, "coordinator")).close()
        finally:
            broker.stop()
    finally:
        foreign.close()
