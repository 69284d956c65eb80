"""A TCP proxy on loopback that counts the bytes of each connection towards the client and can cut the
first connection after N of them (it forwards exactly N, then closes both sides): what a flaky link does
to an HTTP download. Later connections pass untouched."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from loopproxy import LoopbackProxy, ProxyConn

__all__ = ["CutProxy"]


@dataclass
class Conn(ProxyConn):
    down: int = 0  # bytes server -> client
    request: bytearray = field(default_factory=bytearray)  # what the client sent


class CutProxy(LoopbackProxy):
    conn_type = Conn

    def __init__(self, target_port: int, cut_after: int | None = None) -> None:
        self.cut_after = cut_after  # bytes of the first connection towards the client, then the cut
        self.cut = threading.Event()
        super().__init__(target_port, name="http-cut-proxy")

    def _serve(self, conn: Conn) -> None:
        first = self.conns[0] is conn
        threading.Thread(target=self._up, args=(conn,), daemon=True).start()
        threading.Thread(target=self._down, args=(conn, self.cut_after if first else None), daemon=True).start()

    def _up(self, conn: Conn) -> None:
        try:
            while data := conn.client.recv(65536):
                conn.request += data
                conn.upstream.sendall(data)
        except OSError:
            pass

    def _down(self, conn: Conn, cut_at: int | None) -> None:
        try:
            while data := conn.upstream.recv(65536):
                if cut_at is not None and conn.down + len(data) >= cut_at:
                    data = data[: cut_at - conn.down]
                    conn.client.sendall(data)
                    conn.down += len(data)
                    self.cut.set()
                    break
                conn.client.sendall(data)
                conn.down += len(data)
        except OSError:
            pass
        conn.close()
