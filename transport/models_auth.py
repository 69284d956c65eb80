"""Who may fetch the federation's model files over HTTP (docs/howto/http-models.md, "Who may fetch").

nginx serves ``[federation] models_dir`` to the federation's devices and its coordinator only, by HTTP
basic authentication against ``models.htpasswd`` in the broker's state folder (nginx reads the file on
every request, so a device added or revoked counts at once). The secret a user presents is not its broker
password but a token derived from it (:func:`models_token`: HMAC-SHA256 keyed with the password), so the
HTTP side never sees a secret that opens the broker; the device derives it from the credentials its kit
already carries, the state folder from the same credentials files. Observers are not in the file: they
read plans, statuses and metrics on the broker and no model, over MQTT or HTTP.

Where a device sends its token (:func:`token_destination_problem`): the plan names ``models_url``, but the token is
the device's, so it goes only where the device's own configuration says the federation's model server is -- the
broker's host in its credentials, or a host listed in its ``[edge] models_hosts`` -- and over HTTPS, or plain HTTP
to a loopback address, or to any of those hosts when ``[edge] models_plain_http`` says so. A plan naming another
host (or plain HTTP across a network) gets no token: the device takes the broker's chunks instead.

The file holds ``{SSHA}`` hashes (salted SHA-1, a form nginx reads without modules). The tokens are
256-bit HMAC outputs of 192-bit random passwords, so the fast hash is not what protects them: guessing
one is 2^192 work whatever the hash.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Iterable
from urllib.parse import urlsplit

from transport.hosts import is_loopback

__all__ = ["HTPASSWD_NAME", "authorization", "htpasswd_line", "models_token", "token_destination_problem"]

HTPASSWD_NAME = "models.htpasswd"
_LABEL = b"flayer-edge models over HTTP v1"


def models_token(password: str) -> str:
    """The secret a user presents to the model server, derived from its broker password."""
    if not password:
        raise ValueError("a models token needs the user's broker password")
    return hmac.new(password.encode(), _LABEL, hashlib.sha256).hexdigest()


def authorization(username: str, password: str) -> str:
    """The ``Authorization`` header value a device sends with each model request."""
    if ":" in username or not username:
        raise ValueError(f"a user name for HTTP basic authentication has no ':', got {username!r}")
    raw = f"{username}:{models_token(password)}".encode()
    return "Basic " + base64.b64encode(raw).decode("ascii")


def htpasswd_line(username: str, password: str) -> str:
    """``user:{SSHA}...`` for nginx's ``auth_basic_user_file`` (a fresh salt each time)."""
    if ":" in username or "\n" in username or not username:
        raise ValueError(f"bad user name for an htpasswd line: {username!r}")
    salt = os.urandom(8)
    digest = hashlib.sha1(models_token(password).encode() + salt).digest()
    return f"{username}:{{SSHA}}{base64.b64encode(digest + salt).decode('ascii')}"


def token_destination_problem(url: str, hosts: Iterable[str], plain_http: bool = False) -> str | None:
    """Why a device may not send its models token to ``url`` (None: it may; module docstring). ``hosts``: the hosts
    its own configuration names (the broker's, ``[edge] models_hosts``); ``plain_http``: ``[edge] models_plain_http``."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
    except ValueError:
        return "it is not a URL"
    known = {h.lower().rstrip(".") for h in hosts if h}
    if host not in known:
        return (f"its host {host!r} is not this device's broker host nor in [edge] models_hosts "
                f"({', '.join(sorted(known)) or 'none'})")
    if parts.scheme != "https" and not (is_loopback(host) or plain_http):
        return "it is plain http across a network (the token would travel in clear); [edge] models_plain_http allows it"
    return None
