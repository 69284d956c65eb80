"""Broker configuration: one frozen dataclass, its limits, and its JSON form in the state folder.

The limits are chosen for a federation's traffic, not for chat-sized messages:

- ``max_packet_size`` (default 1 MiB) bounds every MQTT packet. The model blob and each update are
  cut into chunks of at most :func:`payload_limit` bytes (packet size minus a fixed allowance for
  the MQTT framing), so a 45 MB ResNet-18 travels as ~45 retained chunks and a FedAvgCNN (3.5 MB)
  as 4. Clients check the size before publishing: paho does not honour the broker's advertised
  maximum, and Mosquitto disconnects a client that sends a larger packet (paho then re-sends the
  same packet on every reconnect).
- ``max_queued_messages`` (default 10,000) per client: a device that subscribes to the model
  filter is sent every retained chunk at once, and the coordinator may fall behind a burst of
  update chunks from many devices; Mosquitto silently drops what exceeds the queue, so it must
  exceed (model chunks) and (devices x chunks per update). ``max_queued_bytes`` (1 GiB) bounds
  the memory that queue may hold. ``max_inflight_messages`` stays at Mosquitto's 20.
- ``persistence``: retained plan and model chunks and queued QoS 1 messages survive a broker restart.
- ``max_connections`` per listener: connections past it are closed at accept, so a stranger's idle sockets cannot
  take the descriptors the broker needs. 0 (the default) is :attr:`BrokerConfig.connection_limit`: 5,000, or fewer
  when the host's hard open-file limit does not allow every listener that many. The process must be allowed
  :attr:`BrokerConfig.open_files_needed` open files (every listener's limit plus :data:`RESERVE_FILES` of its own):
  the launcher raises its soft limit that far, or refuses to start (``mqtt_broker.process``); a service unit sets
  ``LimitNOFILE`` (:attr:`BrokerConfig.open_files_wanted`). Mosquitto 2.0 has no per-address limit and no setting for a connection that sends no CONNECT:
  it closes one after about 90 s (its built-in 60 s keepalive, times 1.5).

Listeners: the plain one (password only) on ``host``, the TLS one on ``tls_host`` (default ``host``).
With TLS on, a password alone must not open a door to the network: the plain listener then binds to
loopback (for a coordinator on the same host) even when ``host`` is a network address, or is off
(``plain = false``); ``insecure_plain = true`` keeps it on ``host`` anyway, with a warning
(:attr:`BrokerConfig.warning`).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from mqtt_broker.fsutil import atomic_write, open_files_limit
from protocol.topics import TopicError, validate_id
from transport.credentials import MQTT_HEADROOM, CredentialsError, payload_limit
from transport.hosts import is_loopback

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_PACKET_SIZE",
    "DEFAULT_PORT",
    "DEFAULT_STATE_DIR",
    "DEFAULT_TLS_PORT",
    "MQTT_HEADROOM",
    "RESERVE_FILES",
    "BrokerConfig",
    "BrokerConfigError",
    "ensure_open_files",
    "is_loopback",
    "payload_limit",
]

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path(".flayer/broker")
DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883
DEFAULT_MAX_PACKET_SIZE = 1 << 20  # 1 MiB
MIN_PACKET_SIZE = 16 * 1024
DEFAULT_MAX_CONNECTIONS = 5_000  # per listener; larger fleets raise it (the emulator sets its fleet's size)
RESERVE_FILES = 64  # the broker's own descriptors beside its clients: listening sockets, log, persistence, reloads
MAX_PACKET_SIZE = 256 * 1024 * 1024  # MQTT's remaining-length field tops out just above this
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def hard_open_files() -> int:
    """This process's hard open-file limit (a large number when unlimited or not POSIX)."""
    try:
        import resource
    except ImportError:
        return 1 << 20
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 30 if hard == resource.RLIM_INFINITY else int(hard)


class BrokerConfigError(CredentialsError):
    """A broker setting, flag or state file is invalid."""


