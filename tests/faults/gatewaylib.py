"""Helpers of the field-gateway tests: a central Mosquitto with a gateway user, a site Mosquitto bridged
to it through :class:`Backhaul` (a TCP proxy on loopback standing for the site's link, which a test
cuts in the middle of an MQTT packet or holds down), and the coordinator and devices as real
``flayer`` processes -- the coordinator on the central broker, the devices on the site broker.

The federation is a :class:`faultlib.ProcFederation` (so its accounting and reference-run checks
apply unchanged) whose ``fb`` is the central broker; the site broker is ``site``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultlib import FEDERATION, ProcFederation
from fedtestlib import FedBroker, device_toml, federation_toml, wait_connectable
from loopproxy import LoopbackProxy, ProxyConn

from flayer.partition import make_partition, save_partition
from mqtt_broker import BrokerConfig, ManagedBroker, add_device, load_credentials, start_broker
from mqtt_broker.bridge import set_gateway
from mqtt_broker.state import add_gateway

GATEWAY = "site-a"


@dataclass
class _Conn(ProxyConn):
    bytes: dict[str, int] = field(default_factory=lambda: {"down": 0, "up": 0})


class Backhaul(LoopbackProxy):
    """The site's link to the central broker: the site's bridge connects here, this forwards to the
    central broker. ``cut_on(direction, marker, keep)`` arms a cut: when ``marker`` (e.g. a topic
    prefix) next passes in that direction ("down": towards the site), exactly ``keep`` bytes after its
    start are forwarded and both sockets are closed, so the packet it belongs to arrives half-way.
    ``hold()`` takes the link down (the connection closed, new ones closed at once) until ``release()``;
    ``cut_on(..., hold=True)`` holds it down from the cut on.
    """

    conn_type = _Conn

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.cuts: list[tuple[str, bytes, int]] = []  # (direction, marker, connection index) of each cut made
        self.fired = threading.Event()
        self.held = threading.Event()
        self._arm: tuple[str, bytes, int, bool] | None = None
        self._lock = threading.Lock()
        super().__init__(target_port, target_host, name="backhaul")

    def cut_on(self, direction: str, marker: bytes, keep: int, hold: bool = False) -> None:
        assert direction in ("down", "up") and keep >= 0
        with self._lock:
            self.fired.clear()
            self._arm = (direction, marker, keep, hold)

    def hold(self) -> None:
        self.held.set()
        for c in list(self.conns):
            c.close()

    def release(self) -> None:
        self.held.clear()

    def connections(self) -> int:
        return len(self.conns)

    def _admit(self) -> bool:
        return not self.held.is_set()

    def _serve(self, conn: _Conn) -> None:
        threading.Thread(target=self._pump, args=(conn, "down"), daemon=True).start()
        threading.Thread(target=self._pump, args=(conn, "up"), daemon=True).start()

    def _pump(self, conn: _Conn, direction: str) -> None:
        src, dst = (conn.upstream, conn.client) if direction == "down" else (conn.client, conn.upstream)
        tail = b""
        try:
            while not conn.closed.is_set():
                data = src.recv(65536)
                if not data:
                    break
                with self._lock:
                    arm = self._arm if self._arm is not None and self._arm[0] == direction else None
                    if arm is not None:
                        _, marker, keep, hold = arm
                        at = (tail + data).find(marker)
                        if at >= 0:
                            end = max(0, at - len(tail)) + keep
                            dst.sendall(data[:end])
                            conn.bytes[direction] += min(end, len(data))
                            self._arm = None
                            self.cuts.append((direction, marker, self.conns.index(conn)))
                            if hold:
                                self.held.set()
                            conn.close()
                            self.fired.set()
                            return
                        tail = (tail + data)[-len(marker):]
                dst.sendall(data)
                conn.bytes[direction] += len(data)
        except OSError:
            pass
        conn.close()


@dataclass
class GatewayFederation(ProcFederation):
    site: ManagedBroker | None = None
    site_dir: Path | None = None
    backhaul: Backhaul | None = None

    def restart_site(self, between: Any = None) -> None:
        """Stop the site broker (SIGTERM: it saves its database), run ``between()``, start it again over the
        same state folder and port."""
        assert self.site is not None and self.site_dir is not None
        port = self.site.port
        self.site.stop()
        if between is not None:
            between()
        self.site = start_broker(BrokerConfig(federation=FEDERATION, persistence=True), self.site_dir,
                                 kind="mosquitto", timeout=30)
        assert self.site.port == port

    def stop(self) -> None:
        super().stop()
        if self.site is not None:
            self.site.stop()
        if self.backhaul is not None:
            self.backhaul.close()


def wait_bridge_up(central_log: Path, since: int, timeout: float = 15.0) -> None:
    """Until the central broker logged the gateway's connection (after byte ``since`` of its log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = central_log.read_bytes()[since:].decode(errors="replace")
        if f"as {GATEWAY} " in text:
            time.sleep(0.3)  # its SUBSCRIBEs
            return
        time.sleep(0.05)
    raise AssertionError(f"the bridge did not connect within {timeout:.0f} s:\n{central_log.read_text()[-3000:]}")


