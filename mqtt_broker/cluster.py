"""A clustered broker: N Aedes nodes sharing one Redis, each a child process started and stopped by PID.

``flayer broker start --cluster N`` runs it over the same state folder as a single Mosquitto
(``mqtt_broker.state``): the same ``passwd`` hashes and ACL (rendered by :mod:`mqtt_broker.acl`) are
handed to every node in ``cluster/aedes.json``, and each node (``mqtt_broker/aedes/node.mjs``) enforces
them as Mosquitto does -- no anonymous clients, client id = username, ACL checked on publish and on every
delivery (retained messages included), ``max_packet_size``, QoS 1, retained messages, persistent sessions.
Retained messages, subscriptions and queued QoS 1 messages live in Redis, so they are the same on every
node; a message published on one node reaches the subscribers of every other one.

Layout under the state folder (``cluster/``, mode 0700)::

    cluster.json     nodes, their ports, Redis's port (no secrets)
    aedes.json       what every node reads: hashes, ACL, limits, Redis address and password (0600)
    redis.conf       Redis's configuration, with its password (0600)
    redis/           Redis's data (append-only file when persistence is on)
    run.json         PID, command line and start time of Redis and of every node
    node-K.log, redis.log

Credentials files name one node as ``host``/``port`` and the other nodes as ``failover`` (tried in turn by
:class:`transport.link.MqttLink` when the connection is lost): the coordinator and the observers connect
to node 0 first, each device to node ``1 + crc32(id) mod (N - 1)`` (node 0 when N = 1), so the devices
sit on other nodes than the coordinator.

Limits: no TLS listener (``--tls`` with ``--cluster`` is refused); ``max_queued_messages``/bytes are not
enforced by Aedes; an Aedes node acknowledges a QoS 1 PUBLISH before it has handed it to Redis, so a
message in flight when a node dies can be lost -- FLAYER Edge's own acks (the coordinator acknowledges
every update, devices resend until acknowledged) keep the accounting exact.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mqtt_broker.cluster_files import (
    ClusterFiles,
    Layout,
    node_of,
    redis_password,
    sync_cluster_files,
    write_redis_conf,
)
from mqtt_broker.config import BrokerConfig, BrokerConfigError
from mqtt_broker.fsutil import atomic_write, find_executable, free_port, listens, port_in_use, private_dir
from mqtt_broker.process import (
    BrokerError,
    RunRecord,
    _is_ours,
    _log_tail,
    _proc_argv,
    _proc_start_ticks,
    recorded_process,
)
from mqtt_broker.state import BrokerFiles, write_broker_files

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "MAX_NODES",
    "ClusterBroker",
    "ClusterFiles",
    "ClusterRecord",
    "cluster_missing",
    "node_of",
    "recorded_cluster",
    "reload_recorded_cluster",
    "start_cluster",
    "stop_recorded_cluster",
    "sync_cluster_files",
]

log = logging.getLogger(__name__)

MAX_NODES = 16
AEDES_DIR = Path(__file__).resolve().parent / "aedes"
NODE_PROGRAM = AEDES_DIR / "node.mjs"


def cluster_missing() -> str | None:
    """Why a cluster cannot start here (what to install), or None."""
    if find_executable("node") is None:
        return "node is not installed (Debian: apt-get install nodejs npm; Node.js 20 or newer)"
    if find_executable("redis-server") is None:
        return "redis-server is not installed (Debian: apt-get install redis-server)"
    if not (AEDES_DIR / "node_modules" / "aedes").is_dir():
        return f"the Aedes packages are not installed (run: npm ci --prefix {AEDES_DIR}, or make apt-cluster)"
    return None


@dataclass(frozen=True)
class ClusterRecord:
    """``cluster/run.json``: Redis's and every node's run record (index = node number)."""

    redis: RunRecord
    nodes: tuple[RunRecord, ...]

    @classmethod
    def load(cls, path: Path) -> ClusterRecord | None:
        try:
            data = json.loads(path.read_text())
            return cls(RunRecord(**data["redis"]), tuple(RunRecord(**n) for n in data["nodes"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BrokerError(f"{path}: unreadable run record ({exc}); remove it if no cluster runs") from exc

    def save(self, path: Path) -> None:
        data = {"redis": asdict(self.redis), "nodes": [asdict(n) for n in self.nodes]}
        atomic_write(path, json.dumps(data, indent=2) + "\n", mode=0o600)

    def alive(self) -> list[RunRecord]:
        return [r for r in (self.redis, *self.nodes) if _is_ours(r)]


def recorded_cluster(state_dir: str | Path) -> ClusterRecord | None:
    """The cluster recorded in ``state_dir`` if any of its processes still runs; a stale record is removed."""
    files = ClusterFiles.at(state_dir)
    rec = ClusterRecord.load(files.run_record)
    if rec is None:
        return None
    if rec.alive():
        return rec
    files.run_record.unlink(missing_ok=True)
    return None


def _stop_pids(records: list[RunRecord], timeout: float) -> None:
    for r in records:
        if _is_ours(r):
            os.kill(r.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_is_ours(r) for r in records):
        time.sleep(0.02)
    for r in records:
        if _is_ours(r):
            log.warning("%s pid %d ignored SIGTERM for %.0f s; killing it", r.kind, r.pid, timeout)
            os.kill(r.pid, signal.SIGKILL)


def stop_recorded_cluster(state_dir: str | Path, timeout: float = 10.0) -> ClusterRecord | None:
    """Stop the recorded cluster's nodes, then its Redis (exactly those PIDs); None if none ran."""
    files = ClusterFiles.at(state_dir)
    rec = recorded_cluster(files.state_dir)
    if rec is None:
        return None
    _stop_pids(list(rec.nodes), timeout)
    _stop_pids([rec.redis], timeout)
    files.run_record.unlink(missing_ok=True)
    return rec


