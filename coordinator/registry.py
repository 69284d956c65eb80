"""Which devices are online, from their retained ``status/<client>`` messages.

A device publishes a retained Status when it connects and every ``heartbeat_s`` after; the broker
publishes its last will (a retained ``offline`` Status) when its link dies. A device is online when
its last status is not ``offline`` and no older than ``stale_after_s``. Freshness is measured on
the coordinator's clock at arrival; a retained status (stored by the broker, possibly long ago) is
only as fresh as the time it carries, so an old ``online`` left behind by a device that vanished
with the broker down does not count.

Replays (:meth:`DeviceRegistry.replayed`). A status is signed by its device, with the device's clock in it,
but a party that can write the device's status topic (a mistaken ACL, a bridge, a broker defect) can put back
one the device sent earlier: an old heartbeat would keep a device that died looking online (selected, and its
rounds waiting to the deadline), an old will would make a live one look offline. So a status older than the
newest one taken from the device, or that very one again, is refused. A last will is the exception: it is
signed when the device connects, before the heartbeats that follow, so an ``offline`` status counts when it
is no older than the connection the device's newest status names (``info.since``, its will's time); the will
of an earlier connection is refused. The edge client signs a new will before every CONNECT (reconnects of the
same process included), so a will the broker published at a link cut is an earlier connection's once the device
is back. What this cannot tell apart: the will of the device's current connection, known to the broker only
until that connection ends, put back while the device lives, shows it offline until its next heartbeat; and the
coordinator remembers the newest status from its start only (docs/explanation/security.md, "Replays").
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from protocol import Status

__all__ = ["DeviceInfo", "DeviceRegistry"]


@dataclass
class DeviceInfo:
    state: str
    last_seen: float
    round: int
    info: dict[str, object]


class DeviceRegistry:
    def __init__(self, stale_after_s: float, revoked: Callable[[], Collection[str]] = frozenset) -> None:
        """``revoked``: the devices revoked now (:class:`coordinator.revocations.RevocationList`): never online, so
        no stage of a secure round waits for one (its connection is closed and whatever it sends is dropped)."""
        self.stale_after_s, self.revoked = stale_after_s, revoked
        self._devices: dict[str, DeviceInfo] = {}
        self._newest: dict[str, tuple[float, str, float | None]] = {}  # client -> (time, digest, since)

    def replayed(self, client: str, status: Status, digest: str, retained: bool = False) -> str | None:
        """Why ``status`` (``digest``: its payload's, signed by ``client``) is an earlier status put back, or
        None: it is taken, and the newest one when it is (module docstring)."""
        prev = self._newest.get(client)
        if prev is not None:
            newest, newest_digest, since = prev
            if retained and digest == newest_digest:
                return None  # the broker's retained copy of the newest one (the coordinator reconnected)
            if status.state == "offline" and status.time < newest:
                if since is not None and status.time < since:
                    return (f"an offline status of {status.time:.3f}, older than the connection its newest status "
                            f"names ({since:.3f}): an earlier will put back")
                return None  # the will of its current connection: taken; the newest heartbeat stays the mark
            if status.time < newest or (status.time == newest and digest == newest_digest):
                return (f"a status of {status.time:.3f}, not newer than the newest taken ({newest:.3f}): an earlier "
                        "one put back (or the device's clock stepped back)")
        named = status.info.get("since")
        mark = float(named) if isinstance(named, (int, float)) and not isinstance(named, bool) else None
        self._newest[client] = (status.time, digest, mark)
        return None

    def observe(self, client: str, status: Status, now: float, retained: bool = False) -> None:
        seen = min(now, status.time) if retained else now
        self._devices[client] = DeviceInfo(status.state, seen, status.round, dict(status.info))

    def is_online(self, client: str, now: float) -> bool:
        d = self._devices.get(client)
        return d is not None and d.state != "offline" and now - d.last_seen <= self.stale_after_s \
            and client not in self.revoked()

    def online(self, now: float) -> list[str]:
        return sorted(c for c in self._devices if self.is_online(c, now))

    def get(self, client: str) -> DeviceInfo | None:
        return self._devices.get(client)

    def infos(self) -> list[dict[str, object]]:
        """Every known device's last status info."""
        return [d.info for d in self._devices.values()]

    def __len__(self) -> int:
        return len(self._devices)
