"""``flayer broker start|stop|status|add-device|revoke``: the federation's MQTT broker.

``start`` writes the configuration into the state folder and runs mosquitto (or the embedded
broker) in the background, recording its PID; ``stop`` ends exactly that process; ``add-device``
creates a device's credentials file (``--kit``: and its startup kit for another machine) and makes
a running broker reload its password file; ``revoke`` shuts a device out (password, certificate,
live connection) and tells the coordinator to stop selecting it. Passwords are never printed:
only the paths of the 0600 credentials files and kits are.

Field gateway (:mod:`mqtt_broker.bridge`): on the central broker, ``add-device SITE --gateway-for
DEV,...`` creates the credentials of a site's gateway, allowed exactly the topics of those devices;
on the site, ``start --gateway-credentials FILE [--gateway-to HOST:PORT]`` bridges the site broker
to the central one (stored: later starts keep the bridge; ``--no-gateway`` drops it). ``start --cluster N`` runs N Aedes nodes
sharing one Redis instead of one Mosquitto (docs/howto/clustered-broker.md); ``stop``, ``status`` and
the other actions handle the cluster recorded in the state folder.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.broker_flags import add_broker_parser
from cli.broker_users import _add_observer, _close_identity, _published, _rekey, _reload, _revoke
from cli.common import CliError

if TYPE_CHECKING:
    from mqtt_broker.config import BrokerConfig

SUBCOMMANDS = ("start", "stop", "status", "add-device", "add-observer", "revoke", "rekey")


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_broker_parser(sub, run, (__doc__ or "").splitlines()[0])


def _config(args: argparse.Namespace, stored_path: Path) -> BrokerConfig:
    from mqtt_broker.config import DEFAULT_PORT, DEFAULT_TLS_PORT, BrokerConfig

    stored = BrokerConfig.load(stored_path) if stored_path.exists() else None
    base = stored or BrokerConfig(port=DEFAULT_PORT, tls_port=DEFAULT_TLS_PORT)
    changes = {k: v for k, v in (("federation", args.federation), ("host", args.host), ("port", args.port),
                                 ("tls", args.tls), ("tls_port", args.tls_port), ("tls_host", args.tls_host),
                                 ("plain", args.plain), ("insecure_plain", args.insecure_plain),
                                 ("require_certificate", args.require_certificate),
                                 ("use_identity_as_username", args.use_identity_as_username),
                                 ("advertise_host", args.advertise_host), ("max_packet_size", args.max_packet_size),
                                 ("persistence", args.persistence),
                                 ("max_connections", args.max_connections)) if v is not None}
    if stored and "federation" in changes and changes["federation"] != stored.federation:
        raise CliError(f"{stored_path.parent} serves federation {stored.federation!r}; "
                       f"use another --state-dir for {changes['federation']!r}")
    if changes.get("tls") and not base.tls and "tls_port" not in changes and not base.tls_port:
        changes["tls_port"] = DEFAULT_TLS_PORT
    return replace(base, **changes)


def run(args: argparse.Namespace) -> int:
    from mqtt_broker.config import BrokerConfigError
    from mqtt_broker.crl import CrlError
    from mqtt_broker.passwords import PasswordError
    from mqtt_broker.process import BrokerError
    from mqtt_broker.tls import TlsError

    try:
        return {"start": _start, "stop": _stop, "status": _status, "add-device": _add_device,
                "add-observer": _add_observer, "revoke": _revoke, "rekey": _rekey}[args.broker_command](args)
    except (BrokerConfigError, BrokerError, CrlError, PasswordError, TlsError) as exc:
        raise CliError(str(exc)) from exc


def _start(args: argparse.Namespace) -> int:
    from mqtt_broker.start import start_broker
    from mqtt_broker.state import BrokerFiles

    files = BrokerFiles.at(args.state_dir)
    cfg = _config(args, files.config)
    _gateway_flags(args, files.state_dir, cfg)
    if args.print_unit:  # a service runs the broker in the foreground (cli.unit)
        from cli.unit import UNIT_FILES, print_unit

        return print_unit(args, "broker", [files.state_dir], f"federation {cfg.federation}",
                          [] if args.foreground else ["--foreground"], open_files=cfg.open_files_wanted + UNIT_FILES)
    done = threading.Event()
    if args.foreground:  # before the start, so an early Ctrl-C still stops the broker below
        previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    from mqtt_broker.cluster import ClusterFiles, recorded_cluster, start_cluster

    if args.cluster:
        broker: Any = start_cluster(cfg, files.state_dir, args.cluster, detach=not args.foreground)
    else:
        running = recorded_cluster(files.state_dir)
        if running is not None:
            raise CliError(f"a broker cluster runs for {files.state_dir}; stop it first (flayer broker stop)")
        # a single broker over a folder that once held a cluster: credentials go back to one address
        ClusterFiles.at(files.state_dir).layout.unlink(missing_ok=True)
        broker = start_broker(cfg, files.state_dir, kind=args.kind, detach=not args.foreground)
    cfg = broker.config
    tls = f", TLS {cfg.tls_host or cfg.host}:{cfg.tls_port}" if cfg.tls else ""
    plain = f"plain {cfg.plain_host}:{cfg.port}" if cfg.plain else "plain listener off"
    if args.cluster:
        rec = broker.record
        head = [(f"broker cluster running: {len(broker.ports)} aedes node(s), federation {cfg.federation}, redis pid "
                 f"{rec.redis.pid} on 127.0.0.1:{rec.redis.port}")]
        head += [f"  node {i}: pid {n.pid}, plain {cfg.plain_host}:{n.port}" for i, n in enumerate(rec.nodes)]
    else:
        head = [f"{broker.kind} broker running: pid {broker.pid}, federation {cfg.federation}, {plain}{tls}"]
    lines = [*head,
             f"state folder:            {files.state_dir}",
             f"coordinator credentials: {files.credentials(cfg.coordinator_user)}",
             f"log:                     {files.state_dir / 'cluster/node-*.log' if args.cluster else files.log}"]
    if (files.state_dir / "revocation_list.json").exists():  # retained: a broker without persistence forgot it
        lines.append(_published(files.state_dir))
    if cfg.warning:
        lines.append(f"WARNING: {cfg.warning}")
    if broker.kind == "embedded":
        lines.append("embedded broker: max_packet_size, queue limits, persistence and TLS are NOT enforced (see docs/explanation/broker.md)")
    if not args.foreground:
        print("\n".join([*lines, f"stop it with: flayer broker stop --state-dir {files.state_dir}"]))
        return 0
    try:
        print("\n".join([*lines, "Ctrl-C stops it"]), flush=True)
        follow = _LogFollower(files.state_dir / "cluster/node-0.log" if args.cluster else files.log)
        while not done.wait(0.5):
            follow.copy()
            if not broker.is_running():
                print("flayer broker: the broker exited on its own; see its log", file=sys.stderr)
                return 1
    finally:
        broker.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("broker stopped")
    return 0


def _gateway_flags(args: argparse.Namespace, state_dir: Path, cfg: BrokerConfig) -> None:
    """Store, change or drop the site's bridge before the files are written (mqtt_broker.bridge)."""
    from mqtt_broker.bridge import parse_restart, remove_gateway, set_gateway

    given = [f for f, v in (("--gateway-credentials", args.gateway_credentials), ("--gateway-to", args.gateway_to),
                            ("--gateway-keepalive", args.gateway_keepalive), ("--gateway-retry", args.gateway_retry))
             if v is not None]
    if args.no_gateway:
        if given:
            raise CliError(f"--no-gateway drops the bridge; it cannot go with {', '.join(given)}")
        if remove_gateway(state_dir):
            print(f"gateway dropped: {state_dir} is a stand-alone broker again")
        return
    if not given:
        return
    if args.kind == "embedded":
        raise CliError("a field gateway's bridge needs mosquitto; --embedded has no bridges")
    retry = parse_restart(args.gateway_retry) if args.gateway_retry is not None else None
    gw = set_gateway(state_dir, cfg, Path(args.gateway_credentials) if args.gateway_credentials else None,
                     args.gateway_to, args.gateway_keepalive, retry)
    print(f"gateway: this site bridges to {gw.host}:{gw.port}{' over TLS' if gw.tls else ''}")


