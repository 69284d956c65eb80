"""Signing keys of a federation: the registry of public keys beside the credentials, re-keying, revocation.

Every device and the coordinator hold their own Ed25519 private key, in their 0600 credentials file
(``signing_key``), made with their password; every device's credentials (and so its kit) also carry the
coordinator's public key (``coordinator_key``). The coordinator reads the devices' public keys from the
registry of the state folder, ``signing_keys.json`` (0600)::

    {"coordinator": "ed25519:...", "devices": {"dev-1": "ed25519:...", ...}}

and believes a device's message only when that key signed it (:mod:`protocol.signing`). Re-keying a device
(``flayer broker rekey ID``, or ``add-device ID --rotate``) replaces its key pair: the old public key leaves
the registry, so whatever the old key signs is refused from then on (the coordinator re-reads the file when
it changes). Re-keying the coordinator (``flayer broker rekey --coordinator``) replaces its key pair and
rewrites every credentials file with the new public key: devices need their new kits, and refuse what the
old key signs. Revoking a device removes its public key with its password. The devices do not read this registry to check each
other (unless they run without a kit, on the broker's machine): they check certificates the federation's authority
signs (:mod:`mqtt_broker.authority`), so nothing here is copied to them.

Field gateways (:mod:`mqtt_broker.bridge`): a site's devices are made on the site broker, with the
central coordinator's public key (from the gateway's credentials); their public keys reach the central
registry from the site's ``signing_keys.json`` (public, not secret): ``flayer broker add-device SITE
--gateway-for DEV,... --device-keys SITE_KEYS.json`` on the central broker (:func:`import_device_keys`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mqtt_broker.bridge import read_gateway_settings
from mqtt_broker.config import BrokerConfigError
from mqtt_broker.fsutil import atomic_write
from protocol.signing import SignatureError, SigningKey, VerifyKey, parse_key_registry, render_key_registry
from transport.credentials import Credentials

__all__ = ["KEYS_FILE", "coordinator_signing_key", "import_device_keys", "read_key_registry", "registry_path", "set_device_key",
           "trusted_coordinator", "write_key_registry"]

log = logging.getLogger(__name__)
KEYS_FILE = "signing_keys.json"
MAX_REGISTRY_BYTES = 32 << 20


def registry_path(state_dir: Path) -> Path:
    return state_dir / KEYS_FILE


def read_key_registry(path: Path) -> tuple[VerifyKey | None, dict[str, VerifyKey]]:
    """(the coordinator's public key, device id -> public key); empty when the file does not exist.
    BrokerConfigError naming what is wrong for a malformed file."""
    if not path.exists():
        return None, {}
    try:
        if path.stat().st_size > MAX_REGISTRY_BYTES:
            raise BrokerConfigError(f"{path}: over {MAX_REGISTRY_BYTES} bytes")
        return parse_key_registry(path.read_text(), str(path))
    except (OSError, UnicodeDecodeError, SignatureError) as exc:
        raise BrokerConfigError(f"{path}: unreadable key registry ({exc})") from exc


def write_key_registry(path: Path, coord: VerifyKey | None, devices: dict[str, VerifyKey]) -> None:
    atomic_write(path, render_key_registry(coord, devices), mode=0o600)


def set_device_key(state_dir: Path, device: str, key: VerifyKey | None) -> None:
    """Record ``device``'s public key (None: remove it); the caller holds the state folder's lock."""
    path = registry_path(state_dir)
    coord, devices = read_key_registry(path)
    if key is None:
        if devices.pop(device, None) is None:
            return
        log.info("public key of %s removed from %s", device, path)
    else:
        devices[device] = key
    write_key_registry(path, coord, devices)


def import_device_keys(state_dir: Path, source: Path, devices: list[str]) -> list[str]:
    """Register the public keys ``source`` (another state folder's registry: a site's) holds for ``devices``;
    BrokerConfigError naming a device it has no key for. The caller holds the state folder's lock."""
    _, theirs = read_key_registry(source)
    if not source.exists():
        raise BrokerConfigError(f"{source}: no such key registry (the site's signing_keys.json)")
    missing = [d for d in devices if d not in theirs]
    if missing:
        raise BrokerConfigError(f"{source} holds no key for {', '.join(missing[:10])} (add the device on the site "
                                "first)")
    path = registry_path(state_dir)
    coord, devs = read_key_registry(path)
    devs.update({d: theirs[d] for d in devices})
    write_key_registry(path, coord, devs)
    log.info("public keys of %d gateway device(s) imported from %s", len(devices), source)
    return list(devices)


def coordinator_signing_key(credentials: Path, registry: Path) -> SigningKey:
    """The coordinator's signing key: the one its credentials file holds, else a new one (to be written there)."""
    if credentials.exists():
        creds = Credentials.load(credentials)
        if creds.signing_key:
            return SigningKey.from_text(creds.signing_key)
    if read_key_registry(registry)[0] is not None:
        log.warning("the coordinator's credentials hold no signing key: a new one replaces the registered one")
    return SigningKey.generate()


def trusted_coordinator(state_dir: Path, own: VerifyKey) -> VerifyKey:
    """The coordinator key a state folder's users believe: on a field gateway's site, the central coordinator's
    (from the gateway's credentials); elsewhere the folder's own coordinator's."""
    gateway = read_gateway_settings(state_dir)
    if gateway is not None and gateway[1].coordinator_key:
        return VerifyKey.from_text(gateway[1].coordinator_key)
    return own
