"""Mosquitto setup for a federation (listeners, passwords, ACL, TLS, limits), a launcher that
records and stops exactly its own broker process, and an embedded pure-Python fallback broker.

Typical use::

    from mqtt_broker import BrokerConfig, start_broker, add_device, load_credentials

    with start_broker(BrokerConfig(federation="demo"), "runs/broker") as broker:
        dev = add_device("runs/broker", "dev-1")
        broker.reload()                      # Mosquitto re-reads passwd/acl
        coord = load_credentials("runs/broker", "coordinator")
"""

from mqtt_broker.config import (
    DEFAULT_MAX_PACKET_SIZE,
    DEFAULT_STATE_DIR,
    MQTT_HEADROOM,
    BrokerConfig,
    BrokerConfigError,
    payload_limit,
)
from mqtt_broker.process import (
    BrokerError,
    BrokerProcess,
    EmbeddedBroker,
    ManagedBroker,
    RunRecord,
    mosquitto_available,
    recorded_process,
    reload_recorded,
    stop_recorded,
)
from mqtt_broker.start import start_broker
from mqtt_broker.state import (
    BrokerFiles,
    add_coordinator,
    add_device,
    add_observer,
    list_users,
    load_credentials,
    write_broker_files,
)
from transport.credentials import (
    ConnectSettings,
    Credentials,
    TlsSettings,
    make_client,
    mqtt_connect_settings,
)

__all__ = [
    "DEFAULT_MAX_PACKET_SIZE",
    "DEFAULT_STATE_DIR",
    "MQTT_HEADROOM",
    "BrokerConfig",
    "BrokerConfigError",
    "BrokerError",
    "BrokerFiles",
    "BrokerProcess",
    "ConnectSettings",
    "Credentials",
    "EmbeddedBroker",
    "ManagedBroker",
    "RunRecord",
    "TlsSettings",
    "add_coordinator",
    "add_device",
    "add_observer",
    "list_users",
    "load_credentials",
    "make_client",
    "mosquitto_available",
    "mqtt_connect_settings",
    "payload_limit",
    "recorded_process",
    "reload_recorded",
    "start_broker",
    "stop_recorded",
    "write_broker_files",
]
