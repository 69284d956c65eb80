"""Who may read a read-only HTTP endpoint of this stack (the dashboard, the coordinator's Prometheus metrics).

The rule, written once (docs/howto/watch-fleet.md, docs/howto/service.md):

1. Bound to a loopback address (:func:`transport.hosts.is_loopback`) the endpoint is open: only this
   machine reaches it.
2. Bound anywhere else it needs a token of at least ``MIN_TOKEN_CHARS`` characters; when none is given one
   is generated (:func:`token_for`).
3. A request presents the token as ``Authorization: Bearer TOKEN`` (what Prometheus sends with
   ``authorization: credentials_file``), as ``?token=TOKEN`` in the address, or in the endpoint's cookie;
   it is compared in constant time. A missing or wrong token gets 401 and no data.
4. A request's ``Host`` header must name the endpoint as this machine is known: an IP address, ``localhost``,
   this machine's own host name, the name it is bound to, or a name the operator allowed
   (:func:`served_names`); anything else gets 421 and no data. A page of another site whose name was made to
   resolve to this machine (DNS rebinding) sends its own name, so a browser cannot be turned against an
   endpoint open on loopback.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from collections.abc import Iterable
from http.cookies import CookieError, SimpleCookie
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from .hosts import is_loopback

__all__ = ["MIN_TOKEN_CHARS", "REQUEST_TIMEOUT_S", "host_allows", "presented_token", "served_names", "token_allows",
           "token_for"]

MIN_TOKEN_CHARS = 16
# Every socket of the HTTP endpoints a coordinator host serves (the Prometheus exporter, the dashboard) times
# out after this long without progress: a connection that sends no request, or reads nothing, is closed
# instead of holding a server thread for ever.
REQUEST_TIMEOUT_S = 10.0


class Headers(Protocol):
    """A request's headers (``http.server``'s message, or a dict)."""

    def get(self, name: str, default: Any = None, /) -> Any: ...


def token_for(host: str, token: str | None) -> str | None:
    """The token an endpoint bound to ``host`` requires (rules 1 and 2): ``token`` when given (ValueError
    when shorter than ``MIN_TOKEN_CHARS``), a generated one off loopback, else None (open)."""
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the access token must be at least {MIN_TOKEN_CHARS} characters, got {len(token)}")
    if token is None and not is_loopback(host):
        return secrets.token_urlsafe(24)
    return token


def presented_token(path: str, headers: Headers, cookie: str | None = None) -> tuple[str | None, bool]:
    """(the token a request presents, whether it came in the query string), rule 3."""
    query = parse_qs(urlsplit(path).query)
    if "token" in query:
        return query["token"][0], True
    auth = headers.get("Authorization", "") or ""
    if auth.startswith("Bearer "):
        return auth[7:].strip(), False
    if cookie is not None:
        try:
            jar = SimpleCookie(headers.get("Cookie", "") or "")
        except CookieError:
            return None, False
        if cookie in jar:
            return jar[cookie].value, False
    return None, False


def token_allows(want: str | None, path: str, headers: Headers, cookie: str | None = None
                 ) -> tuple[bool, bool]:
    """(allowed, the token came in the query string) for a request to an endpoint requiring ``want``
    (None: open)."""
    if want is None:
        return True, False
    got, in_query = presented_token(path, headers, cookie)
    ok = got is not None and secrets.compare_digest(got.encode(), want.encode())
    return ok, ok and in_query


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def served_names(bound: str, allowed: Iterable[str] = ()) -> frozenset[str]:
    """The names a request's ``Host`` may give besides an IP address (rule 4): ``localhost``, this machine's host
    name and fully qualified name, ``bound`` when it is a name, and ``allowed``."""
    names = {"localhost", socket.gethostname(), socket.getfqdn(), *allowed}
    if not _is_ip(bound):
        names.add(bound)
    return frozenset(n.lower().rstrip(".") for n in names if n)


def host_allows(headers: Headers, names: frozenset[str]) -> bool:
    """Whether the request's ``Host`` header names this endpoint (rule 4): an IP address (``[...]`` for IPv6),
    or one of ``names``; the port, when given, is not checked (the socket already chose the endpoint)."""
    raw = str(headers.get("Host", "") or "").strip()
    if raw.startswith("["):
        end = raw.find("]")
        rest = raw[end + 1:]
        return end > 0 and (rest == "" or rest.startswith(":")) and _is_ip(raw[1:end])
    if raw.count(":") > 1 or not raw:
        return False
    name = raw.partition(":")[0].lower().rstrip(".")
    return _is_ip(name) or name in names
