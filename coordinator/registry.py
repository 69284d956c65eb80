"""Which devices are online, from their retained ``status/<client>`` messages.

A device publishes a retained Status when it connects and every ``heartbeat_s`` after; the broker
publishes its last will (a retained ``offline`` Status) when its link dies. A device is online when
its last status is not ``offline`` and no older than ``stale_after_s``. Freshness is measured on
the coordinator's clock at arrival; a retained status (stored by the broker, possibly long ago) is
only as fresh as the time it carries, so an old ``online`` left behind by a device that vanished
with the broker down does not count.
"""

from __future__ import annotations

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
    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._devices: dict[str, DeviceInfo] = {}

    def observe(self, client: str, status: Status, now: float, retained: bool = False) -> None:
        seen = min(now, status.time) if retained else now
        self._devices[client] = DeviceInfo(status.state, seen, status.round, dict(status.info))

    def is_online(self, client: str, now: float) -> bool:
        d = self._devices.get(client)
        return d is not None and d.state != "offline" and now - d.last_seen <= self.stale_after_s

    def online(self, now: float) -> list[str]:
        return sorted(c for c in self._devices if self.is_online(c, now))

    def get(self, client: str) -> DeviceInfo | None:
        return self._devices.get(client)

    def infos(self) -> list[dict[str, object]]:
        """Every known device's last status info."""
        return [d.info for d in self._devices.values()]

    def __len__(self) -> int:
        return len(self._devices)
