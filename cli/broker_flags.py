"""The flags of ``flayer broker``'s actions (the command itself: :mod:`cli.broker`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from cli.broker_users import add_rekey_parser

__all__ = ["add_broker_parser"]


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _cluster_nodes(text: str) -> int:
    from mqtt_broker.cluster import MAX_NODES

    value = _nonneg_int(text)
    if not 1 <= value <= MAX_NODES:
        raise argparse.ArgumentTypeError(f"a node count in 1-{MAX_NODES}, got {value}")
    return value


def _state_dir_flag(p: argparse.ArgumentParser) -> None:
    from mqtt_broker.config import DEFAULT_STATE_DIR

    p.add_argument("--state-dir", metavar="DIR", default=str(DEFAULT_STATE_DIR),
                   help=f"folder holding the broker's configuration, passwords and credentials (default {DEFAULT_STATE_DIR})")


def add_broker_parser(sub: argparse._SubParsersAction, run: Callable[[argparse.Namespace], int], title: str) -> None:
    """``flayer broker``'s actions and flags; ``run`` carries them out (:mod:`cli.broker`)."""
    p = sub.add_parser("broker", help="run the federation's MQTT broker (mosquitto, or the embedded fallback)",
                       description=title)
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
    s.add_argument("--max-connections", type=_nonneg_int, metavar="N",
                   help="connections each listener accepts (default 0: 5000, fewer when the hard open-file limit is lower; Mosquitto); the broker must be allowed "
                        "N per listener + 64 open files: raised at start, or LimitNOFILE in --print-unit's unit")
    g = s.add_argument_group("field gateway (bridge this site broker to the central one; docs/howto/field-gateway.md)")
    g.add_argument("--gateway-credentials", metavar="FILE",
                   help="a gateway's credentials file from the central broker ('flayer broker add-device SITE "
                        "--gateway-for DEV,...' there); copied into the state folder, kept for later starts")
    g.add_argument("--gateway-to", metavar="HOST:PORT",
                   help="the central broker's address as this site reaches it (default: the credentials file's)")
    g.add_argument("--gateway-keepalive", type=_nonneg_int, metavar="S",
                   help="seconds of silence before the bridge pings the central broker (>= 5; default: stored, else 30)")
    g.add_argument("--gateway-retry", metavar="BASE[,CAP]",
                   help="reconnect back-off of the bridge in seconds (default: stored, else 2,30)")
    g.add_argument("--no-gateway", action="store_true", help="drop the stored bridge (this broker stands alone)")
    kind = s.add_mutually_exclusive_group()
    kind.add_argument("--mosquitto", dest="kind", action="store_const", const="mosquitto", help="require mosquitto")
    kind.add_argument("--embedded", dest="kind", action="store_const", const="embedded",
                      help="run the embedded pure-Python broker (amqtt; loopback, no TLS, limits not enforced)")
    kind.add_argument("--cluster", type=_cluster_nodes, metavar="N",
                      help="run N Aedes nodes sharing one Redis (node 0 on --port, the others on free ports; "
                           "retained messages and sessions on every node; no TLS); needs node, redis-server and "
                           "'make apt-cluster'")
    s.add_argument("--foreground", action="store_true",
                   help="stay attached, copying the broker's log to stderr; Ctrl-C or SIGTERM stops the broker")
    from cli.unit import add_unit_flags

    add_unit_flags(s)
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
    a.add_argument("--gateway-for", action="append", default=[], metavar="DEV[,DEV...]",
                   help="create a field gateway's credentials instead (ID = the site), allowed exactly the topics of "
                        "these devices (their own credentials are on the site broker); repeatable; run again to "
                        "change the list (the password stays unless --rotate)")
    a.add_argument("--device-keys", metavar="SITE_KEYS.json",
                   help="with --gateway-for: the site broker's signing_keys.json, whose public keys of those devices "
                        "the coordinator then believes (add the devices on the site first)")
    a.add_argument("--allow-entry-point", action="append", default=[], metavar="PKG.MODULE:FUNCTION",
                   help="with --kit: model code the kit's device.toml accepts besides the built-ins ([edge] "
                        "allow_entry_points), e.g. the federation's own model; repeatable")
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
    add_rekey_parser(actions, _state_dir_flag, run)
