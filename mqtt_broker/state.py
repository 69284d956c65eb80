"""The broker's state folder: generated configuration, password file, ACL, TLS material and one
credentials file per user. Everything here is derived from ``broker.json`` plus the users'
passwords (kept only in their own 0600 credentials files).

Layout (default ``.flayer/broker``, mode 0700)::

    broker.json            BrokerConfig (no secrets)
    mosquitto.conf         generated
    acl                    generated from protocol.topics.acl_rules
    passwd                 username:hash (0600)
    models.htpasswd        who may fetch the model files over HTTP: the coordinator and the devices
                           (transport.models_auth; 0600)
    credentials/<user>.toml one per device, for the coordinator and the read-only observer (0600, holds
                           the password; a device's and the coordinator's also their Ed25519 signing key,
                           and every other user's the coordinator's public key)
    signing_keys.json      the public keys of the coordinator and every device (mqtt_broker.keys)
    authority.key, authority.pub, certs/, revocation_list.json
                           the federation's authority and what it signs (mqtt_broker.authority)
    tls/                   CA, server and client certificates (keys 0600), when TLS is on
    data/                  Mosquitto persistence
    broker.log             the broker's log (no secrets)
    run.json               PID, ports and command of the running broker
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from flayer.files import exclusive
from mqtt_broker.acl import render_acl
from mqtt_broker.authority import ensure_authority
from mqtt_broker.bridge import write_bridge_files
from mqtt_broker.config import BrokerConfig, BrokerConfigError
from mqtt_broker.crl import ensure_crl
from mqtt_broker.fsutil import atomic_write, free_port, private_dir
from mqtt_broker.gateway_list import gateway_acl, read_gateways, validate_gateway_devices, write_gateways
from mqtt_broker.keys import (
    coordinator_signing_key,
    import_device_keys,
    read_key_registry,
    registry_path,
    set_device_key,
    trusted_coordinator,
    write_key_registry,
)
from mqtt_broker.mosquitto_conf import render_mosquitto_conf
from mqtt_broker.passwords import hash_password, new_password, set_passwd_entry
from mqtt_broker.tls import client_cert_paths, ensure_ca_and_server, make_client_cert
from protocol.signing import SigningKey, VerifyKey
from protocol.topics import ADMIN_USER, OBSERVER_USER, TopicError, validate_id
from transport.credentials import Credentials, TlsSettings
from transport.models_auth import HTPASSWD_NAME, htpasswd_line

__all__ = [
    "BrokerFiles",
    "add_coordinator",
    "add_device",
    "add_gateway",
    "add_observer",
    "list_users",
    "load_credentials",
    "read_revoked",
    "resolve_ports",
    "save_credentials",
    "write_broker_files",
    "write_revoked",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BrokerFiles:
    """Paths of one state folder (absolute)."""

    state_dir: Path

    @classmethod
    def at(cls, state_dir: str | Path) -> BrokerFiles:
        path = Path(state_dir).expanduser().resolve()
        if any(c.isspace() for c in str(path)):
            raise BrokerConfigError(f"state folder {str(path)!r} contains white space, which mosquitto.conf cannot hold")
        return cls(path)

    config = property(lambda self: self.state_dir / "broker.json")
    mosquitto_conf = property(lambda self: self.state_dir / "mosquitto.conf")
    acl = property(lambda self: self.state_dir / "acl")
    passwd = property(lambda self: self.state_dir / "passwd")
    models_htpasswd = property(lambda self: self.state_dir / HTPASSWD_NAME)
    credentials_dir = property(lambda self: self.state_dir / "credentials")
    tls_dir = property(lambda self: self.state_dir / "tls")
    data_dir = property(lambda self: self.state_dir / "data")
    log = property(lambda self: self.state_dir / "broker.log")
    run_record = property(lambda self: self.state_dir / "run.json")
    revoked = property(lambda self: self.state_dir / "revoked.json")  # 'flayer broker revoke': id -> unix time
    lock = property(lambda self: self.state_dir / ".lock")

    def credentials(self, username: str) -> Path:
        return self.credentials_dir / f"{username}.toml"


@contextmanager
def _locked(files: BrokerFiles) -> Iterator[None]:
    """Serialise changes to one state folder across processes (e.g. devices added in parallel)."""
    private_dir(files.state_dir)
    with exclusive(files.lock):
        yield


def resolve_ports(cfg: BrokerConfig, old: BrokerConfig | None = None) -> BrokerConfig:
    """``cfg`` with its ports 0 resolved: ``old``'s stored ports where there are some, else ports free now
    (the TLS one never the plain one)."""
    port = cfg.port or (old.port if old and old.port else free_port(cfg.plain_host))
    tls_port = 0
    if cfg.tls:
        tls_port = cfg.tls_port or (old.tls_port if old and old.tls_port else 0)
        while not tls_port or tls_port == port:
            tls_port = free_port(cfg.tls_bind_host)
    return replace(cfg, port=port, tls_port=tls_port)


def write_broker_files(cfg: BrokerConfig, state_dir: str | Path) -> BrokerFiles:
    """Write (or bring up to date) every file of the state folder for ``cfg``; returns the paths.

    Ports 0 are resolved (reusing the ports already stored there), the coordinator's credentials are
    created on first use, and every existing credentials file is rewritten with the current host,
    ports, limits and TLS paths (passwords are kept). Changing the federation of a folder that
    already has users is refused: their credentials and topics belong to the old one."""
    files = BrokerFiles.at(state_dir)
    with _locked(files):
        old = BrokerConfig.load(files.config) if files.config.exists() else None
        users = list_users(files.state_dir) if old else []
        if old and users and (old.federation, old.coordinator_user) != (cfg.federation, cfg.coordinator_user):
            raise BrokerConfigError(
                f"{files.state_dir} already serves federation {old.federation!r} (coordinator user "
                f"{old.coordinator_user!r}) with {len(users)} user(s); use another state folder for {cfg.federation!r}")
        cfg = resolve_ports(cfg, old)
        private_dir(files.credentials_dir)
        if cfg.persistence:
            private_dir(files.data_dir)
        cfg.save(files.config)
        _write_acl(files, cfg, [u for u, r in users if r == "observer"])
        if not files.passwd.exists():
            atomic_write(files.passwd, "", mode=0o600)
        tls = None
        if cfg.tls:
            hosts = list(dict.fromkeys([cfg.tls_connect_host, cfg.tls_bind_host, cfg.host]))
            t = ensure_ca_and_server(files.tls_dir, cfg.federation, hosts)
            tls = (t.ca_cert, t.server_cert, t.server_key)
        crl = ensure_crl(files.tls_dir) if cfg.tls and cfg.require_certificate else None
        bridge = write_bridge_files(files.state_dir, cfg)  # a field gateway's bridge, when one is set up
        atomic_write(files.mosquitto_conf, render_mosquitto_conf(cfg, files.state_dir, files.passwd, files.acl, tls,
                                                                 include_dir=bridge, crl=crl), mode=0o600)
        coord = _coordinator_key(files, cfg)
        trusted = _trusted_coordinator(files, coord.public)
        behind = {d for ds in read_gateways(files.state_dir).values() for d in ds}  # their keys came from sites
        device_keys = {d: k for d, k in read_key_registry(registry_path(files.state_dir))[1].items() if d in behind}
        for user, role in list_users(files.state_dir):
            creds = Credentials.load(files.credentials(user))
            key = coord if role == "coordinator" else SigningKey.from_text(creds.signing_key) \
                if creds.signing_key else SigningKey.generate() if role == "device" else None
            if role == "device" and key is not None:
                device_keys[user] = key.public
            _write_credentials(files, cfg, user, role, creds.password, key, trusted)
        write_key_registry(registry_path(files.state_dir), coord.public, device_keys)
        if not files.credentials(cfg.coordinator_user).exists():
            _add_user(files, cfg, cfg.coordinator_user, "coordinator", coord)
        if not files.credentials(OBSERVER_USER).exists():
            _add_user(files, cfg, OBSERVER_USER, "observer", coord)
        ensure_authority(files.state_dir)  # a folder made before the authority existed gets one now (logged)
        if not files.credentials(ADMIN_USER).exists():  # publishes the authority's revocation list
            _add_user(files, cfg, ADMIN_USER, "admin", coord)
        write_models_htpasswd(files)
    log.info("broker files for federation %s written to %s", cfg.federation, files.state_dir)
    return files


def _write_acl(files: BrokerFiles, cfg: BrokerConfig, observers: list[str]) -> None:
    """The ACL file, with a block for the default observer and every other observer user, and one per
    gateway user (:mod:`mqtt_broker.bridge`)."""
    names = sorted({OBSERVER_USER, *observers})
    text = render_acl(cfg.federation, cfg.coordinator_user, names)
    text += gateway_acl(cfg.federation, read_gateways(files.state_dir))
    atomic_write(files.acl, text, mode=0o600)


def save_credentials(creds: Credentials, path: Path) -> None:
    """Write ``creds`` as its 0600 TOML file (atomically: a secret is never half-written)."""
    atomic_write(path, creds.to_toml(), mode=0o600)


def _coordinator_key(files: BrokerFiles, cfg: BrokerConfig) -> SigningKey:
    return coordinator_signing_key(files.credentials(cfg.coordinator_user), registry_path(files.state_dir))


def _trusted_coordinator(files: BrokerFiles, own: VerifyKey) -> VerifyKey:
    return trusted_coordinator(files.state_dir, own)


def _write_credentials(files: BrokerFiles, cfg: BrokerConfig, user: str, role: str, password: str,
                       signer: SigningKey | None, coordinator: VerifyKey) -> Credentials:
    """``user``'s credentials file, with its own signing ``key`` (devices, the coordinator) and the
    ``coordinator``'s public key (every other user): ``signer`` is the user's own signing key."""
    tls = None
    if cfg.tls:
        cert, key = client_cert_paths(files.tls_dir, user)
        if not (cert.exists() and key.exists()):
            cert, key = make_client_cert(files.tls_dir, user)
        tls = TlsSettings(cfg.tls_connect_host, cfg.tls_port, files.tls_dir / "ca.crt", cert, key)
    creds = Credentials(cfg.federation, role, user, password, cfg.connect_host, cfg.port, cfg.max_packet_size, tls,
                        signing_key=signer.private_text() if signer is not None else "",
                        coordinator_key="" if role == "coordinator" else coordinator.text,
                        registry=registry_path(files.state_dir))  # as Credentials.load finds it from the file
    save_credentials(creds, files.credentials(user))
    return creds


def _add_user(files: BrokerFiles, cfg: BrokerConfig, user: str, role: str,
              coord: SigningKey | None = None) -> Credentials:
    """A new password (and client certificate); a device gets a new key pair, registered at once."""
    password = new_password()
    set_passwd_entry(files.passwd, user, hash_password(user, password, files.state_dir))
    if cfg.tls:
        make_client_cert(files.tls_dir, user)
    coord = coord or _coordinator_key(files, cfg)
    key = coord if role == "coordinator" else SigningKey.generate() if role == "device" else None
    if role == "device" and key is not None:
        set_device_key(files.state_dir, user, key.public)
    elif role == "coordinator":
        _, devices = read_key_registry(registry_path(files.state_dir))
        write_key_registry(registry_path(files.state_dir), coord.public, devices)
    creds = _write_credentials(files, cfg, user, role, password, key,
                               coord.public if role == "coordinator" else _trusted_coordinator(files, coord.public))
    log.info("credentials of %s %s written to %s", role, user, files.credentials(user))
    return creds


def _add(state_dir: str | Path, user: str, role: str, rotate: bool, exist_ok: bool) -> Credentials:
    files = BrokerFiles.at(state_dir)
    cfg = BrokerConfig.load(files.config)
    try:
        validate_id(user, f"{role} id")
    except TopicError as exc:
        raise BrokerConfigError(str(exc)) from exc
    if role == "device" and user == cfg.coordinator_user:
        raise BrokerConfigError(f"{user!r} is the coordinator's user name; a device cannot use it")
    if role == "device" and user == OBSERVER_USER:
        raise BrokerConfigError(f"{user!r} is the read-only observer's user name; a device cannot use it")
    if role != "admin" and user == ADMIN_USER:
        raise BrokerConfigError(f"{user!r} is the admin's user name (it publishes the revocation list); a {role} "
                                "cannot use it")
    with _locked(files):
        path = files.credentials(user)
        if path.exists() and not rotate:
            existing = Credentials.load(path)
            if existing.role != role:
                raise BrokerConfigError(f"{user!r} already exists as a {existing.role}")
            if exist_ok:
                return existing
            raise BrokerConfigError(f"{role} {user!r} already exists ({path}); pass rotate=True (--rotate) "
                                    "for a new password")
        creds = _add_user(files, cfg, user, role)
        if role in ("coordinator", "device"):
            set_models_htpasswd_entry(files, user, creds.password)
        revoked = read_revoked(files)
        if revoked.pop(user, None) is not None:  # a new kit for a revoked device lets it back in
            write_revoked(files, revoked)
            log.info("%s is no longer revoked", user)
        return creds


def write_models_htpasswd(files: BrokerFiles) -> Path:
    """Who may fetch the model files over HTTP (:mod:`transport.models_auth`): the coordinator and every
    device with a credentials file here, observers not; rewritten whenever a user is added or revoked."""
    lines = [htpasswd_line(user, Credentials.load(files.credentials(user)).password)
             for user, role in list_users(files.state_dir) if role in ("coordinator", "device")]
    atomic_write(files.models_htpasswd, "".join(line + "\n" for line in lines), mode=0o600)
    return files.models_htpasswd


def set_models_htpasswd_entry(files: BrokerFiles, user: str, password: str | None) -> None:
    """Add, replace (``password``) or remove (None) one user's line of ``models.htpasswd``."""
    try:
        lines = files.models_htpasswd.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    kept = [line for line in lines if line.split(":", 1)[0] != user]
    if password is not None:
        kept.append(htpasswd_line(user, password))
    atomic_write(files.models_htpasswd, "".join(line + "\n" for line in kept), mode=0o600)


