"""A device's startup kit, as the device reads it: check every member, then unpack it.

Layout (written by ``flayer broker add-device ID --kit KIT.tar.gz``, see ``mqtt_broker.kit``):
``credentials.toml``, ``device.toml``, ``START``, the device's certificate ``device.cert``, the federation
authority's public key ``authority.pub``, its signed revocation list ``revocations.json`` and, with TLS,
``tls/ca.crt``, ``tls/client.crt``, ``tls/client.key`` (a kit of an earlier release: ``signing_keys.json`` instead of
the certificate). Nothing else is accepted: no other name, no link, no folder outside.

Restarting from a new kit of the same device (``flayer broker rekey ID --kit``: a new key, a new certificate) in
the folder of its old kit keeps the device's state and its ``device.toml``; the kit's other files are replaced.
A kit of another device (another federation or id) is refused there.

A kit comes from elsewhere, so the code its ``device.toml`` names is not run on the kit's word: a ``[data] entry``
(a python data source) or ``[edge] allow_entry_points`` (model code a plan may name) is refused unless the
device's owner allows it when starting the device -- ``flayer edge --kit KIT --allow-kit-code`` for all of it, or
``--allow-entry-point ENTRY`` for each model entry point (:func:`kit_code`). The kit's own ``device.toml`` is what
counts (the member, not the unpacked copy the owner may edit afterwards: those edits are the owner's).
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterable
from pathlib import Path

from transport.credentials import Credentials, CredentialsError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["KIT_AUTHORITY", "KIT_CERT", "KIT_FILES", "KIT_REGISTRY", "KIT_REVOCATIONS", "KIT_TLS_FILES", "MAX_KIT_MEMBER", "KitError", "kit_code", "kit_folder",
           "unpack_kit"]

KIT_FILES = ("credentials.toml", "device.toml", "START")
KIT_TLS_FILES = ("tls/ca.crt", "tls/client.crt", "tls/client.key")
KIT_REGISTRY = "signing_keys.json"  # an earlier release's kits: the federation's public keys when the kit was made
KIT_CERT = "device.cert"  # the device's certificate (protocol.certs), signed by the federation's authority
KIT_AUTHORITY = "authority.pub"  # the authority's public key: pinned
KIT_REVOCATIONS = "revocations.json"  # the authority's signed revocation list when the kit was made
KIT_OPTIONAL = (KIT_REGISTRY, KIT_CERT, KIT_AUTHORITY, KIT_REVOCATIONS)
MAX_KIT_MEMBER = 1 << 20  # a kit holds small text files


class KitError(CredentialsError):
    """A kit is unreadable, incomplete or holds something it should not."""


def kit_folder(kit: Path) -> Path:
    """Where ``kit`` unpacks: a folder beside it named after it (``dev-7.tar.gz`` -> ``dev-7``)."""
    name = kit.name
    for suffix in (".tar.gz", ".tgz"):
        if name.endswith(suffix):
            return kit.with_name(name[: -len(suffix)])
    return kit.with_name(name + ".d")


def _read(kit: Path) -> dict[str, bytes]:
    if not kit.is_file():
        raise KitError(f"kit {kit}: not found")
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(kit, "r:gz") as tar:
            for info in tar.getmembers():
                if info.name not in KIT_FILES + KIT_TLS_FILES + KIT_OPTIONAL or not info.isfile():
                    raise KitError(f"kit {kit}: unexpected member {info.name!r} (a kit holds only "
                                   f"{', '.join(KIT_FILES + KIT_TLS_FILES)})")
                if info.size > MAX_KIT_MEMBER or info.name in members:
                    raise KitError(f"kit {kit}: member {info.name!r} is too large or repeated")
                fh = tar.extractfile(info)
                assert fh is not None
                members[info.name] = fh.read()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise KitError(f"kit {kit}: not a readable .tar.gz ({exc})") from None
    missing = [n for n in KIT_FILES if n not in members]
    if b"[tls]" in members.get("credentials.toml", b""):
        missing += [n for n in KIT_TLS_FILES if n not in members]
    if missing:
        raise KitError(f"kit {kit}: missing {', '.join(missing)}; ask for a new kit "
                       f"('flayer broker add-device ID --rotate --kit FILE' on the broker's machine)")
    return members


def kit_code(device_toml: bytes) -> list[tuple[str, str]]:
    """The code a kit's ``device.toml`` names, as (what, value) pairs: ``("data entry", "pkg.mod:fn")`` for a
    python data source, ``("entry point", "pkg.mod:fn")`` for each model entry point it allows."""
    try:
        raw = tomllib.loads(device_toml.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KitError(f"the kit's device.toml is not readable TOML ({exc})") from None
    data, edge = raw.get("data", {}), raw.get("edge", {})
    if not isinstance(data, dict) or not isinstance(edge, dict):
        raise KitError("the kit's device.toml: [data] and [edge] must be tables")
    code: list[tuple[str, str]] = []
    if "entry" in data or data.get("source") == "python":
        code.append(("data entry", str(data.get("entry", ""))))
    allowed = edge.get("allow_entry_points", [])
    if not isinstance(allowed, list):
        raise KitError(f"the kit's device.toml: [edge] allow_entry_points must be a list, got {allowed!r}")
    code += [("entry point", str(e)) for e in allowed]
    return code


def _check_code(kit: Path, device_toml: bytes, allow_code: bool, allowed_entry_points: Iterable[str]) -> None:
    owner = set(allowed_entry_points)
    refused = [(what, v) for what, v in kit_code(device_toml) if not allow_code
               and not (what == "entry point" and v in owner)]
    if refused:
        named = ", ".join(f"{what} {v!r}" for what, v in refused)
        raise KitError(f"kit {kit} names code this device would run: {named}; nothing was unpacked or imported. If you "
                       f"trust it, start the device with --allow-kit-code (or --allow-entry-point ENTRY for each "
                       f"entry point)")


def _identity(text: bytes, where: str) -> tuple[str, str]:
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KitError(f"{where}: unreadable credentials ({exc})") from None
    fed, user = data.get("federation"), data.get("username")
    if not isinstance(fed, str) or not isinstance(user, str):
        raise KitError(f"{where}: credentials name no federation or username")
    return fed, user


def _renew(kit: Path, dest: Path, members: dict[str, bytes]) -> None:
    """Replace the kit files in ``dest`` by ``members`` when both kits are of one device (its ``device.toml`` and
    its state stay); KitError naming both devices otherwise."""
    old = _identity((dest / "credentials.toml").read_bytes(), str(dest / "credentials.toml"))
    new = _identity(members["credentials.toml"], f"kit {kit}")
    if old != new:
        raise KitError(f"{dest} holds another device's kit ({old[1]} of federation {old[0]}, not {new[1]} of "
                       f"{new[0]}); unpack {kit} elsewhere")
    for name, data in members.items():
        if name == "device.toml":  # the owner's (completed, perhaps edited): kept
            continue
        path = dest / name
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(f".{path.name}.new")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    for name in KIT_OPTIONAL:  # a member the new kit no longer carries (an earlier release's key registry copy)
        if name not in members:
            (dest / name).unlink(missing_ok=True)
    try:
        Credentials.load(dest / "credentials.toml")
    except CredentialsError as exc:
        raise KitError(f"kit {kit}: {exc}") from None


def unpack_kit(kit: str | Path, folder: str | Path | None = None, *, allow_code: bool = False,
               allowed_entry_points: Iterable[str] = ()) -> Path:
    """Check ``kit`` completely, unpack it into ``folder`` (default :func:`kit_folder`; 0700, files 0600)
    and return the path of its ``device.toml``. A folder that already holds this kit's device (a
    restart) is reused as it is: the device's edits and state stay. Code the kit's ``device.toml`` names is
    refused unless ``allow_code``, or, for a model entry point, it is in ``allowed_entry_points`` (module
    docstring): checked on every start, the kit being read again."""
    kit = Path(kit)
    members = _read(kit)
    _check_code(kit, members["device.toml"], allow_code, allowed_entry_points)
    dest = Path(folder) if folder is not None else kit_folder(kit)
    if dest.exists():
        st = dest.lstat()
        opened = stat.S_IMODE(st.st_mode) & 0o077 and any(dest.iterdir())  # an empty one of its own is closed below
        if not dest.is_dir() or dest.is_symlink() or st.st_uid != os.geteuid() or opened:
            raise KitError(f"{dest} exists and is not a private folder of this user (owner uid {st.st_uid}, mode "
                           f"{stat.S_IMODE(st.st_mode):04o}): whoever can change it could change the kit's "
                           f"device.toml; unpack {kit} elsewhere")
    if (dest / "credentials.toml").exists():
        if (dest / "credentials.toml").read_bytes() != members["credentials.toml"]:
            _renew(kit, dest, members)  # the same device's new kit (re-keyed): KitError for another device's
        # a restart: the device.toml that will be loaded is the one checked (edited since, or not)
        _check_code(kit, (dest / "device.toml").read_bytes(), allow_code, allowed_entry_points)
        return dest / "device.toml"
    if dest.exists() and any(dest.iterdir()):
        raise KitError(f"{dest} exists and is not empty; unpack {kit} elsewhere")
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o700)
    for name, data in members.items():
        path = dest / name
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    try:
        Credentials.load(dest / "credentials.toml")
    except CredentialsError as exc:
        raise KitError(f"kit {kit}: {exc}") from None
    return dest / "device.toml"
