"""``flayer models serve``: serve a federation's model files (``[federation] models_dir``) over HTTP(S)
with nginx, for devices that fetch the global model and its deltas by range requests.

It writes an nginx configuration for the folder into ``--state-dir`` (GET only, byte ranges, no
listing, dotfiles refused, an access log with the bytes sent; TLS with ``--tls-cert``/``--tls-key``;
only the federation's devices and coordinator, from the broker state folder's ``models.htpasswd``, with
``--broker-state``; ``--open`` serves anyone instead),
starts nginx in the foreground as its child, prints the URL to put in ``[federation] models_url`` and
nginx's PID, and stops that PID on Ctrl-C or SIGTERM. ``--print-config`` prints the configuration
instead, for a system nginx (docs/howto/http-models.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from cli.common import CliError, port_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="serve the federation's model files over HTTP(S) with nginx",
                       description=__doc__.splitlines()[0])
    actions = p.add_subparsers(dest="models_command", metavar="ACTION")
    actions.required = True
    s = actions.add_parser("serve", help="run nginx serving a models folder until Ctrl-C")
    s.add_argument("--dir", required=True, metavar="DIR", help="the coordinator's [federation] models_dir")
    s.add_argument("--port", type=port_arg, default=8080, metavar="P", help="port to listen on (default 8080; 0: a free one)")
    s.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="listen address (default 127.0.0.1; 0.0.0.0 for every interface)")
    s.add_argument("--state-dir", metavar="DIR",
                   help="nginx's configuration, pid file and logs (default: DIR/../nginx)")
    s.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM) ...")
    s.add_argument("--tls-key", metavar="FILE", help="... and its key")
    s.add_argument("--broker-state", metavar="DIR",
                   help="the broker's state folder: serve only its devices and coordinator (models.htpasswd)")
    s.add_argument("--open", action="store_true",
                   help="serve the files to anyone who can reach the port (no --broker-state)")
    s.add_argument("--print-config", action="store_true", help="print the nginx configuration and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from coordinator.model_server import NginxError, NginxServer, nginx_config

    if (args.tls_cert is None) != (args.tls_key is None):
        raise CliError("--tls-cert and --tls-key go together")
    if (args.broker_state is None) == (not args.open):
        raise CliError("say who may fetch the models: --broker-state DIR (the federation's devices and "
                       "coordinator) or --open (anyone who can reach the port)")
    htpasswd = None
    if args.broker_state is not None:
        from mqtt_broker.state import BrokerFiles, write_models_htpasswd

        files = BrokerFiles.at(args.broker_state)
        if not files.config.is_file():
            raise CliError(f"{args.broker_state}: not a broker state folder (no {files.config.name})")
        htpasswd = write_models_htpasswd(files)
    for f in (args.tls_cert, args.tls_key):
        if f is not None and not Path(f).is_file():
            raise CliError(f"{f}: no such file")
    root = Path(args.dir)
    prefix = Path(args.state_dir) if args.state_dir else root.resolve().parent / "nginx"
    cert = Path(args.tls_cert) if args.tls_cert else None
    key = Path(args.tls_key) if args.tls_key else None
    try:
        if args.print_config:
            print(nginx_config(root, prefix, args.host, args.port or 8080, cert, key, htpasswd), end="")
            return 0
        server = NginxServer(root, prefix, args.host, args.port, cert, key, htpasswd).start()
    except NginxError as exc:
        raise CliError(str(exc)) from None
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"serving {root.resolve()} at {server.url} (nginx pid {server.pid}; logs in {prefix}); "
              f"set [federation] models_url = \"{server.url}\"; Ctrl-C stops it", flush=True)
        while not stop.wait(0.5):
            if server.proc is not None and server.proc.poll() is not None:
                print(f"nginx exited with status {server.proc.returncode}; see {prefix / 'error.log'}", file=sys.stderr)
                return 1
        return 0
    finally:
        server.stop()
        for s, h in old.items():
            signal.signal(s, h)