def _check_host(value: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise BrokerConfigError(f"{what} must be an IP address or host name, got {value!r}")
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(value):
        raise BrokerConfigError(f"{what} {value!r} is neither an IP address nor a valid host name")
    return value


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _check_int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BrokerConfigError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


@dataclass(frozen=True)
class BrokerConfig:
    """Everything that shapes the generated Mosquitto files (no secrets here).

    ``port``/``tls_port`` 0 means "pick a free port" when the files are written; the chosen port
    is stored in the state folder, so later starts and every credentials file agree on it.
    ``advertise_host`` is the address written into credentials files (default: ``host``, or
    127.0.0.1 when ``host`` is a wildcard address); it is also put into the server certificate.
    """

    federation: str = "default"
    host: str = "127.0.0.1"
    port: int = 0
    tls: bool = False
    tls_host: str | None = None
    tls_port: int = 0
    require_certificate: bool = True
    use_identity_as_username: bool = False
    advertise_host: str | None = None
    max_packet_size: int = DEFAULT_MAX_PACKET_SIZE
    max_inflight_messages: int = 20
    max_queued_messages: int = 10_000
    max_queued_bytes: int = 1 << 30
    max_connections: int = 0  # per listener; 0: 5,000, fewer when the open-file limit is lower (module docstring)
    persistence: bool = True
    coordinator_user: str = "coordinator"
    plain: bool = True  # the plain (password only) listener; off only with TLS
    insecure_plain: bool = False  # with TLS: keep the plain listener on ``host`` even off loopback

    def __post_init__(self) -> None:
        try:
            validate_id(self.federation, "federation id")
            validate_id(self.coordinator_user, "coordinator user")
        except TopicError as exc:
            raise BrokerConfigError(str(exc)) from exc
        _check_host(self.host, "host")
        if self.tls_host is not None:
            _check_host(self.tls_host, "tls_host")
        if self.advertise_host is not None:
            _check_host(self.advertise_host, "advertise_host")
            if _is_wildcard(self.advertise_host):
                raise BrokerConfigError(f"advertise_host {self.advertise_host!r} is a wildcard; clients cannot connect to it")
        _check_int(self.port, "port", 0, 65535)
        _check_int(self.tls_port, "tls_port", 0, 65535)
        if self.port and self.port == self.tls_port:
            raise BrokerConfigError(f"port and tls_port are both {self.port}")
        for name in ("tls", "require_certificate", "use_identity_as_username", "persistence", "plain",
                     "insecure_plain"):
            if not isinstance(getattr(self, name), bool):
                raise BrokerConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.plain and not self.tls:
            raise BrokerConfigError("the plain listener can be off only with TLS on (there would be no listener)")
        if self.use_identity_as_username and not self.require_certificate:
            raise BrokerConfigError("use_identity_as_username needs require_certificate")
        _check_int(self.max_packet_size, "max_packet_size", MIN_PACKET_SIZE, MAX_PACKET_SIZE)
        _check_int(self.max_inflight_messages, "max_inflight_messages", 1, 65535)
        _check_int(self.max_queued_messages, "max_queued_messages", 1, 10_000_000)
        _check_int(self.max_queued_bytes, "max_queued_bytes", 0, 1 << 40)
        _check_int(self.max_connections, "max_connections", 0, 1_000_000)

    @property
    def listeners(self) -> int:
        return int(self.plain) + int(self.tls)

    @property
    def connection_limit(self) -> int:
        """``max_connections`` in force: the one set, else 5,000 or what this host's hard open-file limit allows."""
        if self.max_connections:
            return self.max_connections
        fit = (hard_open_files() - RESERVE_FILES) // max(1, self.listeners)
        return max(1, min(DEFAULT_MAX_CONNECTIONS, fit))

    @property
    def open_files_needed(self) -> int:
        """The open files the broker process must be allowed: every listener full, plus its own."""
        return self.listeners * self.connection_limit + RESERVE_FILES

    @property
    def open_files_wanted(self) -> int:
        """What a service unit allows it (``LimitNOFILE``): the limit set, or 5,000 per listener, plus its own."""
        return self.listeners * (self.max_connections or DEFAULT_MAX_CONNECTIONS) + RESERVE_FILES

    @property
    def max_payload(self) -> int:
        return payload_limit(self.max_packet_size)

    @property
    def plain_host(self) -> str:
        """Where the plain listener binds: ``host``, except loopback when TLS is on (module docstring)."""
        if self.tls and not self.insecure_plain and not is_loopback(self.host):
            return "127.0.0.1"
        return self.host

    @property
    def tls_bind_host(self) -> str:
        """Where the TLS listener binds: ``tls_host``, else ``host``."""
        return self.tls_host or self.host

    @property
    def bound_ports(self) -> list[tuple[str, int]]:
        """(host, port) of each listener the broker binds: the plain one, then the TLS one."""
        return ([(self.plain_host, self.port)] if self.plain else []) + \
            ([(self.tls_bind_host, self.tls_port)] if self.tls else [])

    @property
    def warning(self) -> str | None:
        """Why this configuration is risky, or None."""
        if self.tls and self.plain and self.insecure_plain and not is_loopback(self.host):
            return (f"the plain listener on {self.host}:{self.port or 'auto'} accepts a password alone from the "
                    f"network although TLS is on (insecure_plain); drop --insecure-plain to keep it on loopback")
        return None

    @property
    def connect_host(self) -> str:
        """Address clients (and the readiness probe) connect to on the plain listener."""
        if self.plain_host != self.host:
            return self.plain_host
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if _is_wildcard(self.host) else self.host

    @property
    def tls_connect_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if _is_wildcard(self.tls_bind_host) else self.tls_bind_host

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "broker config") -> BrokerConfig:
        if not isinstance(data, dict):
            raise BrokerConfigError(f"{source}: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BrokerConfigError(f"{source}: unknown key(s) {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise BrokerConfigError(f"{source}: {exc}") from exc
        except BrokerConfigError as exc:
            raise BrokerConfigError(f"{source}: {exc}") from exc

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", mode=0o600)

    @classmethod
    def load(cls, path: Path) -> BrokerConfig:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise BrokerConfigError(f"{path}: no broker set up here (run 'flayer broker start' first)") from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BrokerConfigError(f"{path}: unreadable broker config: {exc}") from exc
        return cls.from_dict(data, str(path))


def ensure_open_files(cfg: BrokerConfig) -> None:
    """Before Mosquitto starts: raise this process's soft open-file limit (which Mosquitto inherits) to
    ``cfg.open_files_needed``; BrokerConfigError naming both numbers when the hard limit is lower. A warning when the
    automatic limit is below 5,000 connections per listener (module docstring)."""
    need = cfg.open_files_needed
    soft, hard = open_files_limit(need)
    if not cfg.max_connections and cfg.connection_limit < DEFAULT_MAX_CONNECTIONS:
        log.warning("the open-file limit (hard %d) allows %d connections per listener, not %d: raise it (LimitNOFILE, "
                    "ulimit -Hn) for a larger fleet", hard, cfg.connection_limit, DEFAULT_MAX_CONNECTIONS)
    if soft < need:
        raise BrokerConfigError(f"the broker needs {need} open files (max_connections {cfg.connection_limit} on each "
                                f"of its {cfg.listeners} listener(s), plus {RESERVE_FILES} of its own) but may open "
                                f"only {soft} (hard limit {hard}): raise the limit (LimitNOFILE={need} in a service "
                                f"unit, 'ulimit -n {need}') or lower --max-connections")
