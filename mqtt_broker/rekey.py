"""Re-keying a device or the coordinator (``flayer broker rekey``): a new Ed25519 key pair, the old one refused.

A re-keyed device gets a new certificate from the federation's authority, with a higher serial, and its old
certificate goes on the signed revocation list (:mod:`mqtt_broker.authority`), which the CLI then publishes
(:mod:`mqtt_broker.publish_list`): the other devices learn the new key from the device's certificate when it
reconnects with its new kit, and refuse the old one from the list; no file is copied to them. The registry of
public keys (what the coordinator reads on the broker's machine) and what each credentials file holds:
:mod:`mqtt_broker.keys`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mqtt_broker.authority import certify
from mqtt_broker.config import BrokerConfig, BrokerConfigError
from mqtt_broker.keys import read_key_registry, registry_path, write_key_registry
from mqtt_broker.state import BrokerFiles, _locked, _write_credentials, list_users
from protocol.signing import SigningKey, VerifyKey
from transport.credentials import Credentials

__all__ = ["recertify", "rekey"]

log = logging.getLogger(__name__)


def rekey(state_dir: str | Path, user: str) -> Credentials:
    """A new Ed25519 key pair for a device or the coordinator; the old public key leaves the registry, so
    what the old key signs is refused from then on. Re-keying the coordinator rewrites every credentials file
    with its new public key (devices need new kits). The password stays."""
    files = BrokerFiles.at(state_dir)
    cfg = BrokerConfig.load(files.config)
    with _locked(files):
        path = files.credentials(user)
        if not path.exists():
            raise BrokerConfigError(f"no user {user!r} in {files.state_dir} (see 'flayer broker status')")
        creds = Credentials.load(path)
        if creds.role not in ("device", "coordinator"):
            raise BrokerConfigError(f"{user!r} is a {creds.role}: only devices and the coordinator sign")
        key = SigningKey.generate()
        reg = registry_path(files.state_dir)
        coord, devices = read_key_registry(reg)
        if creds.role == "device":
            coord = VerifyKey.from_text(creds.coordinator_key) if creds.coordinator_key else coord
            assert coord is not None, "a device's credentials carry the coordinator's key"
            devices[user] = key.public
            write_key_registry(reg, coord, devices)
            out = _write_credentials(files, cfg, user, "device", creds.password, key, coord)
            certify(files.state_dir, cfg.federation, user, key.public)  # a higher serial; the old one is listed
        else:
            write_key_registry(reg, key.public, devices)
            out = _write_credentials(files, cfg, user, "coordinator", creds.password, key, key.public)
            for other, role in list_users(files.state_dir):
                if other != user:
                    c = Credentials.load(files.credentials(other))
                    _write_credentials(files, cfg, other, role, c.password,
                                       SigningKey.from_text(c.signing_key) if c.signing_key else None, key.public)
    log.info("new signing key for %s %s; its old key is refused from now on", creds.role, user)
    return out


def recertify(state_dir: str | Path, device: str) -> None:
    """Certify ``device``'s current key (after ``add-device --rotate``): its previous certificate is listed."""
    files = BrokerFiles.at(state_dir)
    cfg = BrokerConfig.load(files.config)
    with _locked(files):
        creds = Credentials.load(files.credentials(device))
        if creds.role == "device" and creds.signing_key:
            certify(files.state_dir, cfg.federation, device, SigningKey.from_text(creds.signing_key).public)
