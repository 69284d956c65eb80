"""``flayer status``: the fleet now, as the broker's read-only observer sees it.

Prints every device's state (online, idle, training, uploading, late, offline, revoked), when it was
last seen, its link estimate (its last model download's rate), the updates the coordinator accepted
from it (from the run's metrics file), the current round and the round's progress. ``--watch``
redraws in place until Ctrl-C. Exit status: 0 with devices online; 1 when no broker answers (the
fleet is stopped); 3 when the broker answers but no device is online and no round is open; 2 for a
usage or credentials error.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from cli.common import CliError

NO_BROKER, NO_FLEET = 1, 3


def add_source_flags(p: argparse.ArgumentParser) -> None:
    """Where the fleet is read from: a run folder, the broker's state folder or a credentials file."""
    p.add_argument("run", nargs="?", metavar="RUN_DIR",
                   help="a run folder: 'flayer emulate --out', 'flayer simulate --out' or the coordinator's "
                        "state folder (its metrics.jsonl; an emulator's own broker too)")
    p.add_argument("--broker-state", metavar="DIR", help="the broker's state folder (uses credentials/observer.toml)")
    p.add_argument("--credentials", metavar="FILE",
                   help="the observer's credentials file (a copy of BROKER_STATE/credentials/observer.toml)")
    p.add_argument("--metrics", metavar="FILE", help="the run's metrics.jsonl (updates accepted, rounds, refusals)")


def resolve_source(args: argparse.Namespace, wait: bool = False) -> tuple[Any, Path | None, Path | None]:
    """(credentials or None, metrics file or None, the broker's revocation list or None) from the flags;
    CliError when a named file is unusable. ``wait``: a metrics file not written yet (a coordinator not started,
    or before its first record) is kept, to be read once it appears, when its folder exists."""
    from coordinator.dashboard.watch import find_metrics
    from mqtt_broker import BrokerConfigError, Credentials

    run = Path(args.run) if args.run else None
    if run is not None and not run.is_dir():
        raise CliError(f"run folder {run} does not exist")
    cred_file = None
    if args.credentials:
        cred_file = Path(args.credentials)
    elif args.broker_state:
        cred_file = Path(args.broker_state) / "credentials" / "observer.toml"
        if not cred_file.is_file():
            raise CliError(f"{cred_file} does not exist: the broker's state folder has no observer yet; "
                           f"'flayer broker start' with this version writes it")
    elif run is not None and (run / "broker" / "credentials" / "observer.toml").is_file():
        cred_file = run / "broker" / "credentials" / "observer.toml"
    creds = None
    if cred_file is not None:
        try:
            creds = Credentials.load(cred_file)
        except BrokerConfigError as exc:
            raise CliError(str(exc)) from exc
        if creds.role != "observer":  # the coordinator's would take over the coordinator's own session
            raise CliError(f"{cred_file} holds a {creds.role}'s credentials; use the read-only observer's "
                           f"(BROKER_STATE/credentials/observer.toml)")
    metrics = Path(args.metrics) if args.metrics else find_metrics(run) if run is not None else None
    if wait and metrics is None and run is not None:
        metrics = run / "metrics.jsonl"  # a coordinator's or emulator's folder before its first record
    if metrics is not None and not metrics.is_file() and not (wait and metrics.parent.is_dir()
                                                              and not metrics.exists()):
        raise CliError(f"metrics file {metrics} does not exist" + (f" and its folder {metrics.parent} neither"
                                                                  if wait else ""))
    # the list 'flayer broker revoke' writes, beside the credentials folder (as the coordinator reads it)
    revoked = cred_file.parent.parent / "revoked.json" if cred_file is not None else None
    return creds, metrics, revoked


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show the fleet now: devices, their state, the round's progress",
                       description=__doc__.splitlines()[0])
    add_source_flags(p)
    p.add_argument("--watch", action="store_true", help="redraw in place every --interval seconds until Ctrl-C")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period of --watch (2)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for the broker to answer (5)")
    p.add_argument("--stale-after", type=float, default=30.0, metavar="SECONDS",
                   help="a device silent this long counts as offline (30; the coordinator's stale_after_s)")
    p.set_defaults(func=run)