def read_revoked(files: BrokerFiles) -> dict[str, float]:
    """The revoked devices (id -> unix time of the revocation); empty when none was revoked."""
    if not files.revoked.exists():
        return {}
    try:
        data = json.loads(files.revoked.read_text())
    except (OSError, ValueError) as exc:
        raise BrokerConfigError(f"{files.revoked}: unreadable ({exc})") from exc
    if not isinstance(data, dict):
        raise BrokerConfigError(f"{files.revoked}: expected a JSON object of device ids")
    return data


def write_revoked(files: BrokerFiles, revoked: dict[str, float]) -> None:
    atomic_write(files.revoked, json.dumps(revoked, indent=1, sort_keys=True) + "\n", mode=0o600)


def add_device(state_dir: str | Path, device_id: str, rotate: bool = False, exist_ok: bool = False) -> Credentials:
    """Create a device's password (and client certificate when TLS is on) and its 0600 credentials
    file. A running Mosquitto reads the new password only after a reload (:func:`reload_broker`)."""
    return _add(state_dir, device_id, "device", rotate, exist_ok)


def add_coordinator(state_dir: str | Path, rotate: bool = False) -> Credentials:
    """The coordinator's credentials (created by :func:`write_broker_files`; ``rotate`` renews them)."""
    cfg = BrokerConfig.load(BrokerFiles.at(state_dir).config)
    return _add(state_dir, cfg.coordinator_user, "coordinator", rotate, exist_ok=True)


