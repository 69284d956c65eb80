"""Passwords: random generation, Mosquitto-compatible hashing, and the ``passwd`` file.

Mosquitto 2.0 stores ``user:$7$<iterations>$<base64 salt>$<base64 PBKDF2-SHA512>``. New entries are
hashed with ``mosquitto_passwd -U`` on a private temporary file (the password never appears on a
command line); where mosquitto is not installed (embedded broker), the same format is computed
with hashlib. Both brokers verify with :func:`verify_password`-equivalent code.
Note: ``mosquitto_passwd -U`` re-hashes every line of the file it is given, already hashed ones
included, so it is only ever run on a file holding the new entry alone.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import subprocess
import tempfile
from pathlib import Path

from mqtt_broker.fsutil import atomic_write, find_executable

__all__ = [
    "PasswordError",
    "hash_password",
    "new_password",
    "read_passwd",
    "remove_passwd_entry",
    "set_passwd_entry",
    "verify_password",
]

log = logging.getLogger(__name__)

PBKDF2_ITERATIONS = 101  # mosquitto_passwd 2.0's default
SALT_BYTES = 12


class PasswordError(ValueError):
    """A password file or hash is malformed, or hashing failed."""


def new_password() -> str:
    """A random 192-bit password, URL-safe text (no ':' so it never breaks a passwd line)."""
    return secrets.token_urlsafe(24)


def _pbkdf2_hash(password: str, salt: bytes, iterations: int = PBKDF2_ITERATIONS) -> str:
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def hash_password(username: str, password: str, workdir: Path, use_mosquitto_passwd: bool = True) -> str:
    """The hash for a ``passwd`` line (without ``username:``); ``workdir`` must be private (0700)."""
    tool = find_executable("mosquitto_passwd") if use_mosquitto_passwd else None
    if tool is None:
        return _pbkdf2_hash(password, secrets.token_bytes(SALT_BYTES))
    fd, name = tempfile.mkstemp(prefix=".passwd-", dir=workdir)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{username}:{password}\n")
        proc = subprocess.run([tool, "-U", name], capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode != 0:
            raise PasswordError(f"mosquitto_passwd failed (exit {proc.returncode}): {proc.stderr.strip()[:300]}")
        line = Path(name).read_text().strip()
    finally:
        Path(name).unlink(missing_ok=True)
    user, _, hashed = line.partition(":")
    if user != username or not hashed.startswith("$"):
        raise PasswordError("mosquitto_passwd wrote an unexpected line")
    return hashed


def verify_password(password: str, hashed: str) -> bool:
    """Check a password against a Mosquitto ``$7$`` (PBKDF2-SHA512) or ``$6$`` (salted SHA-512) hash."""
    parts = hashed.split("$")
    try:
        if len(parts) == 5 and parts[1] == "7":
            iterations = int(parts[2])
            if not 1 <= iterations <= 10_000_000:
                return False
            salt, want = base64.b64decode(parts[3], validate=True), base64.b64decode(parts[4], validate=True)
            got = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
        elif len(parts) == 4 and parts[1] == "6":
            salt, want = base64.b64decode(parts[2], validate=True), base64.b64decode(parts[3], validate=True)
            got = hashlib.sha512(password.encode() + salt).digest()
        else:
            return False
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, want)


def read_passwd(path: Path) -> dict[str, str]:
    """``username -> hash`` from a passwd file; a malformed line is an error naming its number."""
    entries: dict[str, str] = {}
    if not path.exists():
        return entries
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, hashed = line.partition(":")
        if not sep or not user or not hashed.startswith("$"):
            raise PasswordError(f"{path}:{lineno}: expected 'user:$hash'")
        entries[user] = hashed
    return entries


def set_passwd_entry(path: Path, username: str, hashed: str) -> None:
    """Add or replace one user's hash, rewriting the file atomically with mode 0600."""
    entries = read_passwd(path)
    entries[username] = hashed
    atomic_write(path, "".join(f"{u}:{h}\n" for u, h in sorted(entries.items())))
    log.info("password entry for %s written to %s", username, path)


def remove_passwd_entry(path: Path, username: str) -> bool:
    """Remove one user's hash (file rewritten atomically, mode 0600); False when it was not there."""
    entries = read_passwd(path)
    if entries.pop(username, None) is None:
        return False
    atomic_write(path, "".join(f"{u}:{h}\n" for u, h in sorted(entries.items())))
    log.info("password entry for %s removed from %s", username, path)
    return True
