"""Connection settings of one broker user (a device or the coordinator): a 0600 TOML file the
edge client or coordinator loads, and what paho needs to connect with them. The broker side
(``mqtt_broker.state``) writes these files; this module only reads them.

File layout (``<state>/credentials/<username>.toml``)::

    federation = "default"
    role = "device"                  # or "coordinator", "observer" (read-only: status and dashboard), or
                                     # "gateway" (a site broker's bridge to the central one)
    username = "dev-1"               # also the MQTT client id
    password = "..."
    host = "127.0.0.1"
    port = 1883
    max_packet_size = 1048576        # the broker's limit on a whole MQTT packet
    max_payload = 1047552            # largest payload a client may publish (packet minus headroom)
    failover = ["127.0.0.1:1885"]    # optional: other nodes of a clustered broker, tried in turn when the
                                     # connection to host:port is lost or refused (plain listener only)

    signing_key = "ed25519:..."      # this user's private Ed25519 key (devices and the coordinator): it signs
                                     # every message the user publishes (protocol.signing)
    coordinator_key = "ed25519:..."  # devices and observers: the coordinator's public key; a device refuses
                                     # whatever that key did not sign

    [tls]                            # present when the broker has a TLS listener
    host = "127.0.0.1"
    port = 8883
    ca_file = "/.../tls/ca.crt"      # relative paths are read relative to this file
    cert_file = "/.../tls/clients/dev-1.crt"
    key_file = "/.../tls/clients/dev-1.key"
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.signing import SigningKey, VerifyKey, key_problem
from protocol.topics import TopicError, validate_id
from transport.tls_refusal import WatchedContext

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (a Jetson image): the same parser as the tomli package
    import tomli as tomllib

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

ROLES = ("device", "coordinator", "observer", "gateway", "admin")  # gateway: a site broker's bridge
# (mqtt_broker.bridge); admin: the admin's tooling, which publishes the signed revocation list (protocol.certs)
# Bytes of each packet reserved for MQTT framing: fixed header (<= 5), topic length + topic
# (the longest topic of protocol.topics is ~220 bytes), packet id (2), MQTT 5 properties.
MQTT_HEADROOM = 1024
REGISTRY_FILE = "signing_keys.json"  # the federation's public keys (mqtt_broker.keys), beside or above the file
MAX_FAILOVER = 16  # addresses besides host:port in a credentials file


class CredentialsError(ValueError):
    """A credentials file or connection setting is invalid."""


def payload_limit(max_packet_size: int) -> int:
    """Largest PUBLISH payload (envelope + body) that fits in one packet of ``max_packet_size``."""
    return max_packet_size - MQTT_HEADROOM


@dataclass(frozen=True)
class TlsSettings:
    host: str
    port: int
    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None


@dataclass(frozen=True)
class Credentials:
    """One user's connection settings. The password is left out of ``repr`` (and so out of logs)."""

    federation: str
    role: str
    username: str
    password: str = field(repr=False)
    host: str
    port: int
    max_packet_size: int
    tls: TlsSettings | None = None
    failover: tuple[tuple[str, int], ...] = ()  # other broker nodes (host, port), tried in turn
    signing_key: str = field(default="", repr=False)  # this user's private key (protocol.signing), "" for none
    coordinator_key: str = ""  # the coordinator's public key (devices, observers), "" for none
    # the federation's key registry (signing_keys.json): beside the file (a kit's copy) if there, else in the broker's
    # state folder above it; not written: a device checks the other devices' signatures of a secure round against it
    registry: Path | None = field(default=None, compare=False)
    folder: Path | None = field(default=None, compare=False, repr=False)  # where the file was read (a kit's folder)

    def __post_init__(self) -> None:
        try:
            validate_id(self.federation, "federation id")
            validate_id(self.username, "username")
        except TopicError as exc:
            raise CredentialsError(str(exc)) from exc
        if self.role not in ROLES:
            raise CredentialsError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.password, str) or not self.password:
            raise CredentialsError("password must be a non-empty string")
        for name, value in (("port", self.port), ("max_packet_size", self.max_packet_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CredentialsError(f"{name} must be a positive integer, got {value!r}")
        if not 1 <= self.port <= 65535:
            raise CredentialsError(f"port {self.port} out of range")
        object.__setattr__(self, "failover", check_failover(self.failover))
        for name, private in (("signing_key", True), ("coordinator_key", False)):
            value = getattr(self, name)
            problem = key_problem(value, private) if value != "" else None
            if problem:
                raise CredentialsError(f"{name}: {problem}")

    def signer(self) -> SigningKey:
        """This user's private key; CredentialsError when the file has none (an earlier release wrote it)."""
        if not self.signing_key:
            raise CredentialsError(f"credentials of {self.username} hold no signing key (written by an earlier "
                                   "release): issue them again ('flayer broker add-device ID --rotate', or 'flayer "
                                   "broker start' for the coordinator's)")
        return SigningKey.from_text(self.signing_key)

    def coordinator(self) -> VerifyKey:
        """The coordinator's public key; CredentialsError when the file has none."""
        if not self.coordinator_key:
            raise CredentialsError(f"credentials of {self.username} hold no coordinator key (written by an earlier "
                                   "release): get a new kit ('flayer broker add-device ID --rotate --kit FILE')")
        return VerifyKey.from_text(self.coordinator_key)

    @property
    def client_id(self) -> str:
        """The broker binds the client id to the username (Mosquitto replaces it; the embedded broker
        refuses a different one), so clients must connect with this id."""
        return self.username

    @property
    def max_payload(self) -> int:
        return payload_limit(self.max_packet_size)

    def to_toml(self) -> str:
        q = json.dumps  # a JSON string literal is a valid TOML basic string for these values
        lines = [
            f"# MQTT credentials of {self.role} {self.username!r}, federation {self.federation!r}.",
            "# Secret: keep this file private (mode 0600). Written by 'flayer broker'.",
            f"federation = {q(self.federation)}",
            f"role = {q(self.role)}",
            f"username = {q(self.username)}",
            f"password = {q(self.password)}",
            f"host = {q(self.host)}",
            f"port = {self.port}",
            f"max_packet_size = {self.max_packet_size}",
            f"max_payload = {self.max_payload}",
        ]
        if self.signing_key:
            lines.append(f"signing_key = {q(self.signing_key)}")
        if self.coordinator_key:
            lines.append(f"coordinator_key = {q(self.coordinator_key)}")
        if self.failover:
            lines.append(f"failover = {json.dumps([f'[{h}]:{p}' if ':' in h else f'{h}:{p}' for h, p in self.failover])}")
        if self.tls is not None:
            lines += ["", "[tls]", f"host = {q(self.tls.host)}", f"port = {self.tls.port}",
                      f"ca_file = {q(str(self.tls.ca_file))}"]
            if self.tls.cert_file is not None and self.tls.key_file is not None:
                lines += [f"cert_file = {q(str(self.tls.cert_file))}", f"key_file = {q(str(self.tls.key_file))}"]
        return "\n".join(lines) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> Credentials:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError as exc:
            raise CredentialsError(f"{path}: credentials file not found") from exc
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise CredentialsError(f"{path}: unreadable credentials file: {exc}") from exc
        try:
            return cls._from_dict(data, path.parent)
        except CredentialsError as exc:
            raise CredentialsError(f"{path}: {exc}") from exc

    @classmethod
    def _from_dict(cls, data: dict[str, Any], base: Path) -> Credentials:
        top = {"federation", "role", "username", "password", "host", "port", "max_packet_size", "max_payload", "tls",
               "failover", "signing_key", "coordinator_key"}
        unknown = sorted(set(data) - top)
        if unknown:
            raise CredentialsError(f"unknown key(s) {', '.join(unknown)}")
        missing = sorted({"federation", "role", "username", "password", "host", "port", "max_packet_size"} - set(data))
        if missing:
            raise CredentialsError(f"missing key(s) {', '.join(missing)}")
        for key in ("federation", "role", "username", "password", "host"):
            if not isinstance(data[key], str):
                raise CredentialsError(f"{key} must be a string")
        tls = None
        if "tls" in data:
            t = data["tls"]
            if not isinstance(t, dict) or set(t) - {"host", "port", "ca_file", "cert_file", "key_file"}:
                raise CredentialsError("[tls] holds unknown keys (expected host, port, ca_file, cert_file, key_file)")
            if not isinstance(t.get("host"), str) or not isinstance(t.get("port"), int) or not isinstance(t.get("ca_file"), str):
                raise CredentialsError("[tls] needs host (string), port (integer) and ca_file (string)")
            if ("cert_file" in t) != ("key_file" in t):
                raise CredentialsError("[tls] needs both cert_file and key_file, or neither")
            tls = TlsSettings(t["host"], t["port"], base / t["ca_file"],
                              base / t["cert_file"] if "cert_file" in t else None,
                              base / t["key_file"] if "key_file" in t else None)
        failover = data.get("failover", [])
        if not isinstance(failover, list) or not all(isinstance(a, str) for a in failover):
            raise CredentialsError('failover must be a list of "host:port" strings')
        for key in ("signing_key", "coordinator_key"):
            if not isinstance(data.get(key, ""), str):
                raise CredentialsError(f"{key} must be a string")
        registry = base / REGISTRY_FILE if (base / REGISTRY_FILE).is_file() else base.parent / REGISTRY_FILE
        creds = cls(data["federation"], data["role"], data["username"], data["password"], data["host"], data["port"],
                    data["max_packet_size"], tls, tuple(parse_address(a) for a in failover),
                    data.get("signing_key", ""), data.get("coordinator_key", ""), registry, base)
        if "max_payload" in data and data["max_payload"] != creds.max_payload:
            raise CredentialsError(f"max_payload {data['max_payload']!r} does not match max_packet_size "
                                    f"{creds.max_packet_size} (expected {creds.max_payload})")
        return creds


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:1883"`` for IPv6) as (host, port)."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in host):
        raise CredentialsError(f'failover address {text!r} is not "host:port" with a port in 1-65535')
    return host, int(port)


def check_failover(addresses: Any) -> tuple[tuple[str, int], ...]:
    """The failover addresses as a tuple of (host, port), each checked; at most MAX_FAILOVER."""
    try:
        items = tuple(addresses)
    except TypeError:
        raise CredentialsError(f"failover must be a sequence of (host, port), got {addresses!r}") from None
    if len(items) > MAX_FAILOVER:
        raise CredentialsError(f"at most {MAX_FAILOVER} failover addresses, got {len(items)}")
    out = []
    for item in items:
        if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str) or not item[0]
                or any(c.isspace() for c in item[0]) or isinstance(item[1], bool) or not isinstance(item[1], int)
                or not 1 <= item[1] <= 65535):
            raise CredentialsError(f"failover address {item!r} is not (host, port) with a port in 1-65535")
        out.append(item)
    return tuple(out)


