"""Startup kits and revocation: what a device needs to join from another machine, and shutting it out.

A kit is a gzip'd tar (mode 0600) holding, with paths relative to the folder it is unpacked in::

    credentials.toml     the device's password, its Ed25519 signing key and the coordinator's public key
                         (and TLS paths below, relative to this file)
    tls/ca.crt           the federation CA (TLS only)
    tls/client.crt       the device's client certificate and key (TLS only)
    tls/client.key
    device.cert          the device's certificate: the federation's authority vouches for its signing key
                         (mqtt_broker.authority; the device carries it in each of its secure-round key adverts)
    authority.pub        the authority's public key, pinned: the device believes another device's key only through
                         a certificate this key signed and the revocation list does not name
    revocations.json     the authority's signed revocation list when the kit was made (newer ones arrive over MQTT)
    device.toml          to complete: [data] (or pass --data), [edge]
    START                the one-line start command

and nothing else (a kit made by an earlier release may also hold ``signing_keys.json``, a copy of the public
keys, which a device without a certificate falls back on). ``flayer edge --kit KIT.tar.gz --data FOLDER`` unpacks it (checked first: no other
member, no link, no path outside) into a folder beside it and runs from there.

The kit's ``device.toml`` names the model code the device accepts: ``[edge] allow_entry_points``, the
entry points given to :func:`write_kit` (``flayer broker add-device ID --kit KIT --allow-entry-point
ENTRY``: the federation's own model), empty otherwise (the built-in models only). ``python_path`` only
says where an allowed module is found (the kit's folder and the one it sits in); a plan naming any other
entry point is refused on the device (docs/explanation/security.md).

A device added, re-keyed or revoked later needs no file copied to any other device: its certificate (or the new
revocation list) reaches them over MQTT. Writing the kit certifies the device's current key (a re-keyed device's
new certificate has a higher serial, and the old one is on the revocation list).

Revocation (:func:`revoke_device`) puts the device's certificate on the authority's revocation list, removes the device's password entry, credentials file, client
certificate and public signing key (:mod:`mqtt_broker.keys`: the coordinator refuses what it signs), regenerates the ACL, and records the device in ``revoked.json`` (which the coordinator
reads: it stops selecting the device and drops what it sends); its client certificate goes on the CA's
revocation list first (:mod:`mqtt_broker.crl`: the kit's copy then fails the TLS handshake). The caller
reloads the broker (Mosquitto: SIGHUP), which also closes the device's live connection, its password being
gone; with ``--identity-as-username`` no password is asked and :mod:`mqtt_broker.evict` closes it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

from mqtt_broker.authority import (
    AUTHORITY_PUB,
    REVOCATION_LIST,
    certify,
    current_cert,
    read_revocations,
    revoke_serial,
)
from mqtt_broker.bridge import drop_gateway_device
from mqtt_broker.config import BrokerConfig, BrokerConfigError
from mqtt_broker.crl import revoke_certificate
from mqtt_broker.keys import set_device_key
from mqtt_broker.passwords import remove_passwd_entry
from mqtt_broker.state import (
    BrokerFiles,
    _locked,
    _write_acl,
    list_users,
    read_revoked,
    set_models_htpasswd_entry,
    write_revoked,
)
from mqtt_broker.tls import client_cert_paths
from protocol.topics import TopicError, validate_id
from transport.credentials import Credentials, TlsSettings

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from transport.kit import KIT_AUTHORITY, KIT_CERT, KIT_REVOCATIONS, KIT_TLS_FILES

__all__ = ["kit_identity", "revoke_device", "write_kit"]

log = logging.getLogger(__name__)


def _device_toml(creds: Credentials, allow_entry_points: Sequence[str]) -> str:
    allow = ", ".join(json.dumps(e) for e in allow_entry_points)  # a JSON string is a TOML basic string
    return f"""# Device {creds.username} of federation {creds.federation}: complete [data], then run the command in START.
credentials = "credentials.toml"
python_path = [".", ".."]    # folders searched for the federation's model module: this one and the kit's

[data]
source = "folder"            # folder | arrays | python (see the documentation: how-to, own data)
path = "data"                # your images: data/<class name>/*.png (or pass --data FOLDER)
resize = false               # true: resize images to the model's input instead of refusing them
val_fraction = 0.1
test_fraction = 0.2
seed = 0

[edge]
state_dir = "state"          # personal state and final models
device = "auto"
allow_entry_points = [{allow}]   # model code a plan may name besides the built-ins ("package.module:function")
"""


def kit_identity(path: Path) -> tuple[str, str] | None:
    """(federation, device) of the kit at ``path``; None when it is not a readable kit."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            fh = tar.extractfile("credentials.toml")
            if fh is None:
                return None
            creds = Credentials._from_dict(tomllib.loads(fh.read(1 << 20).decode()), path.parent)
    except (tarfile.TarError, OSError, KeyError, ValueError, EOFError):
        return None
    return creds.federation, creds.username