def render(snap: dict[str, Any]) -> str:
    """The fleet as text: a heading, the round, and one line per device."""
    from cli.report import table

    src, p = snap["source"], snap["progress"]
    lines = [f"federation {src['federation']} on {src['broker']}"
             + (f"; metrics {src['metrics']}" if src["metrics"] else "")]
    if p["round"] is None:
        lines.append("round: no round plan on the broker")
    elif p["phase"] == "final":
        lines.append(f"round: federation finished after round {p['rounds']} (final plan)")
    else:
        states = ", ".join(f"{n} {k}" for k, n in p["by_state"].items())
        deadline = "" if p["deadline_in_s"] is None else \
            f", deadline {'in ' + format(p['deadline_in_s'], '.0f') + ' s' if p['deadline_in_s'] > 0 else 'passed'}"
        lines.append(f"round {p['round']}/{p['rounds'] or '?'} ({p['phase']}): {p['done']}/{p['selected']} selected "
                     f"devices done ({states}){deadline}")
    if snap["last_round"]:
        r = snap["last_round"]
        acc = "-" if r["acc"] is None else f"{r['acc']:.4f}"
        lines.append(f"last closed round {r['round']}: {r['reported']}/{r['selected']} reported, acc {acc}, "
                     f"{r['closed']}")
        if r.get("epsilon") is not None:  # a private run: the budget spent so far
            eps = r["epsilon"] if isinstance(r["epsilon"], str) else f"{r['epsilon']:.4g}"
            coord = r.get("epsilon_coordinator")
            coord = "inf" if coord is None else coord if isinstance(coord, str) else f"{coord:.4g}"
            from cli.privacy import schema_text

            who = schema_text(r.get("dp_max_participations"), r.get("dp_min_separation", 0))
            lines.append(f"privacy: epsilon {eps} spent at delta {r['delta']:.3g} after round {r['round']} against "
                         f"readers of the published models, devices and broker observers; {coord} against the "
                         f"coordinator (zero-out neighbours); for {who}")
    if snap.get("device_privacy"):
        lines.append(device_privacy_line(snap["device_privacy"]))
    counts = ", ".join(f"{n} {k}" for k, n in sorted(snap["states"].items()))
    lines.append(f"devices: {len(snap['devices'])}" + (f" ({counts})" if counts else ""))
    if src["metrics_error"]:
        lines.append(f"metrics file not read: {src['metrics_error']}")
    has_metrics = src["metrics"] is not None
    rows = [(d["id"], d["state"] + (" (invalid status)" if d.get("invalid") else ""), "never" if d["last_seen_s"] is None else f"{d['last_seen_s']:.0f}s ago",
             "-" if d["link_kbps"] is None else f"{d['link_kbps']:.0f}",
             d["accepted"] if has_metrics else "-",
             f"{d['last_result']} (round {d['last_result_round']})" if d["last_result"] else "-")
            for d in snap["devices"]]
    if rows:
        lines += ["", table(["device", "state", "last seen", "link kbit/s", "accepted", "last round selected"],
                            rows)]
    lines += [f"{d['id']}: invalid status: {d['invalid']}" for d in snap["devices"] if d.get("invalid")]
    return "\n".join(lines)


def device_privacy_line(dp: dict[str, Any]) -> str:
    """The devices' own ledgers (coordinator.device_privacy) as one line."""
    from cli.privacy import epsilon_text  # "inf": a device booked a round whose noise it cannot count

    spread = "no epsilon reported (no delta known to them)" if dp["min"] is None else (
        f"epsilon min {epsilon_text(dp['min'])}, median {epsilon_text(dp['median'])}, max {epsilon_text(dp['max'])} "
        f"over {dp['with_epsilon']}" + (f" ({dp['infinite']} infinite)" if dp.get("infinite") else ""))
    return f"devices' own privacy: {dp['devices']} counting, {spread}; {dp['at_budget']} at their budget"


def _stopped(snap: dict[str, Any]) -> bool:
    p = snap["progress"]
    online = sum(n for k, n in snap["states"].items() if k not in ("offline", "revoked", "unknown"))
    return online == 0 and (p["round"] is None or p["phase"] == "final")


def run(args: argparse.Namespace) -> int:
    from coordinator.dashboard.watch import FleetWatch

    creds, metrics, revoked = resolve_source(args)
    if creds is None:
        raise CliError("status reads the broker: give --broker-state DIR, --credentials FILE, or an emulator "
                       "run folder holding its broker")
    watch = FleetWatch(creds, metrics, stale_after_s=args.stale_after, revoked_file=revoked).start()
    try:
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline and not watch.settled() and watch.broker_error is None:
            time.sleep(0.05)
        if watch.broker_error is not None:
            raise CliError(f"{watch.broker_error}; check the credentials file")
        if watch.subscribed_at is None:
            print(f"flayer status: no broker answers at {creds.host}:{creds.port} within {args.timeout:.0f} s: "
                  f"the fleet is stopped (or the address is wrong)", file=sys.stderr)
            return NO_BROKER
        if not args.watch:
            snap = watch.snapshot()
            print(render(snap))
            if _stopped(snap):
                print("flayer status: the broker answers but no device is online and no round is open: "
                      "the fleet is stopped", file=sys.stderr)
                return NO_FLEET
            return 0
        try:
            while True:
                text = render(watch.snapshot())
                if not watch.connected:
                    text += f"\n\nbroker {creds.host}:{creds.port} not reachable; retrying"
                sys.stdout.write("\x1b[H\x1b[2J" + text + f"\n\n(every {args.interval:g} s; Ctrl-C to leave)\n")
                sys.stdout.flush()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
    finally:
        watch.stop()
