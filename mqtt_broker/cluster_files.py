"""The clustered broker's files under the state folder (``cluster/``): where each one lives, the node ports,
which node each user connects to first, and bringing ``aedes.json`` and the credentials files up to date
with the state folder's users, hashes and ACL. :mod:`mqtt_broker.cluster` starts, stops and reloads the
processes that read them.
"""

from __future__ import annotations

import json
import secrets
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from mqtt_broker.acl import parse_acl
from mqtt_broker.config import BrokerConfig, BrokerConfigError
from mqtt_broker.fsutil import atomic_write, private_dir
from mqtt_broker.passwords import read_passwd
from mqtt_broker.state import BrokerFiles, list_users, save_credentials
from transport.credentials import Credentials

__all__ = ["ClusterFiles", "Layout", "node_of", "sync_cluster_files", "write_redis_conf"]


@dataclass(frozen=True)
class ClusterFiles:
    state_dir: Path

    @classmethod
    def at(cls, state_dir: str | Path) -> ClusterFiles:
        return cls(BrokerFiles.at(state_dir).state_dir)

    folder = property(lambda self: self.state_dir / "cluster")
    layout = property(lambda self: self.folder / "cluster.json")
    node_config = property(lambda self: self.folder / "aedes.json")
    redis_conf = property(lambda self: self.folder / "redis.conf")
    redis_dir = property(lambda self: self.folder / "redis")
    redis_log = property(lambda self: self.folder / "redis.log")
    run_record = property(lambda self: self.folder / "run.json")

    def node_log(self, i: int) -> Path:
        return self.folder / f"node-{i}.log"


def node_of(user: str, role: str, nodes: int) -> int:
    """The node a user connects to first: 0 for the coordinator and observers, another one for devices."""
    if role != "device" or nodes == 1:
        return 0
    return 1 + zlib.crc32(user.encode()) % (nodes - 1)


@dataclass(frozen=True)
class Layout:
    """``cluster.json``: the node ports (node 0 = the state folder's ``port``) and Redis's port."""

    ports: tuple[int, ...]
    redis_port: int

    @classmethod
    def load(cls, path: Path) -> Layout | None:
        try:
            data = json.loads(path.read_text())
            layout = cls(tuple(data["ports"]), data["redis_port"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BrokerConfigError(f"{path}: unreadable cluster layout ({exc})") from exc
        if not all(isinstance(p, int) and 1 <= p <= 65535 for p in (*layout.ports, layout.redis_port)):
            raise BrokerConfigError(f"{path}: ports must be integers in 1-65535")
        return layout

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps({"ports": list(self.ports), "redis_port": self.redis_port}, indent=2) + "\n")


def redis_password(files: ClusterFiles) -> str:
    """Redis's password, made once and kept in ``aedes.json`` (0600)."""
    try:
        return str(json.loads(files.node_config.read_text())["redis"]["password"])
    except (OSError, ValueError, KeyError, TypeError):
        return secrets.token_urlsafe(24)


def sync_cluster_files(state_dir: str | Path) -> None:
    """Bring ``aedes.json`` (hashes, ACL) and every credentials file (node and failover addresses) up to
    date with the state folder; run after a device or observer is added or revoked, before the reload."""
    files = ClusterFiles.at(state_dir)
    bfiles = BrokerFiles.at(state_dir)
    layout = Layout.load(files.layout)
    if layout is None:
        raise BrokerConfigError(f"{files.layout}: no cluster set up here (flayer broker start --cluster N)")
    cfg = BrokerConfig.load(bfiles.config)
    acl = parse_acl(bfiles.acl.read_text())
    node_cfg = {
        "federation": cfg.federation,
        "host": cfg.plain_host,
        "max_packet_size": cfg.max_packet_size,
        "persistence": cfg.persistence,
        "redis": {"host": "127.0.0.1", "port": layout.redis_port, "password": redis_password(files)},
        "passwd": read_passwd(bfiles.passwd),
        "acl": {"users": {u: [list(r) for r in rules] for u, rules in acl.users.items()},
                "patterns": [list(r) for r in acl.patterns]},
    }
    atomic_write(files.node_config, json.dumps(node_cfg, indent=1, sort_keys=True) + "\n", mode=0o600)
    host = cfg.connect_host
    n = len(layout.ports)
    for user, role in list_users(state_dir):
        path = bfiles.credentials(user)
        creds = Credentials.load(path)
        first = node_of(user, role, n)
        order = [layout.ports[(first + k) % n] for k in range(n)]
        want = replace(creds, host=host, port=order[0], failover=tuple((host, p) for p in order[1:]))
        if want != creds:
            save_credentials(want, path)


def write_redis_conf(files: ClusterFiles, cfg: BrokerConfig, port: int, password: str) -> None:
    private_dir(files.redis_dir)
    lines = [
        "# Redis of a FLAYER Edge broker cluster, written by 'flayer broker start --cluster' (mqtt_broker.cluster).",
        "bind 127.0.0.1",
        f"port {port}",
        "protected-mode yes",
        f"requirepass {password}",
        "daemonize no",
        f"dir {files.redis_dir}",
        'save ""',
        f"appendonly {'yes' if cfg.persistence else 'no'}",
        "appendfsync everysec",
        "loglevel notice",
        'logfile ""',
    ]
    atomic_write(files.redis_conf, "\n".join(lines) + "\n", mode=0o600)
