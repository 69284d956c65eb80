"""Field gateway: a site Mosquitto bridged to the central one, and the central side's gateway users.

A site (a farm, a building, a vehicle depot) runs its own broker; the devices there connect to it
with their own credentials (``flayer broker add-device`` on the site's state folder). The site
broker keeps one MQTT connection to the central broker (where the coordinator is) over the
backhaul: a Mosquitto ``connection`` block, written into ``bridge.d/gateway.conf`` of the site's
state folder (mode 0600: it holds the gateway's password, which Mosquitto 2.0 accepts only inline)
and included from ``mosquitto.conf``.

What crosses the bridge (``<p>`` = ``fl/<federation>``), every topic line at QoS 1:

==================  =========  ====================================================
topic               direction  why
==================  =========  ====================================================
``<p>/round``        in         the round plan (retained)
``<p>/model/#``      in         model and delta chunks (retained, ``model/<digest>/+``)
``<p>/ack/+``        in         the coordinator's acks to the site's devices
``<p>/secreq/+``     in         secure-round messages to the site's devices
``<p>/update/#``     out        update chunks
``<p>/status/+``     out        statuses (retained, last will)
``<p>/metrics/+``    out        metrics
``<p>/secagg/+``     out        secure-round messages from the site's devices
==================  =========  ====================================================

Retained messages keep their retain bit across the bridge only when the remote broker knows the
connection is a bridge (``try_private true``, MQTT 3.1.1 with the bridge bit); otherwise a plan or
model chunk published while the bridge is up would reach the site as a plain message and never be
stored there. ``cleansession false`` keeps the gateway's session (its subscriptions and the QoS 1
messages queued for it) on the central broker across a backhaul outage, and ``local_cleansession
false`` keeps the site broker queueing the devices' updates for the bridge while it is down; the
site broker must run with persistence so that a restart keeps both its queue and the retained plan.

On the central broker the bridge logs in as a *gateway* user (``flayer broker add-device SITE
--gateway-for DEV,...``). Its ACL block allows exactly the topics of the devices behind it: it
reads the plan, the model and those devices' ``ack``/``secreq`` topics and writes their
``update``/``status``/``metrics``/``secagg`` topics, nothing else; the rights Mosquitto's device
patterns would give it under its own name are denied. The wildcard topic lines above therefore
carry, on the central broker, only what the gateway's ACL lets through; the site's own ACL (the
usual device patterns) keeps each device to its own topics. The list lives in ``gateways.json`` of
the central state folder; a device is behind at most one gateway and has no direct credentials on
the central broker (mqtt_broker.gateway_list; ``add_gateway`` of mqtt_broker.state adds one).
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mqtt_broker.config import BrokerConfig, BrokerConfigError, _check_host
from mqtt_broker.fsutil import atomic_write, private_dir
from mqtt_broker.gateway_list import (  # re-exported: the central side's list of gateways
    drop_gateway_device,
    gateway_acl,
    read_gateways,
    validate_gateway_devices,
)
from protocol.topics import Topics
from transport.credentials import Credentials, CredentialsError, TlsSettings

__all__ = [
    "BRIDGE_NAME",
    "GatewaySettings",
    "bridge_topics",
    "drop_gateway_device",
    "gateway_acl",
    "gateway_configured",
    "parse_address",
    "read_gateway_settings",
    "read_gateways",
    "remove_gateway",
    "render_bridge_conf",
    "set_gateway",
    "validate_gateway_devices",
    "write_bridge_files",
]

BRIDGE_NAME = "flayer-gateway"
DEFAULT_KEEPALIVE_S = 30
DEFAULT_RESTART_S = (2, 30)
_PORT = re.compile(r"[0-9]{1,5}")


# ---- paths -------------------------------------------------------------------------------------------


def _site_dir(state_dir: Path) -> Path:  # site side: the gateway identity and its settings
    return state_dir / "gateway"


def _bridge_dir(state_dir: Path) -> Path:
    return state_dir / "bridge.d"


# ---- the site side ------------------------------------------------------------------------------------


def parse_address(text: str, what: str = "--gateway-to") -> tuple[str, int]:
    """``HOST:PORT`` (host name or IPv4 address; port 1-65535)."""
    if not isinstance(text, str) or text.count(":") != 1:
        raise BrokerConfigError(f"{what} must be HOST:PORT (a host name or IPv4 address), got {text!r}")
    host, port = text.split(":")
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise BrokerConfigError(f"{what}: port must be 1-65535, got {port!r}")
    return _check_remote_host(host, what), int(port)


def _check_remote_host(host: str, what: str) -> str:
    _check_host(host, f"{what} host")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if ip.version != 4:
        raise BrokerConfigError(f"{what}: IPv6 addresses are not supported for the bridge; use a host name")
    if ip.is_unspecified:
        raise BrokerConfigError(f"{what}: {host} is a wildcard address; give the central broker's address")
    return host


def _check_int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BrokerConfigError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


@dataclass(frozen=True)
class GatewaySettings:
    """The bridge of one site (``gateway/settings.json``; the password stays in ``gateway/credentials.toml``).

    ``keepalive_s``: the bridge pings the central broker after that many idle seconds (Mosquitto's
    minimum is 5) and gives the link up after 1.5 times as long without an answer; ``restart_s``:
    (base, cap) of Mosquitto's jittered back-off before each reconnect attempt."""

    host: str
    port: int
    tls: bool = False
    keepalive_s: int = DEFAULT_KEEPALIVE_S
    restart_s: tuple[int, int] = DEFAULT_RESTART_S

    def __post_init__(self) -> None:
        _check_remote_host(self.host, "gateway host")
        _check_int(self.port, "gateway port", 1, 65535)
        if not isinstance(self.tls, bool):
            raise BrokerConfigError(f"gateway tls must be true or false, got {self.tls!r}")
        _check_int(self.keepalive_s, "gateway keepalive", 5, 65535)
        r = self.restart_s
        if not isinstance(r, (tuple, list)) or len(r) != 2:
            raise BrokerConfigError(f"gateway restart must be (base, cap) in seconds, got {r!r}")
        base, cap = (_check_int(v, "gateway restart seconds", 1, 3600) for v in r)
        if cap < base:
            raise BrokerConfigError(f"gateway restart cap {cap} s is below its base {base} s")
        object.__setattr__(self, "restart_s", (base, cap))

    @classmethod
    def from_dict(cls, data: Any, source: str) -> GatewaySettings:
        if not isinstance(data, dict) or set(data) - {"host", "port", "tls", "keepalive_s", "restart_s"}:
            raise BrokerConfigError(f"{source}: expected an object of host, port, tls, keepalive_s, restart_s")
        try:
            return cls(**{**data, "restart_s": tuple(data.get("restart_s", DEFAULT_RESTART_S))})
        except TypeError as exc:
            raise BrokerConfigError(f"{source}: {exc}") from exc
        except BrokerConfigError as exc:
            raise BrokerConfigError(f"{source}: {exc}") from exc


