"""A TCP proxy on loopback between one MQTT client and the broker, that can cut the link.

Real sockets: the client connects to the proxy's port, the proxy to the broker. ``cut_after(n)``
arms a cut of the current connection once ``n`` bytes have gone towards the client: it forwards
exactly that many and ends the stream there (the client reads them, then the end of the stream),
drops the connection to the broker, and from then on drops whatever the client sends (its PUBACKs
never reach the broker).
Later connections (the client's reconnect) are forwarded untouched. Bytes are counted per
connection and direction, and the MQTT packets that went through are read (:class:`MqttTap`): the
QoS 1 PUBLISHes towards the client and the PUBACKs that reached the broker, so a test can tell
which messages the broker knew the client had when the link died.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

from loopproxy import LoopbackProxy, ProxyConn

__all__ = ["CutProxy", "MqttTap"]


class MqttTap:
    """Splits one direction of an MQTT 3.1.1 byte stream into packets and appends the QoS 1 PUBLISHes
    (``("publish", topic, packet id, dup)``) and PUBACKs (``("puback", packet id)``) that went through
    whole to ``log`` -- one log for both directions of a connection, in the order they passed."""

    def __init__(self, log: list[tuple]) -> None:
        self._buf = bytearray()
        self.log = log

    def feed(self, data: bytes) -> None:
        self._buf += data
        while True:
            length, shift, i = 0, 0, 1
            while True:  # the remaining-length varint
                if i >= len(self._buf):
                    return
                byte = self._buf[i]
                length |= (byte & 0x7F) << shift
                shift += 7
                i += 1
                if not byte & 0x80:
                    break
            if len(self._buf) < i + length:
                return
            kind, body = self._buf[0], bytes(self._buf[i : i + length])
            del self._buf[: i + length]
            if kind >> 4 == 3 and (kind >> 1) & 3:  # PUBLISH, QoS 1 or 2
                tlen = int.from_bytes(body[:2], "big")
                self.log.append(
                    (
                        "publish",
                        body[2 : 2 + tlen].decode(),
                        int.from_bytes(body[2 + tlen : 4 + tlen], "big"),
                        bool(kind & 8),
                    )
                )
            elif kind >> 4 == 4:  # PUBACK
                self.log.append(("puback", int.from_bytes(body[:2], "big")))


@dataclass
class _Conn(ProxyConn):
    down: int = 0  # bytes broker -> client
    up: int = 0
    cut: bool = False
    log: list[tuple] = field(default_factory=list)  # MQTT packets that went through, in order

    def __post_init__(self) -> None:
        self.down_tap, self.up_tap = MqttTap(self.log), MqttTap(self.log)


class CutProxy(LoopbackProxy):
    conn_type = _Conn

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.cut = threading.Event()
        self._cut_at: int | None = None
        self._lock = threading.Lock()
        super().__init__(target_port, target_host, name="cut-proxy")

    def cut_after(self, nbytes: int) -> None:
        """Cut the current (latest) connection once it carried ``nbytes`` towards the client in all."""
        with self._lock:
            self._cut_at = nbytes

    def down_bytes(self, since: int = 0) -> int:
        """Bytes forwarded towards the client on connections ``since`` and later."""
        return sum(c.down for c in self.conns[since:])

    def acked_topics(self, conn: int) -> set[str]:
        """Topics of the QoS 1 messages the client received on connection ``conn`` and whose PUBACK
        reached the broker (the messages the broker knows it has)."""
        outstanding: dict[int, str] = {}
        acked: set[str] = set()
        for event in list(self.conns[conn].log):
            if event[0] == "publish":
                outstanding[event[2]] = event[1]
            elif event[1] in outstanding:
                acked.add(outstanding.pop(event[1]))
        return acked

    def published(self, conn: int) -> list[tuple[str, int, bool]]:
        """(topic, packet id, dup) of the QoS 1 messages the client received on connection ``conn``."""
        return [(e[1], e[2], e[3]) for e in list(self.conns[conn].log) if e[0] == "publish"]

    def _serve(self, conn: _Conn) -> None:
        threading.Thread(target=self._pump, args=(conn, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(conn, False), daemon=True).start()

    def _pump(self, conn: _Conn, downstream: bool) -> None:
        src, dst = (conn.upstream, conn.client) if downstream else (conn.client, conn.upstream)
        try:
            while not conn.closed.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if not downstream:
                    if conn.cut:
                        continue  # the link is down: nothing reaches the broker
                    dst.sendall(data)
                    conn.up += len(data)
                    conn.up_tap.feed(data)
                    continue
                with self._lock:
                    cut_at = self._cut_at if conn is self.conns[-1] else None
                    if cut_at is not None and conn.down + len(data) >= cut_at:
                        self._cut_at = None
                        data = data[: cut_at - conn.down]
                        conn.down += len(data)
                        conn.down_tap.feed(data)
                        dst.sendall(data)
                        conn.cut = True
                        dst.shutdown(socket.SHUT_WR)  # the client reads what came, then the end
                        conn.upstream.close()
                        self.cut.set()
                        return
                conn.down += len(data)
                conn.down_tap.feed(data)
                dst.sendall(data)
        except OSError:
            pass
        conn.close()
