"""Models over HTTP: the plan's ``models_url``, where devices may fetch the global model and its deltas.

The coordinator (``[federation] models_dir`` and ``models_url``) writes every model and delta blob it
publishes as an immutable file named by its sha256 into a folder a web server serves; the plan names
the folder's URL and a device fetches ``<models_url>/<digest>`` (:func:`model_file_url`) with HTTP range
requests, falling back to the broker's retained chunks after any failure (docs/howto/http-models.md).

:func:`models_url_problem` is the check both ends apply: ``http`` or ``https`` only, a host, at most
``MAX_MODELS_URL`` characters of printable ASCII without spaces or backslashes, no credentials
(``user:password@``), no query and no fragment. The URL says where the bytes are, never what they are:
a device keeps a file only if its size and sha256 are the plan's.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["MAX_MODELS_URL", "model_file_url", "models_url_problem"]

MAX_MODELS_URL = 512
_PRINTABLE = re.compile(r"[\x21-\x7e]+")


def models_url_problem(url: object) -> str | None:
    """Why ``url`` cannot be a plan's ``models_url`` (None when it can; the empty string is "none")."""
    if not isinstance(url, str):
        return f"must be a string, got {type(url).__name__}"
    if url == "":
        return None
    if len(url) > MAX_MODELS_URL:
        return f"must be at most {MAX_MODELS_URL} characters, got {len(url)}"
    if not _PRINTABLE.fullmatch(url) or "\\" in url:
        return "must be printable ASCII without spaces or backslashes"
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is not a number in [0, 65535]
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"must be an http:// or https:// URL, got scheme {parts.scheme or '(none)'!r}"
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        return "must not carry credentials (user:password@host)"
    if not parts.hostname:
        return "must name a host"
    if port == 0:
        return "must not name port 0"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "must not have a query or a fragment"
    return None


def model_file_url(models_url: str, digest: str) -> str:
    """The URL of the blob named ``digest`` (64 hex characters) under ``models_url``."""
    return f"{models_url.rstrip('/')}/{digest}"