RELOADED = ("reloaded passwords and ACL", "reload failed")  # what a node logs once it has handled a SIGHUP


def _reloads(log: Path) -> int:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return 0
    return sum(text.count(line) for line in RELOADED)


def reload_recorded_cluster(state_dir: str | Path, wait_s: float = 5.0) -> ClusterRecord | None:
    """Rewrite ``aedes.json`` and the credentials, then make every running node re-read them (SIGHUP) and wait,
    at most ``wait_s``, until each has logged that it did: a rotated or removed user's connections are closed by
    then, so what its old credentials send after this returns does not get through."""
    files = ClusterFiles.at(state_dir)
    rec = recorded_cluster(state_dir)
    sync_cluster_files(state_dir)
    if rec is not None:
        signalled = {i: _reloads(files.node_log(i)) for i, r in enumerate(rec.nodes) if _is_ours(r)}
        for i in signalled:
            os.kill(rec.nodes[i].pid, signal.SIGHUP)
        end = time.monotonic() + wait_s
        while signalled and time.monotonic() < end:
            signalled = {i: n for i, n in signalled.items() if _reloads(files.node_log(i)) <= n}
            if signalled:
                time.sleep(0.05)
        if signalled:
            log.warning("cluster node(s) %s did not confirm the reload within %.0f s", sorted(signalled), wait_s)
    return rec


def _redis_ping(port: int, password: str) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            data = b""
            while data.count(b"\r\n") < 2:
                chunk = s.recv(256)
                if not chunk:
                    return False
                data += chunk
            return data.endswith(b"+PONG\r\n")
    except OSError:
        return False


