"""The central broker's gateway users and the devices behind each (``gateways.json`` of its state folder):
reading and writing the list, checking a gateway's devices, its ACL block and taking a revoked device off
it. The bridge a site runs to reach such a user is mqtt_broker.bridge; adding a gateway user is
mqtt_broker.state's ``add_gateway``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from mqtt_broker.config import BrokerConfigError
from mqtt_broker.fsutil import atomic_write
from protocol.topics import OBSERVER_USER, TopicError, Topics, validate_id

__all__ = ["MAX_DEVICES_PER_GATEWAY", "drop_gateway_device", "gateway_acl", "read_gateways",
           "validate_gateway_devices", "write_gateways"]

MAX_DEVICES_PER_GATEWAY = 10_000


def _gateways_file(state_dir: Path) -> Path:  # central side: gateway -> its devices
    return state_dir / "gateways.json"



def read_gateways(state_dir: Path) -> dict[str, list[str]]:
    """Gateway user -> the device ids behind it (empty when no gateway was added)."""
    path = _gateways_file(state_dir)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BrokerConfigError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(d, str) for d in v) for k, v in data.items()):
        raise BrokerConfigError(f"{path}: expected a JSON object of gateway -> list of device ids")
    return data


def write_gateways(state_dir: Path, gateways: dict[str, list[str]]) -> None:
    atomic_write(_gateways_file(state_dir), json.dumps(gateways, indent=1, sort_keys=True) + "\n", mode=0o600)


def validate_gateway_devices(gateway: str, devices: Iterable[str], users: dict[str, str],
                             gateways: dict[str, list[str]], coordinator_user: str) -> list[str]:
    """The device ids behind ``gateway``, checked: valid ids, none a user of this broker (``users``: name
    -> role), none behind another gateway, at least one. Returns them sorted, without repeats."""
    out = []
    for d in devices:
        try:
            validate_id(d, "device id")
        except TopicError as exc:
            raise BrokerConfigError(f"--gateway-for: {exc}") from exc
        out.append(d)
    out = sorted(set(out))
    if not out:
        raise BrokerConfigError(f"gateway {gateway!r} needs at least one device behind it (--gateway-for DEV[,DEV...])")
    if len(out) > MAX_DEVICES_PER_GATEWAY:
        raise BrokerConfigError(f"gateway {gateway!r}: {len(out)} devices, at most {MAX_DEVICES_PER_GATEWAY}")
    for d in out:
        if d == gateway:
            raise BrokerConfigError(f"device {d!r} cannot have the name of its own gateway")
        if d in (coordinator_user, OBSERVER_USER):
            raise BrokerConfigError(f"{d!r} is a reserved user name; a device cannot use it")
        if d in users:
            raise BrokerConfigError(f"{d!r} already has its own {users[d]} credentials on this broker; a device "
                                    f"behind a gateway has credentials on the site broker only (revoke it here first)")
        other = next((g for g, ds in gateways.items() if g != gateway and d in ds), None)
        if other is not None:
            raise BrokerConfigError(f"device {d!r} is already behind gateway {other!r}")
    return out


def gateway_acl(federation: str, gateways: dict[str, list[str]]) -> str:
    """The central ACL's block of each gateway user (see the module docstring)."""
    p = Topics(federation).prefix
    lines: list[str] = []
    for gw in sorted(gateways):
        validate_id(gw, "gateway id")
        lines += ["", f"# gateway {gw}: the topics of the {len(gateways[gw])} device(s) behind it", f"user {gw}"]
        # deny what the device patterns would give the gateway under its own name
        lines += [f"topic deny {p}/{kind}/{gw}" for kind in ("ack", "secreq", "secagg", "status", "metrics")]
        lines += [f"topic deny {p}/update/{gw}/#", f"topic read {p}/round", f"topic read {p}/model/#"]
        for d in sorted(gateways[gw]):
            validate_id(d, "device id")
            lines += [f"topic read {p}/ack/{d}", f"topic read {p}/secreq/{d}", f"topic write {p}/update/{d}/#",
                      f"topic write {p}/status/{d}", f"topic write {p}/metrics/{d}", f"topic write {p}/secagg/{d}"]
    return "\n".join(lines) + ("\n" if lines else "")


def drop_gateway_device(state_dir: Path, device_id: str) -> str | None:
    """Take ``device_id`` off its gateway's list (``flayer broker revoke`` on the central broker); the
    gateway it was behind, or None. The caller rewrites the ACL and reloads."""
    gateways = read_gateways(state_dir)
    for gw, devices in gateways.items():
        if device_id in devices:
            devices.remove(device_id)
            write_gateways(state_dir, gateways)
            return gw
    return None
