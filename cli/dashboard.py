"""``flayer dashboard``: a read-only web page that shows the fleet live (or a finished run's folder).

It reads the broker as the read-only observer and the run's metrics file, and serves one page (from
the package: nothing is fetched from elsewhere) with the round's progress, accuracy and bytes per
round as charts, a device table that sorts and filters, and the latest refusals with their reasons;
updates are pushed to the page (Server-Sent Events). Bound to 127.0.0.1 by default; bound to another
address it requires a token (printed in the address; given in a file or the environment, never on the command
line, where every user of the machine reads it). It answers only requests addressed to this machine's addresses
and names. Runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from cli.common import CliError, port_arg
from cli.logfile import add_log_file_flag
from cli.status import add_source_flags, resolve_source

DEFAULT_PORT = 8765
TOKEN_ENV = "FLAYER_DASHBOARD_TOKEN"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="serve a live web page of the fleet (read-only)",
                       description=__doc__.splitlines()[0])
    add_source_flags(p)
    p.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="address to listen on (127.0.0.1; any other address requires a token)")
    p.add_argument("--port", type=port_arg, default=DEFAULT_PORT, metavar="PORT", help=f"port ({DEFAULT_PORT}; 0: any free)")
    p.add_argument("--token-file", metavar="FILE",
                   help=f"a file whose first line is the access token (or set {TOKEN_ENV}); generated when bound "
                        f"beyond loopback and none is given")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a host name the page may be opened by besides this machine's addresses and names (a DNS "
                        "alias); repeatable. Other Host headers get 421 (DNS rebinding)")
    p.add_argument("--stale-after", type=float, default=30.0, metavar="SECONDS",
                   help="a device silent this long counts as offline (30)")
    add_log_file_flag(p)
    p.set_defaults(func=run)


def read_token(args: argparse.Namespace) -> str | None:
    """The access token from ``--token-file`` or the environment (None: generated off loopback)."""
    if args.token_file:
        try:
            lines = Path(args.token_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--token-file {args.token_file}: {getattr(exc, 'strerror', None) or exc}") from None
        if not lines or not lines[0].strip():
            raise CliError(f"--token-file {args.token_file}: the first line must hold the token")
        return lines[0].strip()
    return os.environ.get(TOKEN_ENV) or None


def start_dashboard(creds: Any, metrics: Path | None, host: str, port: int, token: str | None = None,
                    stale_after_s: float = 30.0, revoked_file: Path | None = None,
                    allow_hosts: tuple[str, ...] = ()) -> Any:
    """A started :class:`coordinator.dashboard.server.DashboardServer` (and its watch) in background threads;
    ``close()`` it and ``watch.stop()`` when done. CliError when the address cannot be bound."""
    from coordinator.dashboard.server import DashboardServer
    from coordinator.dashboard.watch import FleetWatch
    from transport.access import token_for

    try:
        token_for(host, token)  # the access rule (transport.access): checked before anything starts
    except ValueError as exc:
        raise CliError(f"--token-file / {TOKEN_ENV}: {exc}") from exc
    watch = FleetWatch(creds, metrics, stale_after_s=stale_after_s, revoked_file=revoked_file).start()
    try:
        server = DashboardServer(watch, host, port, token, allow_hosts=allow_hosts)
    except OSError as exc:
        watch.stop()
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    server.serve_in_thread()
    return server


def run(args: argparse.Namespace) -> int:
    for name in args.allow_host:
        if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", name):
            raise CliError(f"--allow-host {name!r}: expected a host name (letters, digits, dots and dashes)")
    creds, metrics, revoked = resolve_source(args, wait=True)
    if creds is None and metrics is None:
        raise CliError("nothing to show: give a run folder, --metrics FILE, --broker-state DIR or --credentials FILE")
    server = start_dashboard(creds, metrics, args.host, args.port, read_token(args), args.stale_after, revoked,
                             tuple(args.allow_host))
    what = " and ".join(x for x in (f"broker {creds.host}:{creds.port} as {creds.username}" if creds else "",
                                    f"metrics {metrics}" if metrics else "") if x)
    if metrics is not None and not metrics.exists():
        print(f"dashboard: waiting for {metrics} (read as soon as the coordinator writes it)", file=sys.stderr,
              flush=True)
    print(f"dashboard: {server.url}  ({what}; Ctrl-C to stop)", flush=True)
    if server.token:
        print("dashboard: the address holds the access token; share it only with whoever may watch", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()
        server.watch.stop()