def add_observer(state_dir: str | Path, name: str = OBSERVER_USER, rotate: bool = False) -> Credentials:
    """A read-only observer's credentials (``flayer status``, ``flayer dashboard``); the default one,
    ``observer``, is created by :func:`write_broker_files`. The broker allows one connection per user, so
    each watcher running at the same time needs its own observer. The ACL (rewritten here; a running
    Mosquitto reads it after a reload) lets observers read the round plan, statuses and metrics, and
    publish nothing. ``rotate`` renews the password."""
    files = BrokerFiles.at(state_dir)
    cfg = BrokerConfig.load(files.config)
    if name == cfg.coordinator_user:
        raise BrokerConfigError(f"{name!r} is the coordinator's user name; an observer cannot use it")
    creds = _add(state_dir, name, "observer", rotate, exist_ok=True)
    with _locked(files):
        _write_acl(files, cfg, [u for u, r in list_users(files.state_dir) if r == "observer"])
    return creds


def load_credentials(state_dir: str | Path, username: str) -> Credentials:
    return Credentials.load(BrokerFiles.at(state_dir).credentials(username))


def list_users(state_dir: str | Path) -> list[tuple[str, str]]:
    """(username, role) of every credentials file, sorted by name."""
    folder = BrokerFiles.at(state_dir).credentials_dir
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.toml")):
        creds = Credentials.load(path)
        if creds.username != path.stem:
            raise BrokerConfigError(f"{path}: holds user {creds.username!r}, not {path.stem!r}")
        out.append((creds.username, creds.role))
    return out