def gateway_federation(tmp: Path, ds: Any, devices: list[str], *, rounds: int, strategy: str = "fedavg",
                       seed: int = 0, lr: float = 0.05, proxy: bool = True) -> GatewayFederation:
    """Central broker (persistent) with a gateway serving ``devices``, the site broker bridged to it (through
    a :class:`Backhaul` when ``proxy``), the devices' credentials on the site, partition and configs; the
    bridge is up, no flayer process started yet. Every journal is kept."""
    central_dir, site_dir = tmp / "central", tmp / "site"
    central = start_broker(BrokerConfig(federation=FEDERATION, persistence=True), central_dir, kind="mosquitto",
                           timeout=30)
    site = backhaul = None
    try:
        add_gateway(central_dir, GATEWAY, devices)
        central.reload()
        fb = FedBroker(central, central_dir, {}, load_credentials(central_dir, "coordinator"))
        backhaul = Backhaul(central.port) if proxy else None
        site_cfg = BrokerConfig(federation=FEDERATION, persistence=True)
        set_gateway(site_dir, site_cfg, central_dir / f"credentials/{GATEWAY}.toml",
                    f"127.0.0.1:{backhaul.port if backhaul else central.port}", 5, (1, 1))
        log_at = (central_dir / "broker.log").stat().st_size
        site = start_broker(site_cfg, site_dir, kind="mosquitto", timeout=30)
        creds = {d: add_device(site_dir, d) for d in devices}
        add_gateway(central_dir, GATEWAY, devices, device_keys=site_dir / "signing_keys.json")  # their public keys
        site.reload()
        wait_connectable(creds[devices[-1]])
        wait_bridge_up(central_dir / "broker.log", log_at)
    except BaseException:
        for b in (site, central):
            if b is not None:
                b.stop()
        if backhaul is not None:
            backhaul.close()
        raise
    part = make_partition(ds.y, ds.num_classes, len(devices), "iid", seed,
                          meta={"dataset": ds.name, "dataset_fingerprint": ds.fingerprint()})
    part_file = save_partition(part, tmp / f"digits-{len(devices)}.npz")
    coord_state = tmp / "coord"
    fed_toml = federation_toml(tmp / "federation.toml", central_dir / "credentials/coordinator.toml", coord_state,
                               strategy=strategy, rounds=rounds, dataset="digits", seed=seed, lr=lr,
                               quorum=len(devices), min_devices=len(devices), over_selection=1.0, deadline_s=300.0,
                               grace_s=0.0, keep_journals=1000)
    edge_kw = {"heartbeat_s": 1.0, "ack_timeout_s": 3.0, "backoff_s": 0.5, "backoff_max_s": 2.0, "retries": 8,
               "download_stall_s": 5.0}
    tomls = {d: device_toml(tmp / f"{d}.toml", site_dir / f"credentials/{d}.toml", dataset="digits",
                            partition_file=part_file, client=i, state_dir=tmp / d, **edge_kw)
             for i, d in enumerate(devices)}
    return GatewayFederation(tmp, fb, fed_toml, tomls, coord_state, rounds, seed, lr, strategy,
                             site=site, site_dir=site_dir, backhaul=backhaul)