def write_kit(state_dir: str | Path, device_id: str, out: str | Path, allow_entry_points: Sequence[str] = (),
              replace: bool = False) -> Path:
    """Write ``device_id``'s kit to ``out`` (0600). An existing ``out`` is refused, unless ``replace`` and it is a
    kit of the same device (a re-keyed device's new kit takes the old one's place). The device must exist.
    ``allow_entry_points``: the model entry points its ``device.toml`` accepts besides the built-ins
    (written as TOML strings; the device's loader checks that each is ``"package.module:function"``)."""
    files = BrokerFiles.at(state_dir)
    creds = Credentials.load(files.credentials(device_id))
    if creds.role != "device":
        raise BrokerConfigError(f"{device_id!r} is a {creds.role}, not a device: no kit")
    out = Path(out)
    if out.exists() and not (replace and kit_identity(out) == (creds.federation, device_id)):
        same = " (not a kit of this device, so it is not replaced)" if replace else ""
        raise BrokerConfigError(f"{out} already exists{same}; remove it or name another kit file")
    members: dict[str, bytes] = {}
    tls = None
    if creds.tls is not None:
        if creds.tls.cert_file is None or creds.tls.key_file is None:
            raise BrokerConfigError(f"credentials of {device_id} have no client certificate")
        for name, src in zip(KIT_TLS_FILES, (creds.tls.ca_file, creds.tls.cert_file, creds.tls.key_file)):
            members[name] = Path(src).read_bytes()
        tls = TlsSettings(creds.tls.host, creds.tls.port, Path(KIT_TLS_FILES[0]), Path(KIT_TLS_FILES[1]),
                          Path(KIT_TLS_FILES[2]))
    kit_creds = Credentials(creds.federation, creds.role, creds.username, creds.password, creds.host, creds.port,
                            creds.max_packet_size, tls, creds.failover, creds.signing_key, creds.coordinator_key)
    members["credentials.toml"] = kit_creds.to_toml().encode()
    with _locked(files):  # the authority certifies the device's current key (a new serial after a re-key)
        cert = certify(files.state_dir, creds.federation, device_id, creds.signer().public)
    members[KIT_CERT] = (cert.to_text() + "\n").encode()
    members[KIT_AUTHORITY] = (files.state_dir / AUTHORITY_PUB).read_bytes()
    if (files.state_dir / REVOCATION_LIST).is_file():
        members[KIT_REVOCATIONS] = (files.state_dir / REVOCATION_LIST).read_bytes()
    members["device.toml"] = _device_toml(creds, list(dict.fromkeys(allow_entry_points))).encode()
    allow = "".join(f" --allow-entry-point {e}" for e in dict.fromkeys(allow_entry_points))  # the owner's consent
    members["START"] = f"flayer edge --kit {out.name} --data ./data{allow}\n".encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # complete before it takes the name (or replaces a kit)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh, tarfile.open(fileobj=fh, mode="w:gz") as tar:
            now = int(time.time())
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o600, now
                tar.addfile(info, io.BytesIO(data))
        if replace:
            os.replace(tmp, out)
        else:
            os.link(tmp, out)  # fails if out appeared meanwhile: never overwritten
            tmp.unlink()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.chmod(out, 0o600)
    log.info("kit of %s written to %s", device_id, out)
    return out


def revoke_device(state_dir: str | Path, device_id: str) -> bool:
    """Shut ``device_id`` out of the broker's files (see the module doc); False if already revoked.
    The caller reloads the running broker."""
    try:
        validate_id(device_id, "device id")
    except TopicError as exc:
        raise BrokerConfigError(str(exc)) from exc
    files = BrokerFiles.at(state_dir)
    cfg = BrokerConfig.load(files.config)
    if device_id == cfg.coordinator_user:
        raise BrokerConfigError(f"{device_id!r} is the coordinator, not a device")
    with _locked(files):
        revoked = read_revoked(files)
        path = files.credentials(device_id)
        behind = drop_gateway_device(files.state_dir, device_id)  # a device of a field gateway's site
        if not path.exists() and device_id not in revoked and behind is None:
            raise BrokerConfigError(f"no device {device_id!r} in {files.state_dir} (see 'flayer broker status')")
        if path.exists() and Credentials.load(path).role != "device":
            raise BrokerConfigError(f"{device_id!r} is not a device")
        removed = remove_passwd_entry(files.passwd, device_id)
        certified = current_cert(files.state_dir, cfg.federation, device_id)
        listed = read_revocations(files.state_dir, cfg.federation)
        if certified is not None and not (listed and listed.revokes(device_id, certified.serial)):
            # on the authority's signed list: the devices refuse this certificate once the list arrives
            revoke_serial(files.state_dir, cfg.federation, device_id, certified.serial)
        set_device_key(files.state_dir, device_id, None)  # what its key signs is refused from now on
        path.unlink(missing_ok=True)
        cert, _ = client_cert_paths(files.tls_dir, device_id)
        if cert.exists():  # on the CA's revocation list before the broker's copy goes: its kit's copy is refused
            revoke_certificate(files.tls_dir, cert)
        for f in client_cert_paths(files.tls_dir, device_id):
            f.unlink(missing_ok=True)
        _write_acl(files, cfg, [u for u, r in list_users(files.state_dir) if r == "observer"])
        set_models_htpasswd_entry(files, device_id, None)  # nginx reads it on every request: no model from now on
        first = device_id not in revoked
        revoked.setdefault(device_id, time.time())
        write_revoked(files, revoked)
    log.info("revoked %s (password entry %s)", device_id, "removed" if removed else "already gone")
    return first