def parse_restart(text: str) -> tuple[int, int]:
    """``--gateway-retry BASE,CAP`` (seconds) or ``--gateway-retry S`` (both the same)."""
    parts = text.split(",")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise BrokerConfigError(f"--gateway-retry must be SECONDS or BASE,CAP (whole seconds), got {text!r}")
    base, cap = int(parts[0]), int(parts[-1])
    GatewaySettings("127.0.0.1", 1, restart_s=(base, cap))  # the range checks
    return base, cap


def gateway_configured(state_dir: Path) -> bool:
    return (_site_dir(state_dir) / "settings.json").exists()


def read_gateway_settings(state_dir: Path) -> tuple[GatewaySettings, Credentials] | None:
    site = _site_dir(state_dir)
    path = site / "settings.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BrokerConfigError(f"{path}: unreadable ({exc})") from exc
    settings = GatewaySettings.from_dict(data, str(path))
    try:
        creds = Credentials.load(site / "credentials.toml")
    except CredentialsError as exc:
        raise BrokerConfigError(f"gateway credentials: {exc}") from exc
    return settings, creds


def _check_against(cfg: BrokerConfig, creds: Credentials, source: str) -> None:
    if creds.role != "gateway":
        raise BrokerConfigError(f"{source} holds a {creds.role}'s credentials, not a gateway's (create one on the "
                                f"central broker: flayer broker add-device SITE --gateway-for DEV,...)")
    if creds.federation != cfg.federation:
        raise BrokerConfigError(f"{source} is for federation {creds.federation!r}; this site broker serves "
                                f"{cfg.federation!r} (start it with --federation {creds.federation})")
    if creds.max_packet_size != cfg.max_packet_size:
        raise BrokerConfigError(f"the central broker's max_packet_size is {creds.max_packet_size}, this site's "
                                f"{cfg.max_packet_size}: they must be equal (a chunk cut for one must fit the other); "
                                f"start the site with --max-packet-size {creds.max_packet_size}")
    if not cfg.persistence:
        raise BrokerConfigError("a gateway site broker needs persistence (its queue for the bridge and the retained "
                                "plan and model must survive a restart): drop --no-persistence")


