"""Models over HTTP on the device: fetch a model or delta blob from ``<models_url>/<digest>`` with range
requests, keeping the partial file in the state folder so a cut resumes where it stopped.

:func:`fetch_blob` downloads one blob whose size and sha256 the plan states:

- the bytes go to ``<state_dir>/downloads/<digest>.part`` (written as they come, fsynced when an
  attempt ends); a fetch that finds a partial file asks for the rest only (``Range: bytes=N-``, a
  ``206`` whose ``Content-Range`` must start at N and end at the plan's size), after a reboot too;
  a server that answers ``200`` to a range request is read from the start;
- a connection cut in the middle of the body (reset, closed early) is resumed at once, up to
  ``attempts`` times while each attempt brings bytes;
- the body is bounded: a ``Content-Length`` beyond what is missing, or any byte past the plan's
  size, is refused before it is written;
- the finished file is kept only if its sha256 is the digest; otherwise it is deleted.

The whole fetch has a deadline (``deadline_s``, all attempts together): a server that keeps the
connection alive by sending a byte now and then, never silent for the per-read ``timeout_s``, is given up
when the deadline passes (each read waits at most until the deadline, and reads return what has arrived).

Anything else -- an HTTP status other than 200/206 (redirects are not followed), a timeout, the deadline,
a refused connection, a size or digest mismatch -- raises :class:`HttpFetchError`, whose ``reason`` says why;
the client then downloads the broker's retained chunks (:mod:`edge_client.fetch`). HTTPS uses the
federation's CA when the device's credentials name one (``[tls] ca_file``), else the system's. Each request
carries ``authorization`` (the device's user name and models token, :mod:`transport.models_auth`) when
given: the model server refuses anyone else.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from protocol.model_url import model_file_url, models_url_problem

__all__ = ["BLOCK", "HttpFetchError", "HttpTarget", "fetch_blob", "part_path", "tls_context"]

log = logging.getLogger(__name__)

BLOCK = 64 * 1024  # bytes read per step (the link shaper and the cancel flag are consulted per step)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class HttpFetchError(Exception):
    """``kind``: http (a status), timeout, deadline, connect, cut, size, digest, cancelled; ``reason``: in
    words."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclass(frozen=True)
class HttpTarget:
    models_url: str
    digest: str
    size: int

    @property
    def url(self) -> str:
        return model_file_url(self.models_url, self.digest)


@dataclass
class FetchStats:
    via: str = "http"
    http_bytes: int = 0  # body bytes received, all attempts together
    resumed_from: int = 0  # bytes held (a partial file) when the fetch began
    attempts: int = 0
    statuses: list[int] = field(default_factory=list)

    def as_info(self) -> dict[str, int | str]:
        return {"via": self.via, "http_bytes": self.http_bytes, "resumed_from": self.resumed_from,
                "attempts": self.attempts, "http_status": ",".join(map(str, self.statuses))}


def part_path(state_dir: str | Path, digest: str) -> Path:
    return Path(state_dir) / "downloads" / f"{digest}.part"


def _drop_other_parts(folder: Path, keep: Path) -> None:
    """One download at a time: partial files of other blobs are dropped (disk stays bounded)."""
    try:
        for entry in folder.glob("*.part"):
            if entry != keep:
                entry.unlink(missing_ok=True)
    except OSError:
        pass


def _connection(url: str, timeout_s: float, tls: ssl.SSLContext | None) -> tuple[http.client.HTTPConnection, str]:
    problem = models_url_problem(url)
    if problem is not None:
        raise HttpFetchError("url", f"model URL {problem}")
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.scheme == "https":
        ctx = tls or ssl.create_default_context()
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout_s, context=ctx), path
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s), path


def fetch_blob(target: HttpTarget, state_dir: str | Path, *, timeout_s: float = 30.0,
               deadline_s: float = 600.0, tls: ssl.SSLContext | None = None, attempts: int = 3,
               authorization: str | None = None,
               cancelled: Callable[[], bool] = lambda: False,
               on_bytes: Callable[[int], None] | None = None) -> tuple[bytes, dict[str, int | str]]:
    """(the verified blob, stats for the progress event); HttpFetchError otherwise (module docstring)."""
    part = part_path(state_dir, target.digest)
    part.parent.mkdir(parents=True, exist_ok=True)
    _drop_other_parts(part.parent, part)
    try:
        held = part.stat().st_size
    except FileNotFoundError:
        held = 0
    if held >= target.size:  # a whole (or over-long) file that was not accepted before: start over
        part.unlink(missing_ok=True)
        held = 0
    stats = FetchStats(resumed_from=held)
    if not deadline_s > 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
    clock = _Deadline(time.monotonic() + deadline_s, deadline_s, timeout_s)
    while True:
        if cancelled():
            raise HttpFetchError("cancelled", "cancelled")
        stats.attempts += 1
        before = held
        try:
            held = _attempt(target, part, held, clock, tls, stats, cancelled, on_bytes, authorization)
        except _Cut as cut:
            held = cut.held
            if held > before and stats.attempts < attempts:
                log.info("model %s over HTTP cut at %d of %d bytes (%s); asking for the rest", target.digest[:12],
                         held, target.size, cut.reason)
                continue
            raise HttpFetchError("cut", f"connection cut at {held} of {target.size} bytes ({cut.reason}) after "
                                        f"{stats.attempts} attempt(s)") from None
        if held == target.size:
            break
    blob = part.read_bytes()
    digest = hashlib.sha256(blob).hexdigest()
    if len(blob) != target.size or digest != target.digest:
        part.unlink(missing_ok=True)
        raise HttpFetchError("digest", f"the file at {target.url} has sha256 {digest[:12]} ({len(blob)} bytes); "
                                       f"the plan names {target.digest[:12]} ({target.size} bytes)")
    part.unlink(missing_ok=True)
    return blob, stats.as_info()