@dataclass(frozen=True)
class ConnectSettings:
    """What an MQTT client needs: pass to paho as shown in :func:`make_client`."""

    host: str
    port: int
    client_id: str
    username: str
    password: str = field(repr=False)
    ssl_context: ssl.SSLContext | None = None
    max_payload: int = 0
    failover: tuple[tuple[str, int], ...] = ()  # other nodes to reconnect to, in turn (MqttLink)


def tls_context(tls: TlsSettings, with_client_cert: bool = True) -> ssl.SSLContext:
    """Verify the broker against the federation CA (host name included); present the client cert. The context
    notes the certificate alerts the broker sends (:mod:`transport.tls_refusal`)."""
    ctx = WatchedContext(ssl.PROTOCOL_TLS_CLIENT)  # ssl.create_default_context's client settings:
    ctx.verify_mode, ctx.check_hostname = ssl.CERT_REQUIRED, True
    ctx.load_verify_locations(cafile=str(tls.ca_file))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if with_client_cert and tls.cert_file is not None and tls.key_file is not None:
        ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    return ctx


def mqtt_connect_settings(creds: Credentials, use_tls: bool | None = None, client_cert: bool = True) -> ConnectSettings:
    """Settings for ``creds``; ``use_tls`` None = TLS when the credentials have it."""
    if use_tls is None:
        use_tls = creds.tls is not None
    if use_tls:
        if creds.tls is None:
            raise CredentialsError(f"credentials of {creds.username} have no [tls] section")
        return ConnectSettings(creds.tls.host, creds.tls.port, creds.client_id, creds.username, creds.password,
                               tls_context(creds.tls, client_cert), creds.max_payload)
    return ConnectSettings(creds.host, creds.port, creds.client_id, creds.username, creds.password, None,
                           creds.max_payload, creds.failover)


def make_client(settings: ConnectSettings, clean_session: bool = True) -> Any:
    """A configured, not yet connected paho 2.x client (MQTT 3.1.1, callback API version 2).
    Connect with ``client.connect(settings.host, settings.port)``."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=settings.client_id, clean_session=clean_session,
                         protocol=mqtt.MQTTv311)
    client.username_pw_set(settings.username, settings.password)
    if settings.ssl_context is not None:
        client.tls_set_context(settings.ssl_context)
    return client