def set_gateway(state_dir: Path, cfg: BrokerConfig, credentials: Path | None, address: str | None,
                keepalive_s: int | None, restart_s: tuple[int, int] | None) -> GatewaySettings:
    """Store the bridge of this (site) state folder: the gateway's credentials file (copied here, 0600, with
    its TLS files when it has them) and the address of the central broker (default: the one in the
    credentials file). Options not given keep their stored values."""
    old = read_gateway_settings(state_dir)
    if credentials is None and old is None:
        raise BrokerConfigError("no gateway is set up in this state folder: give --gateway-credentials FILE "
                                "(a gateway's credentials file from the central broker)")
    if credentials is not None:
        try:
            creds = Credentials.load(credentials)
        except CredentialsError as exc:
            raise BrokerConfigError(f"--gateway-credentials: {exc}") from exc
        source = str(credentials)
    else:
        assert old is not None
        creds, source = old[1], "the stored gateway credentials"
    _check_against(cfg, creds, source)
    use_tls = creds.tls is not None
    if address is not None:
        host, port = parse_address(address)
    elif credentials is None and old is not None:
        host, port = old[0].host, old[0].port
    elif use_tls:
        assert creds.tls is not None
        host, port = creds.tls.host, creds.tls.port
    else:
        host, port = creds.host, creds.port
    base = old[0] if old else None
    settings = GatewaySettings(
        host, port, use_tls,
        keepalive_s if keepalive_s is not None else (base.keepalive_s if base else DEFAULT_KEEPALIVE_S),
        restart_s if restart_s is not None else (base.restart_s if base else DEFAULT_RESTART_S))
    site = private_dir(_site_dir(state_dir))
    if credentials is not None:
        tls = None
        if creds.tls is not None:
            if creds.tls.cert_file is None or creds.tls.key_file is None:
                raise BrokerConfigError(f"{source}: its [tls] names no client certificate; the bridge needs one")
            copied = []
            for src, name in ((creds.tls.ca_file, "ca.crt"), (creds.tls.cert_file, "gateway.crt"),
                              (creds.tls.key_file, "gateway.key")):
                if not Path(src).is_file():
                    raise BrokerConfigError(f"{source}: TLS file {src} not found (copy it beside the credentials)")
                dst = site / name
                shutil.copyfile(src, dst)
                dst.chmod(0o600)
                copied.append(dst)
            tls = TlsSettings(creds.tls.host, creds.tls.port, copied[0], copied[1], copied[2])
        creds = Credentials(creds.federation, creds.role, creds.username, creds.password, creds.host, creds.port,
                            creds.max_packet_size, tls, coordinator_key=creds.coordinator_key)
        atomic_write(site / "credentials.toml", creds.to_toml(), mode=0o600)
    atomic_write(site / "settings.json", json.dumps(asdict(settings), indent=1) + "\n", mode=0o600)
    return settings


