"""The MQTT client side that the coordinator, the edge client and the emulator share: one
connection whose callbacks only enqueue (:mod:`transport.link`) and the credentials file a
broker user connects with (:mod:`transport.credentials`). A device imports this package, never
``mqtt_broker`` (which sets up and administers the broker)."""

from transport.credentials import (
    MQTT_HEADROOM,
    ConnectSettings,
    Credentials,
    CredentialsError,
    TlsSettings,
    make_client,
    mqtt_connect_settings,
    payload_limit,
)

__all__ = [
    "MQTT_HEADROOM",
    "ConnectSettings",
    "Credentials",
    "CredentialsError",
    "TlsSettings",
    "make_client",
    "mqtt_connect_settings",
    "payload_limit",
]