@dataclass(frozen=True)
class _Deadline:
    end: float  # time.monotonic() when the whole fetch must be done
    total_s: float
    timeout_s: float  # the longest wait for one read

    def wait_s(self, target: HttpTarget, held: int) -> float:
        """How long the next socket operation may wait; HttpFetchError("deadline") once the deadline passed."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise HttpFetchError("deadline", f"{target.url} was not fetched within {self.total_s:g} s ({held} of "
                                             f"{target.size} bytes)")
        return min(self.timeout_s, left)


class _Cut(Exception):
    def __init__(self, held: int, reason: str) -> None:
        super().__init__(reason)
        self.held, self.reason = held, reason


def _attempt(target: HttpTarget, part: Path, held: int, clock: _Deadline, tls: ssl.SSLContext | None,
             stats: FetchStats, cancelled: Callable[[], bool], on_bytes: Callable[[int], None] | None,
             authorization: str | None = None) -> int:
    """One request from byte ``held``: the bytes held after it (the plan's size when complete); _Cut when
    the body stopped early, HttpFetchError for anything that is not worth a retry."""
    timeout_s = clock.timeout_s
    conn, path = _connection(target.url, clock.wait_s(target, held), tls)
    headers = {"Accept-Encoding": "identity", "User-Agent": "flayer-edge"}
    if authorization is not None:
        headers["Authorization"] = authorization
    if held:
        headers["Range"] = f"bytes={held}-"
    try:
        try:
            conn.connect()
            sock = conn.sock
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
        except TimeoutError:
            clock.wait_s(target, held)  # the deadline, when it is what ran out
            raise HttpFetchError("timeout", f"no answer from {target.url} within {timeout_s:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise HttpFetchError("connect", f"cannot reach {target.url}: {exc or type(exc).__name__}") from None
        stats.statuses.append(resp.status)
        if resp.status == 206 and held:
            m = _CONTENT_RANGE.fullmatch(resp.getheader("Content-Range", "").strip())
            if m is None or int(m.group(1)) != held or int(m.group(2)) != target.size - 1 or \
                    m.group(3) not in ("*", str(target.size)):
                raise HttpFetchError("size", f"{target.url} answered range {resp.getheader('Content-Range')!r} to "
                                             f"bytes={held}- of a {target.size}-byte file")
        elif resp.status == 200:
            held = 0  # the whole file (a server that ignores ranges)
        else:
            raise HttpFetchError("http", f"{target.url} answered HTTP {resp.status} {resp.reason}")
        want = target.size - held
        length = resp.getheader("Content-Length")
        if length is not None and (not length.strip().isdigit() or int(length) > want):
            raise HttpFetchError("size", f"{target.url} sends a body of {length} bytes, the plan's size leaves "
                                         f"{want} to fetch")
        with open(part, "r+b" if held else "wb") as f:
            f.seek(held)
            f.truncate()
            try:
                while held < target.size:
                    if cancelled():
                        raise HttpFetchError("cancelled", "cancelled")
                    sock.settimeout(clock.wait_s(target, held))  # a read never outlasts the deadline
                    block = resp.read1(min(BLOCK, target.size - held))  # what has arrived, not a full block
                    if not block:
                        raise _Cut(held, "the body ended early")
                    f.write(block)
                    held += len(block)
                    stats.http_bytes += len(block)
                    if on_bytes is not None:
                        on_bytes(len(block))
                if length is None and resp.read(1):  # no length given: nothing may follow the plan's size
                    raise HttpFetchError("size", f"{target.url} sends more than the plan's {target.size} bytes")
            except TimeoutError:
                clock.wait_s(target, held)
                raise HttpFetchError("timeout", f"{target.url} sent nothing for {timeout_s:g} s at {held} of "
                                                f"{target.size} bytes") from None
            except (http.client.IncompleteRead, ConnectionError, ssl.SSLError, http.client.HTTPException,
                    OSError) as exc:
                raise _Cut(held, type(exc).__name__) from None
            finally:
                f.flush()
                os.fsync(f.fileno())
        return held
    finally:
        conn.close()


def tls_context(ca_file: str | Path | None) -> ssl.SSLContext:
    """HTTPS trust: the federation's CA when given, else the system's."""
    return ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None else ssl.create_default_context()


