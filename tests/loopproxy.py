"""The skeleton the tests' TCP proxies on loopback share: a listener on a free port, one connection to
the target per accepted client, a list of the connections in the order they came, and a close that ends
them all. A proxy subclasses :class:`LoopbackProxy` and says what a connection holds (``conn_type``, a
:class:`ProxyConn` dataclass), whether a client is let in (``_admit``) and how its bytes are pumped
(``_serve``, which starts the pumps); the cutting and counting stay each proxy's own."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["LoopbackProxy", "ProxyConn"]


@dataclass
class ProxyConn:
    client: socket.socket
    upstream: socket.socket
    closed: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        """Shut both sockets down and close them (again: nothing)."""
        if self.closed.is_set():
            return
        self.closed.set()
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class LoopbackProxy:
    conn_type: ClassVar[type[ProxyConn]] = ProxyConn

    def __init__(self, target_port: int, target_host: str = "127.0.0.1", name: str = "proxy") -> None:
        """Subclasses set their own state first: the accept thread starts here."""
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.conns: list[Any] = []
        self._stop = False
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        self.listener.close()
        for c in list(self.conns):
            c.close()

    def _admit(self) -> bool:
        """Whether a client that connects now is forwarded (else closed at once)."""
        return True

    def _serve(self, conn: Any) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self._admit():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            conn = self.conn_type(client, upstream)
            self.conns.append(conn)
            self._serve(conn)