def remove_gateway(state_dir: Path) -> bool:
    """Forget this site's bridge (``--no-gateway``); False when none was set up."""
    existed = gateway_configured(state_dir)
    shutil.rmtree(_site_dir(state_dir), ignore_errors=True)
    shutil.rmtree(_bridge_dir(state_dir), ignore_errors=True)
    return existed


def bridge_topics(federation: str) -> list[tuple[str, str]]:
    """(topic filter, direction) of every topic line (the module docstring's table)."""
    p = Topics(federation).prefix
    return [(f"{p}/round", "in"), (f"{p}/model/#", "in"), (f"{p}/ack/+", "in"), (f"{p}/secreq/+", "in"),
            (f"{p}/update/#", "out"), (f"{p}/status/+", "out"), (f"{p}/metrics/+", "out"), (f"{p}/secagg/+", "out")]


def render_bridge_conf(federation: str, settings: GatewaySettings, creds: Credentials) -> str:
    """The ``connection`` block of the site broker (holds the password: write it with mode 0600)."""
    for value in (creds.username, creds.password):
        if any(c.isspace() for c in value):
            raise BrokerConfigError("gateway credentials hold white space, which mosquitto.conf cannot carry")
    base, cap = settings.restart_s
    lines = [
        f"# Bridge of this site to the central broker of federation {federation!r}, written by FLAYER Edge",
        "# (mqtt_broker.bridge) on every 'flayer broker start'. Holds the gateway's password: mode 0600.",
        f"connection {BRIDGE_NAME}",
        f"address {settings.host}:{settings.port}",
        "bridge_protocol_version mqttv311",
        "try_private true",  # the remote knows this is a bridge: retained messages keep their retain bit
        "bridge_outgoing_retain true",
        f"remote_clientid {creds.username}",
        f"remote_username {creds.username}",
        f"remote_password {creds.password}",
        "cleansession false",  # the central broker keeps the session and queues QoS 1 messages for it
        "local_cleansession false",  # this broker queues the devices' messages while the bridge is down
        "start_type automatic",
        f"restart_timeout {base} {cap}",
        f"keepalive_interval {settings.keepalive_s}",
        f"bridge_max_packet_size {creds.max_packet_size}",
        "notifications true",
        "notifications_local_only true",
    ]
    if settings.tls:
        assert creds.tls is not None and creds.tls.cert_file is not None and creds.tls.key_file is not None
        lines += [f"bridge_cafile {creds.tls.ca_file}", f"bridge_certfile {creds.tls.cert_file}",
                  f"bridge_keyfile {creds.tls.key_file}", "bridge_tls_version tlsv1.2"]
    lines += [f"topic {t} {direction} 1" for t, direction in bridge_topics(federation)]
    return "\n".join(lines) + "\n"


def write_bridge_files(state_dir: Path, cfg: BrokerConfig) -> Path | None:
    """``bridge.d/gateway.conf`` when this folder has a gateway (checked against ``cfg`` again); the folder
    to include from ``mosquitto.conf``, or None (and no ``bridge.d``) when it has none."""
    got = read_gateway_settings(state_dir)
    folder = _bridge_dir(state_dir)
    if got is None:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    settings, creds = got
    _check_against(cfg, creds, "the stored gateway credentials")
    private_dir(folder)
    atomic_write(folder / "gateway.conf", render_bridge_conf(cfg.federation, settings, creds), mode=0o600)
    return folder


def describe(state_dir: Path) -> list[str]:
    """Lines for ``flayer broker status``: the site's bridge, and the central side's gateways."""
    out = []
    got = read_gateway_settings(state_dir)
    if got is not None:
        s, creds = got
        out.append(f"gateway:    bridge to {s.host}:{s.port}{' (TLS)' if s.tls else ''} as {creds.username}, keepalive "
                   f"{s.keepalive_s} s, reconnect back-off {s.restart_s[0]}-{s.restart_s[1]} s")
    for gw, devices in sorted(read_gateways(state_dir).items()):
        out.append(f"  gateway {gw} serves {len(devices)} device(s): {', '.join(devices[:8])}"
                   f"{' ...' if len(devices) > 8 else ''}")
    return out