class _LogFollower:
    """``--foreground``: the broker's log lines, as they come, copied to stderr (the journal under systemd)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.at = path.stat().st_size if path.exists() else 0

    def copy(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.at)
                data = fh.read(1 << 20)
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # whole lines only
        if end:
            self.at += end
            sys.stderr.write(data[:end].decode(errors="replace"))
            sys.stderr.flush()


def _stop(args: argparse.Namespace) -> int:
    from mqtt_broker.cluster import stop_recorded_cluster
    from mqtt_broker.process import stop_recorded

    if args.timeout <= 0:
        raise CliError(f"--timeout must be > 0, got {args.timeout}")
    cluster = stop_recorded_cluster(args.state_dir, timeout=args.timeout)
    if cluster is not None:
        pids = ", ".join(str(n.pid) for n in cluster.nodes)
        print(f"stopped broker cluster: aedes node pid(s) {pids}, redis pid {cluster.redis.pid}")
        return 0
    rec = stop_recorded(args.state_dir, timeout=args.timeout)
    if rec is None:
        print(f"no running broker recorded in {Path(args.state_dir)}")
        return 0
    print(f"stopped {rec.kind} broker pid {rec.pid} (port {rec.port})")
    return 0


def _status(args: argparse.Namespace) -> int:
    from mqtt_broker.config import BrokerConfig
    from mqtt_broker.process import recorded_process
    from mqtt_broker.state import BrokerFiles, list_users

    files = BrokerFiles.at(args.state_dir)
    cfg = BrokerConfig.load(files.config)
    from mqtt_broker.cluster import recorded_cluster
    from mqtt_broker.process import _is_ours

    cluster = recorded_cluster(files.state_dir)
    rec: Any = recorded_process(files.state_dir)
    if cluster is not None:
        up = [_is_ours(n) for n in cluster.nodes]
        whole = all(up) and _is_ours(cluster.redis)
        print(f"broker:     {'running' if whole else 'DEGRADED'} (cluster of {len(up)} aedes node(s), "
              f"{sum(up)} up; redis pid {cluster.redis.pid} {'up' if _is_ours(cluster.redis) else 'DOWN'})")
        for i, n in enumerate(cluster.nodes):
            print(f"  node {i}:   {cfg.plain_host}:{n.port} pid {n.pid} {'up' if up[i] else 'DOWN'}")
        rec = cluster if whole else None
    else:
        state = f"running ({rec.kind}, pid {rec.pid})" if rec else "not running"
        print(f"broker:     {state}")
    print(f"federation: {cfg.federation}")
    plain = f"{cfg.plain_host}:{cfg.port}" if cfg.plain else "plain off"
    print(f"listener:   {plain}" + (f", TLS {cfg.tls_host or cfg.host}:{cfg.tls_port}" if cfg.tls else ""))
    print(f"limits:     max_packet_size {cfg.max_packet_size} (payload <= {cfg.max_payload}), "
          f"max_inflight {cfg.max_inflight_messages}, max_queued {cfg.max_queued_messages} / {cfg.max_queued_bytes} B")
    users = list_users(files.state_dir)
    print(f"users:      {len(users)} ({sum(r == 'device' for _, r in users)} devices)")
    for user, role in users:
        print(f"  {role:<11} {user:<24} {files.credentials(user)}")
    from mqtt_broker.bridge import describe

    for line in describe(files.state_dir):
        print(line)
    return 0 if rec else 3


def _add_device(args: argparse.Namespace) -> int:
    from mqtt_broker.state import BrokerFiles, add_device

    files = BrokerFiles.at(args.state_dir)
    if args.gateway_for:
        return _add_gateway(args, files)
    if args.device_keys:
        raise CliError("--device-keys goes with --gateway-for (the public keys of a site's devices)")
    if args.allow_entry_point and not args.kit:
        raise CliError("--allow-entry-point goes into a startup kit's device.toml: give --kit FILE.tar.gz too (or "
                       "list the entry point in the device's own device.toml, [edge] allow_entry_points)")
    if args.kit:  # checked before the device is created
        from flayer.spec import ENTRY_POINT

        bad = [e for e in args.allow_entry_point if not ENTRY_POINT.fullmatch(e)]
        if bad:
            raise CliError(f"--allow-entry-point {bad[0]!r} is not an entry point \"package.module:function\" (the "
                           f"built-in models are always allowed)")
    creds = add_device(files.state_dir, args.device_id, rotate=args.rotate)
    if args.rotate:  # a new key: a new certificate, the old one on the authority's revocation list
        from mqtt_broker.rekey import recertify

        recertify(files.state_dir, creds.username)
    from mqtt_broker.cluster import ClusterFiles, sync_cluster_files

    if ClusterFiles.at(files.state_dir).layout.exists():  # its node and the failover nodes, before the kit
        sync_cluster_files(files.state_dir)
    out: list[str] = []  # the broker drops the old password (and certificate) before anything is printed
    if _reload(files.state_dir, out=out) and args.rotate:
        _close_identity(files.state_dir, creds.username, out)  # the copied old kit's open TLS connection
    print(f"credentials of device {creds.username}: {files.credentials(creds.username)} (mode 0600, holds the password)")
    if args.kit:
        from mqtt_broker.kit import write_kit

        kit = write_kit(files.state_dir, creds.username, args.kit, args.allow_entry_point)
        print(f"startup kit: {kit} (mode 0600, holds the password: copy it to the device privately, then run "
              f"'flayer edge --kit {kit.name} --data FOLDER' there)")
    if args.rotate:
        out.append(_published(files.state_dir))
    if out:
        print("\n".join(out))
    return 0


def _add_gateway(args: argparse.Namespace, files: Any) -> int:
    from mqtt_broker.bridge import read_gateways
    from mqtt_broker.state import add_gateway

    if args.kit or args.allow_entry_point:
        raise CliError("--gateway-for creates a gateway's credentials; --kit and --allow-entry-point are for devices "
                       "(write the devices' kits on the site broker)")
    devices = [d.strip() for item in args.gateway_for for d in item.split(",")]
    creds = add_gateway(files.state_dir, args.device_id, devices, rotate=args.rotate,
                        device_keys=Path(args.device_keys) if args.device_keys else None)
    served = read_gateways(files.state_dir)[creds.username]
    print(f"credentials of gateway {creds.username}: {files.credentials(creds.username)} (mode 0600, holds the "
          f"password); it serves {len(served)} device(s): {', '.join(served)}")
    print(f"on the site: flayer broker start --state-dir SITE_DIR --gateway-credentials {creds.username}.toml "
          f"[--gateway-to HOST:PORT]")
    _reload(files.state_dir)
    return 0
