"""One network thread for many paho clients: the emulator's way past paho's per-client limits.

With ``loop_start()`` every paho client has its own thread, which waits in ``select()`` on its socket
and on a wake-up socket pair: three file descriptors per client, and ``select()`` cannot watch a
descriptor numbered 1024 or more, so one process holds at most about 330 paho clients (measured:
the 340th connects, the rest fail and retry forever). :class:`SharedNetwork` is a
:class:`transport.link.NetworkDriver` that drives any number of clients from one thread with the
operating system's scalable selector (epoll on Linux) through paho's external-loop interface
(``loop_read`` / ``loop_write`` / ``loop_misc`` and the socket callbacks): one descriptor per client
and no thread. Each client keeps its own connection, session, credentials and callbacks; only who
runs its network side changes.

Reconnects: a client whose connection drops (not detached) reconnects after 1, 2, 4 ... up to 30 s,
as paho's own thread would. Thread safety: publishing from other threads is what paho's external
loop expects (paho then asks, through ``on_socket_register_write``, for the socket to be watched
for writing); such requests are queued and the thread woken. Every second each client's
``loop_misc`` runs (keep-alive pings, lost connections) and pending writes are re-checked.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["SharedNetwork"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    client: Any
    sock: Any = None
    writing: bool = False
    reconnect_at: float | None = 0.0  # first connect at once
    delay: float = 0.0
    detached: threading.Event | None = None  # set once the client is forgotten
    detach_by: float = 0.0
    done: bool = False
    connecting: bool = False  # inside reconnect(), which first closes the old socket


class SharedNetwork:
    """Drives many paho clients from one thread; pass it as ``network`` to MqttLink / EdgeClient."""

    def __init__(self, name: str = "mqtt-net", reconnect_delay: tuple[float, float] = (1.0, 30.0),
                 misc_interval: float = 1.0) -> None:
        self.name = name
        self.reconnect_delay = reconnect_delay
        self.misc_interval = misc_interval
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._requests: deque[tuple[str, _Entry, Any]] = deque()
        self._entries: dict[int, _Entry] = {}
        self._reconnecting: dict[int, _Entry] = {}  # the entries whose reconnect_at is set (a loop pass reads only these)
        self._thread: threading.Thread | None = None
        self._closing = False
        self._misc_at = 0.0

    # ---- public --------------------------------------------------------------------------------
    def start(self) -> SharedNetwork:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; clients still attached lose their connection (as a crash would)."""
        self._closing = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for entry in list(self._entries.values()):
            self._close_socket(entry)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    @property
    def clients(self) -> int:
        return len(self._entries)

    def connected(self) -> int:
        return sum(1 for e in list(self._entries.values()) if e.client.is_connected())

    # ---- NetworkDriver -------------------------------------------------------------------------
    def attach(self, client: Any) -> None:
        entry = _Entry(client)
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = self._on_unregister_write
        self._request("attach", entry)
        self.start()

    def detach(self, client: Any, abrupt: bool = False, timeout: float = 3.0) -> None:
        entry = self._entries.get(id(client))
        if entry is None:
            with self._lock:  # attached, but the thread has not taken it yet
                entry = next((e for _, e, _ in self._requests if e.client is client), None)
            if entry is None:
                return
        done = threading.Event()
        self._request("detach", entry, (abrupt, done, time.monotonic() + timeout))
        if threading.current_thread() is not self._thread:
            done.wait(timeout + 1.0)

    # ---- paho's socket callbacks (any thread) ----------------------------------------------------
    def _on_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        self._request("open", self._entry(client), sock)

    def _on_socket_close(self, client: Any, userdata: Any, sock: Any) -> None:
        self._request("close", self._entry(client), sock)

    def _on_register_write(self, client: Any, userdata: Any, sock: Any) -> None:
        self._request("write", self._entry(client), True)

    def _on_unregister_write(self, client: Any, userdata: Any, sock: Any) -> None:
        self._request("write", self._entry(client), False)

    def _entry(self, client: Any) -> _Entry:
        entry = self._entries.get(id(client))
        if entry is None:
            with self._lock:
                entry = next((e for _, e, _ in self._requests if e.client is client), None)
        return entry if entry is not None else _Entry(client, done=True)

    # ---- the network thread ------------------------------------------------------------------------
    def _request(self, op: str, entry: _Entry, arg: Any = None) -> None:
        if threading.current_thread() is self._thread:
            self._apply(op, entry, arg)
            return
        with self._lock:
            self._requests.append((op, entry, arg))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the thread will wake anyway) or closed

    def _apply(self, op: str, entry: _Entry, arg: Any) -> None:
        if entry.done:
            if op == "detach":
                arg[1].set()
            return
        if op == "attach":
            self._entries[id(entry.client)] = entry
            self._reconnect_at(entry, entry.reconnect_at)
        elif op == "open":
            entry.sock = arg
            entry.writing = False
            self._sel.register(arg, selectors.EVENT_READ, entry)
        elif op == "close":
            self._unwatch(entry, arg)
            if entry.detached is not None:
                self._forget(entry)
            elif not entry.connecting:
                self._schedule_reconnect(entry)
        elif op == "write":
            self._watch_write(entry, bool(arg))
        elif op == "detach":
            abrupt, done, by = arg
            entry.detached, entry.detach_by = done, by
            self._reconnect_at(entry, None)
            if abrupt or entry.sock is None:
                self._close_socket(entry)
                self._forget(entry)

    def _watch_write(self, entry: _Entry, on: bool) -> None:
        if entry.sock is None or entry.writing == on:
            return
        entry.writing = on
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        try:
            self._sel.modify(entry.sock, events, entry)
        except (KeyError, ValueError, OSError):
            pass

    def _unwatch(self, entry: _Entry, sock: Any) -> None:
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        if entry.sock is sock:
            entry.sock = None
            entry.writing = False

    def _close_socket(self, entry: _Entry) -> None:
        """Close without DISCONNECT (the broker publishes the will)."""
        sock = entry.sock
        if sock is None:
            return
        self._unwatch(entry, sock)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()

    def _forget(self, entry: _Entry) -> None:
        entry.done = True
        self._reconnect_at(entry, None)
        self._entries.pop(id(entry.client), None)
        if entry.detached is not None:
            entry.detached.set()

    def _schedule_reconnect(self, entry: _Entry) -> None:
        lo, hi = self.reconnect_delay
        entry.delay = lo if entry.delay <= 0 else min(hi, entry.delay * 2)
        self._reconnect_at(entry, time.monotonic() + entry.delay)

    def _reconnect_at(self, entry: _Entry, at: float | None) -> None:
        """Set when ``entry`` reconnects (None: not) and keep :attr:`_reconnecting` in step, so that a pass of
        the loop looks at the few clients waiting to reconnect, not at every client of the process."""
        entry.reconnect_at = at
        if at is None:
            self._reconnecting.pop(id(entry.client), None)
        else:
            self._reconnecting[id(entry.client)] = entry

    def _connect(self, entry: _Entry, now: float) -> None:
        self._reconnect_at(entry, None)
        entry.connecting = True
        try:
            entry.client.reconnect()  # on_socket_open registers the new socket
        except OSError as exc:
            log.debug("a client's connect failed (%s); retrying", exc)
            self._schedule_reconnect(entry)
        finally:
            entry.connecting = False

    def _drain_requests(self) -> None:
        while True:
            with self._lock:
                if not self._requests:
                    return
                op, entry, arg = self._requests.popleft()
            self._apply(op, entry, arg)

    def _run(self) -> None:
        while not self._closing:
            now = time.monotonic()
            due = [e.reconnect_at for e in self._reconnecting.values() if e.reconnect_at is not None]
            timeout = max(0.0, min([self._misc_at - now, *(d - now for d in due), 1.0]))
            for key, mask in self._sel.select(timeout):
                entry = key.data
                if entry is None:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                    continue
                self._io(entry, mask)
            self._drain_requests()
            now = time.monotonic()
            for entry in [e for e in self._reconnecting.values() if e.reconnect_at is not None
                          and e.reconnect_at <= now]:
                self._connect(entry, now)
            if now >= self._misc_at:
                self._misc_at = now + self.misc_interval
                self._misc(now)

    def _io(self, entry: _Entry, mask: int) -> None:
        client = entry.client
        try:
            if mask & selectors.EVENT_READ and entry.sock is not None:
                client.loop_read()
            if mask & selectors.EVENT_WRITE and entry.sock is not None:
                client.loop_write()
        except Exception:
            log.exception("network error of one client; dropping its connection")
            self._close_socket(entry)
            self._schedule_reconnect(entry)

    def _misc(self, now: float) -> None:
        for entry in list(self._entries.values()):
            client = entry.client
            if entry.detached is not None and now >= entry.detach_by:
                self._close_socket(entry)
                self._forget(entry)
                continue
            if entry.sock is None:
                continue
            if client.is_connected():
                entry.delay = 0.0
            try:
                client.loop_misc()
                if entry.sock is not None and client.want_write() and not entry.writing:
                    self._watch_write(entry, True)  # a registration lost in a race
            except Exception:
                log.exception("keep-alive of one client failed; dropping its connection")
                self._close_socket(entry)
                self._schedule_reconnect(entry)