class ClusterBroker:
    """The running cluster (a context manager, like :class:`mqtt_broker.process.ManagedBroker`)."""

    kind = "cluster"

    def __init__(self, state_dir: str | Path, detach: bool = False) -> None:
        self.files = ClusterFiles.at(state_dir)
        self.config = BrokerConfig.load(BrokerFiles.at(state_dir).config)
        layout = Layout.load(self.files.layout)
        if layout is None:
            raise BrokerConfigError(f"{self.files.layout}: no cluster set up here")
        self.layout = layout
        self.detach = detach
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # -1 = redis
        self.record: ClusterRecord | None = None

    @property
    def ports(self) -> tuple[int, ...]:
        return self.layout.ports

    @property
    def port(self) -> int:
        return self.layout.ports[0]

    @property
    def pid(self) -> int:
        if self.record is None:
            raise BrokerError("cluster not started")
        return self.record.nodes[0].pid

    def _spawn(self, key: int, argv: list[str], logpath: Path) -> RunRecord:
        with open(logpath, "ab") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting\n".encode())
            fh.flush()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                    cwd=self.files.folder, start_new_session=True)
        self._procs[key] = proc
        port = self.layout.redis_port if key < 0 else self.layout.ports[key]
        return RunRecord(proc.pid, "redis" if key < 0 else "aedes", argv, _proc_start_ticks(proc.pid) or 0,
                         "127.0.0.1" if key < 0 else self.config.plain_host, port, 0, time.time())

    def _wait(self, key: int, ready: Any, what: str, logpath: Path, timeout: float) -> None:
        proc = self._procs[key]
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                raise BrokerError(f"{what} exited with code {proc.returncode} while starting; its log ({logpath}):\n"
                                  f"{_log_tail(logpath, 0)}")
            if time.monotonic() > deadline:
                raise BrokerError(f"{what} was not ready within {timeout:.0f} s; its log ({logpath}):\n"
                                  f"{_log_tail(logpath, 0)}")
            time.sleep(0.03)

    def start_node(self, i: int, timeout: float = 30.0) -> RunRecord:
        """Start node ``i`` (again, e.g. after :meth:`kill_node`) and wait until it accepts connections."""
        cfg = self.config
        port = self.layout.ports[i]
        if port_in_use(cfg.plain_host, port):
            raise BrokerError(f"port {port} on {cfg.plain_host} is already in use (node {i})")
        node = find_executable("node")
        assert node is not None
        argv = [node, str(NODE_PROGRAM), "--config", str(self.files.node_config), "--port", str(port),
                "--name", f"node-{i}"]
        rec = self._spawn(i, argv, self.files.node_log(i))
        # the node itself must hold the port: another server may have taken it since the check above
        self._wait(i, lambda: listens(rec.pid, cfg.connect_host, port, connect=True), f"aedes node {i}",
                   self.files.node_log(i), timeout)
        rec = replace(rec, start_ticks=_proc_start_ticks(rec.pid) or 0)
        if self.record is not None:
            nodes = list(self.record.nodes)
            nodes[i] = rec
            self.record = replace(self.record, nodes=tuple(nodes))
            self.record.save(self.files.run_record)
        return rec

    def start(self, timeout: float = 30.0) -> Self:
        missing = cluster_missing()
        if missing:
            raise BrokerError(f"cannot start a broker cluster: {missing}")
        sync_cluster_files(self.files.state_dir)  # makes Redis's password on the first start
        password = redis_password(self.files)
        write_redis_conf(self.files, self.config, self.layout.redis_port, password)
        if port_in_use("127.0.0.1", self.layout.redis_port):
            raise BrokerError(f"port {self.layout.redis_port} (redis) is already in use")
        redis = find_executable("redis-server")
        assert redis is not None
        try:
            rrec = self._spawn(-1, [redis, str(self.files.redis_conf)], self.files.redis_log)
            self._wait(-1, lambda: _redis_ping(self.layout.redis_port, password), "redis-server",
                       self.files.redis_log, timeout)
            # redis-server rewrites its command line ("redis-server 127.0.0.1:PORT"): record what /proc shows
            rrec = replace(rrec, argv=_proc_argv(rrec.pid) or rrec.argv, start_ticks=_proc_start_ticks(rrec.pid) or 0)
            nodes = [self.start_node(i, timeout) for i in range(len(self.layout.ports))]
        except BaseException:
            self._terminate_all(2.0)
            raise
        self.record = ClusterRecord(rrec, tuple(nodes))
        self.record.save(self.files.run_record)
        log.info("broker cluster of %d aedes node(s) on ports %s, redis pid %d", len(nodes),
                 ", ".join(map(str, self.ports)), rrec.pid)
        return self

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> int:
        """Signal node ``i`` (default SIGKILL: a crash) by its PID and reap it; returns the PID."""
        proc = self._procs.get(i)
        if proc is None or proc.poll() is not None:
            raise BrokerError(f"node {i} is not running")
        os.kill(proc.pid, sig)
        proc.wait(10)
        return proc.pid

    def reload(self) -> None:
        reload_recorded_cluster(self.files.state_dir)

    def is_running(self) -> bool:
        return self.record is not None and all(_is_ours(r) for r in (self.record.redis, *self.record.nodes))

    def _terminate_all(self, timeout: float) -> None:
        for key in sorted(self._procs, reverse=True):  # the nodes, then redis (-1)
            proc = self._procs[key]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5.0)
        self._procs.clear()

    def stop(self, timeout: float = 10.0) -> None:
        if self._procs:
            self._terminate_all(timeout)
            self.files.run_record.unlink(missing_ok=True)
        elif self.record is not None:
            stop_recorded_cluster(self.files.state_dir, timeout)

    def __enter__(self) -> Self:
        return self.start() if self.record is None else self

    def __exit__(self, *exc: object) -> None:
        if not self.detach:
            self.stop()


def start_cluster(cfg: BrokerConfig, state_dir: str | Path, nodes: int, detach: bool = False,
                  timeout: float = 30.0) -> ClusterBroker:
    """Write the state folder's files for ``cfg`` (as for Mosquitto), then start Redis and ``nodes`` Aedes
    nodes on it: node 0 on ``cfg.port``, the others on the ports stored from an earlier start, else free ones."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
        raise BrokerConfigError(f"--cluster must be a node count in 1-{MAX_NODES}, got {nodes!r}")
    if cfg.tls:
        raise BrokerConfigError("the broker cluster has no TLS listener; run it without --tls (see "
                                "docs/howto/clustered-broker.md)")
    if not cfg.plain:
        raise BrokerConfigError("the broker cluster needs the plain listener")
    missing = cluster_missing()
    if missing:
        raise BrokerError(f"cannot start a broker cluster: {missing}")
    files = ClusterFiles.at(state_dir)
    if BrokerFiles.at(state_dir).run_record.exists() and recorded_process(state_dir) is not None:
        raise BrokerError(f"a single broker already runs for {files.state_dir}; stop it first")
    running = recorded_cluster(state_dir)
    if running is not None:
        raise BrokerError(f"a broker cluster already runs for {files.state_dir} (ports "
                          f"{', '.join(str(n.port) for n in running.nodes)}); stop it first")
    bfiles = write_broker_files(cfg, state_dir)
    cfg = BrokerConfig.load(bfiles.config)
    private_dir(files.folder)
    old = Layout.load(files.layout)
    ports = [cfg.port]
    for i in range(1, nodes):
        port = old.ports[i] if old and i < len(old.ports) and old.ports[i] not in ports else 0
        while not port or port in ports:
            port = free_port(cfg.plain_host)
        ports.append(port)
    redis_port = old.redis_port if old and old.redis_port not in ports else 0
    while not redis_port or redis_port in ports:
        redis_port = free_port("127.0.0.1")
    Layout(tuple(ports), redis_port).save(files.layout)
    return ClusterBroker(state_dir, detach).start(timeout)