def add_gateway(state_dir: str | Path, name: str, devices: Iterable[str], rotate: bool = False,
                device_keys: Path | None = None) -> Credentials:
    """On the central broker: the gateway user ``name`` (its 0600 credentials file, role ``gateway``)
    serving exactly ``devices``. Run again for an existing gateway, it replaces the list (the password
    stays unless ``rotate``). A running Mosquitto applies the new ACL after a reload. ``device_keys``: the
    site's ``signing_keys.json``, whose public keys of these devices the coordinator then believes
    (:func:`mqtt_broker.keys.import_device_keys`)."""
    files = BrokerFiles.at(state_dir)
    cfg = BrokerConfig.load(files.config)
    try:
        validate_id(name, "gateway id")
    except TopicError as exc:
        raise BrokerConfigError(str(exc)) from exc
    if name in (cfg.coordinator_user, OBSERVER_USER):
        raise BrokerConfigError(f"{name!r} is a reserved user name; a gateway cannot use it")
    wanted = list(devices)

    def check() -> list[str]:
        users = dict(list_users(files.state_dir))
        gateways = read_gateways(files.state_dir)
        if name in users and users[name] != "gateway":
            raise BrokerConfigError(f"{name!r} already exists as a {users[name]}")
        if any(name in ds for ds in gateways.values()):
            raise BrokerConfigError(f"{name!r} is a device behind a gateway; a gateway cannot take its name")
        return validate_gateway_devices(name, wanted, users, gateways, cfg.coordinator_user)

    with _locked(files):
        check()
    creds = _add(files.state_dir, name, "gateway", rotate, exist_ok=True)
    with _locked(files):
        served = check()
        if device_keys is not None:  # first: a registry without these devices' keys changes nothing
            import_device_keys(files.state_dir, device_keys, served)
        gateways = read_gateways(files.state_dir)
        gateways[name] = served
        write_gateways(files.state_dir, gateways)
        _write_acl(files, cfg, [u for u, r in list_users(files.state_dir) if r == "observer"])
    return creds
