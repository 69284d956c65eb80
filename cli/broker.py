"""``flayer broker start|stop|status|add-device|revoke``: the federation's MQTT broker.

``start`` writes the configuration into the state folder and runs mosquitto (or the embedded
broker) in the background, recording its PID; ``stop`` ends exactly that process; ``add-device``
creates a device's credentials file (``--kit``: and its startup kit for another machine) and makes
a running broker reload its password file; ``revoke`` shuts a device out (password, certificate,
live connection) and tells the coordinator to stop selecting it. Passwords are never printed:
only the paths of the 0600 credentials files and kits are.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from cli.common import CliError

if TYPE_CHECKING:
    from mqtt_broker.config import BrokerConfig

SUBCOMMANDS = ("start", "stop", "status", "add-device", "add-observer", "revoke")


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _state_dir_flag(p: argparse.ArgumentParser) -> None:
    from mqtt_broker.config import DEFAULT_STATE_DIR

    p.add_argument("--state-dir", metavar="DIR", default=str(DEFAULT_STATE_DIR),
                   help=f"folder holding the broker's configuration, passwords and credentials (default {DEFAULT_STATE_DIR})")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("broker", help="run the federation's MQTT broker (mosquitto, or the embedded fallback)",
                       description=__doc__.splitlines()[0])
    actions = p.add_subparsers(dest="broker_command", metavar="ACTION")
    actions.required = True

    s = actions.add_parser("start", help="write the configuration and start the broker in the background")
    _state_dir_flag(s)
    s.add_argument("--federation", metavar="F", help="federation id (default: the stored one, else 'default')")
    s.add_argument("--host", metavar="ADDR", help="listen address (default 127.0.0.1; 0.0.0.0 for every interface); "
                   "with --tls the plain listener stays on loopback unless --insecure-plain")
    s.add_argument("--port", type=_nonneg_int, metavar="P", help="MQTT port (default: stored, else 1883; 0 = a free one)")
    s.add_argument("--tls", action=argparse.BooleanOptionalAction, default=None,
                   help="also open a TLS listener (own CA, client certificates)")
    s.add_argument("--tls-port", type=_nonneg_int, metavar="P", help="TLS port (default: stored, else 8883; 0 = a free one)")
    s.add_argument("--tls-host", metavar="ADDR", help="TLS listen address (default: --host)")
    s.add_argument("--plain", action=argparse.BooleanOptionalAction, default=None,
                   help="the plain (password only) listener; --no-plain needs --tls (default: on)")
    s.add_argument("--insecure-plain", action=argparse.BooleanOptionalAction, default=None,
                   help="with --tls, keep the plain listener on --host even off loopback (a password alone "
                        "opens it; a warning is logged)")
    s.add_argument("--require-certificate", action=argparse.BooleanOptionalAction, default=None,
                   help="TLS clients must present a certificate of the federation CA (default: yes)")
    s.add_argument("--identity-as-username", dest="use_identity_as_username", action=argparse.BooleanOptionalAction,
                   default=None, help="on the TLS listener, the certificate's CN is the username (no password asked)")
    s.add_argument("--advertise-host", metavar="ADDR", help="address written into credentials files and the server certificate")
    s.add_argument("--max-packet-size", type=_nonneg_int, metavar="BYTES", help="largest MQTT packet (default 1048576)")
    s.add_argument("--persistence", action=argparse.BooleanOptionalAction, default=None,
                   help="save retained messages and queues to disk (default: yes)")
    kind = s.add_mutually_exclusive_group()
    kind.add_argument("--mosquitto", dest="kind", action="store_const", const="mosquitto", help="require mosquitto")
    kind.add_argument("--embedded", dest="kind", action="store_const", const="embedded",
                      help="run the embedded pure-Python broker (amqtt; loopback, no TLS, limits not enforced)")
    s.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the broker")
    s.set_defaults(func=run, kind="auto")

    t = actions.add_parser("stop", help="stop the broker recorded in the state folder (exactly that process)")
    _state_dir_flag(t)
    t.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds before SIGKILL (default 10)")
    t.set_defaults(func=run)

    st = actions.add_parser("status", help="show whether the recorded broker runs, its ports and users")
    _state_dir_flag(st)
    st.set_defaults(func=run)

    a = actions.add_parser("add-device", help="create a device's credentials file; a running broker reloads")
    _state_dir_flag(a)
    a.add_argument("device_id", metavar="ID", help="device id = its MQTT username and client id")
    a.add_argument("--rotate", action="store_true", help="issue a new password (and certificate) for an existing device")
    a.add_argument("--kit", metavar="FILE.tar.gz",
                   help="also write the device's startup kit (credentials, TLS files, device.toml, start command; "
                        "mode 0600) for 'flayer edge --kit' on the device's machine")
    a.set_defaults(func=run)

    o = actions.add_parser("add-observer", help="create another read-only observer (one per watcher running at "
                                                "once: flayer status, flayer dashboard); a running broker reloads")
    _state_dir_flag(o)
    o.add_argument("name", metavar="NAME", help="the observer's user name (the default one is 'observer')")
    o.add_argument("--rotate", action="store_true", help="issue a new password for an existing observer")
    o.set_defaults(func=run)

    r = actions.add_parser("revoke", help="shut a device out: password and certificate removed, broker reloaded "
                                          "(its connection closes), coordinator stops selecting it")
    _state_dir_flag(r)
    r.add_argument("device_id", metavar="ID", help="the device to revoke")
    r.set_defaults(func=run)


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
                                 ("persistence", args.persistence)) if v is not None}
    if stored and "federation" in changes and changes["federation"] != stored.federation:
        raise CliError(f"{stored_path.parent} serves federation {stored.federation!r}; "
                       f"use another --state-dir for {changes['federation']!r}")
    if changes.get("tls") and not base.tls and "tls_port" not in changes and not base.tls_port:
        changes["tls_port"] = DEFAULT_TLS_PORT
    return replace(base, **changes)


def run(args: argparse.Namespace) -> int:
    from mqtt_broker.config import BrokerConfigError
    from mqtt_broker.passwords import PasswordError
    from mqtt_broker.process import BrokerError
    from mqtt_broker.tls import TlsError

    try:
        return {"start": _start, "stop": _stop, "status": _status, "add-device": _add_device,
                "add-observer": _add_observer, "revoke": _revoke}[args.broker_command](args)
    except (BrokerConfigError, BrokerError, PasswordError, TlsError) as exc:
        raise CliError(str(exc)) from exc


def _start(args: argparse.Namespace) -> int:
    from mqtt_broker.process import start_broker
    from mqtt_broker.state import BrokerFiles

    files = BrokerFiles.at(args.state_dir)
    cfg = _config(args, files.config)
    done = threading.Event()
    if args.foreground:  # before the start, so an early Ctrl-C still stops the broker below
        previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    broker = start_broker(cfg, files.state_dir, kind=args.kind, detach=not args.foreground)
    cfg = broker.config
    tls = f", TLS {cfg.tls_host or cfg.host}:{cfg.tls_port}" if cfg.tls else ""
    plain = f"plain {cfg.plain_host}:{cfg.port}" if cfg.plain else "plain listener off"
    lines = [f"{broker.kind} broker running: pid {broker.pid}, federation {cfg.federation}, {plain}{tls}",
             f"state folder:            {files.state_dir}",
             f"coordinator credentials: {files.credentials(cfg.coordinator_user)}",
             f"log:                     {files.log}"]
    if cfg.warning:
        lines.append(f"WARNING: {cfg.warning}")
    if broker.kind == "embedded":
        lines.append("embedded broker: max_packet_size, queue limits, persistence and TLS are NOT enforced (see docs/explanation/broker.md)")
    if not args.foreground:
        print("\n".join([*lines, f"stop it with: flayer broker stop --state-dir {files.state_dir}"]))
        return 0
    try:
        print("\n".join([*lines, "Ctrl-C stops it"]), flush=True)
        while not done.wait(0.5):
            if not broker.is_running():
                print("flayer broker: the broker exited on its own; see its log", file=sys.stderr)
                return 1
    finally:
        broker.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("broker stopped")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from mqtt_broker.process import stop_recorded

    if args.timeout <= 0:
        raise CliError(f"--timeout must be > 0, got {args.timeout}")
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
    rec = recorded_process(files.state_dir)
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
    return 0 if rec else 3


def _reload(state_dir: Path, note: str = "") -> bool:
    """Make the running broker recorded in ``state_dir`` re-read its passwords and ACL (says so); False when
    none is recorded."""
    from mqtt_broker.process import reload_recorded

    rec = reload_recorded(state_dir)
    if rec is not None:
        print(f"reloaded the running {rec.kind} broker (pid {rec.pid}){note}")
    return rec is not None


def _add_observer(args: argparse.Namespace) -> int:
    from mqtt_broker.state import BrokerFiles, add_observer

    files = BrokerFiles.at(args.state_dir)
    creds = add_observer(files.state_dir, args.name, rotate=args.rotate)
    print(f"credentials of observer {creds.username}: {files.credentials(creds.username)} (read-only; pass it to "
          f"'flayer status --credentials' or 'flayer dashboard --credentials')")
    _reload(files.state_dir)
    return 0


def _add_device(args: argparse.Namespace) -> int:
    from mqtt_broker.state import BrokerFiles, add_device

    files = BrokerFiles.at(args.state_dir)
    creds = add_device(files.state_dir, args.device_id, rotate=args.rotate)
    print(f"credentials of device {creds.username}: {files.credentials(creds.username)} (mode 0600, holds the password)")
    if args.kit:
        from mqtt_broker.kit import write_kit

        kit = write_kit(files.state_dir, creds.username, args.kit)
        print(f"startup kit: {kit} (mode 0600, holds the password: copy it to the device privately, then run "
              f"'flayer edge --kit {kit.name} --data FOLDER' there)")
    _reload(files.state_dir)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from mqtt_broker.kit import revoke_device
    from mqtt_broker.state import BrokerFiles

    files = BrokerFiles.at(args.state_dir)
    first = revoke_device(files.state_dir, args.device_id)
    print(f"revoked device {args.device_id}{'' if first else ' (already revoked)'}: password, credentials and "
          f"certificate removed; listed in {files.state_dir / 'revoked.json'} for the coordinator")
    if not _reload(files.state_dir, ": its connection is closed"):
        print("no running broker recorded: it refuses the device when it starts")
    return 0
