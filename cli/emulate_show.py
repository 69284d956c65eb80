"""What ``flayer emulate`` shows of a fleet as it runs and at its end: the live lines (:class:`Display`), the
dashboard it serves with ``--dashboard`` (:class:`Dashboard`), the per-device accuracy plot and the lines
on secure and private rounds read back from the coordinator's metrics file."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from cli.errors import CliError

__all__ = ["DASHBOARD_DEFAULT", "Dashboard", "Display", "device_plots", "privacy_line", "secure_line"]

DASHBOARD_DEFAULT = "127.0.0.1:8765"


def secure_line(metrics: Path) -> str:
    """What the coordinator's round records say of a secure fleet's rounds."""
    from protocol.metrics_schema import read_metrics

    rounds = [r for r in read_metrics(metrics) if r.get("kind") == "round" and "secure_survivors" in r] \
        if metrics.exists() else []
    abandoned = [r["round"] for r in rounds if r.get("secure_abandoned")]
    dropped = sum(len(r.get("secure_dropped") or []) for r in rounds)
    return (f"secure aggregation: {len(rounds) - len(abandoned)} of {len(rounds)} rounds unmasked (only their sums "
            f"seen), {len(abandoned)} abandoned{' ' + str(abandoned) if abandoned else ''}, {dropped} device(s) "
            f"dropped out of a round's protocol (docs/explanation/secure-aggregation.md)")


def privacy_line(metrics: Path) -> str:
    """The epsilon the coordinator's last round record states (a private fleet)."""
    from protocol.metrics_schema import read_metrics

    rounds = [r for r in read_metrics(metrics) if r["kind"] == "round" and r.get("epsilon") is not None]
    if not rounds:
        return "privacy: no private round closed"
    from cli.privacy import epsilon_lines

    return epsilon_lines(rounds[-1], rounds[-1]["round"]) + " (docs/explanation/privacy.md)"


class Display:
    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.t0 = time.monotonic()
        self._waiting_at = 0.0

    def __call__(self, kind: str, info: dict[str, Any]) -> None:
        from emulator.profiles import describe_fleet

        w = len(str(self.rounds))
        if kind == "setup":
            spec = info["spec"]
            here = spec.mine()
            print(f"fleet: {len(spec.devices)} devices ({describe_fleet(spec.profile_of)}); this is shard "
                  f"{spec.shard}/{spec.shards} hosting {len(here)} in {spec.workers} worker process(es), "
                  f"{spec.network} network", file=sys.stderr)
            print(f"broker: {info['broker']}; output folder {info['out']}", file=sys.stderr)
        elif kind == "started":
            coord = f"coordinator pid {info['coordinator']}, " if info["coordinator"] else ""
            print(f"{coord}worker pids {', '.join(map(str, info['workers']))}", file=sys.stderr)
        elif kind == "note":
            print(info["text"], file=sys.stderr)
        elif kind == "waiting" and time.monotonic() - self._waiting_at > 5:
            self._waiting_at = time.monotonic()
            print(f"waiting for devices: {info['online']} online, {info['needed']} needed", file=sys.stderr)
        elif kind == "open":
            print(f"round {info['round']:>{w}}/{self.rounds} open: {info['selected']} selected of "
                  f"{info['online']} online",
                  file=sys.stderr)
        elif kind == "plan":
            print(f"round {info['round']:>{w}}/{self.rounds}: {info['selected']} selected, {info['here']} on "
                  f"this shard",
                  file=sys.stderr)
        elif kind == "round" and "selected" in info:
            acc = f"{info['acc']:.4f}" if info["acc"] is not None else "-"
            refused = ", ".join(f"{n} {k}" for k, n in sorted(info["rejected"].items()))
            print(f"round {info['round']:>{w}}/{self.rounds}: {info['reported']}/{info['selected']} reported"
                  f"{f' ({refused})' if refused else ''}, {info['online_close']} online, "
                  f"up {info['mb_up']:.1f} MB, down {info['mb_down']:.1f} MB, acc {acc}, "
                  f"{info['wall_s']:.1f}s "
                  f"({info['closed']})", flush=True)
        elif kind in ("crash", "restart"):
            what = "crashed (no goodbye: the broker sends its last will)" if kind == "crash" else \
                f"rebooted, resuming from its disk (last trained round {info.get('done_round', '?')})"
            print(f"  {info['device']} {what}", file=sys.stderr)
        elif kind == "error":
            print(f"  {info['device']}: error: {info['error']}", file=sys.stderr)
        elif kind == "wrap_up":
            print("federation finished: every device comes online to save its personal model",
                  file=sys.stderr)


class Dashboard:
    """``--dashboard``: started when the fleet is set up (the broker and the observer's credentials exist)."""

    def __init__(self, where: str, args: argparse.Namespace) -> None:
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit():
            raise CliError(f"--dashboard {where!r}: expected HOST:PORT, e.g. {DASHBOARD_DEFAULT}")
        self.host, self.port, self.args = host, int(port), args
        self.server: Any = None

    def start(self, out: Path, spec: Any) -> None:
        from cli.dashboard import start_dashboard
        from mqtt_broker import BrokerConfigError, Credentials

        state = Path(self.args.broker_state) if self.args.broker_state else out / "broker"
        creds = None
        try:
            creds = Credentials.load(state / "credentials" / "observer.toml")
            if spec.broker_host is not None and spec.broker_port is not None:
                creds = dataclasses.replace(creds, host=spec.broker_host, port=spec.broker_port)
        except BrokerConfigError as exc:
            print(f"dashboard: no observer credentials ({exc}); showing the metrics file only", file=sys.stderr)
        try:
            self.server = start_dashboard(creds, out / "metrics.jsonl", self.host, self.port,
                                          revoked_file=state / "revoked.json")
        except CliError:
            if self.port != int(DASHBOARD_DEFAULT.rpartition(":")[2]):
                raise
            self.server = start_dashboard(creds, out / "metrics.jsonl", self.host, 0,  # the default port is taken
                                          revoked_file=state / "revoked.json")
        print(f"dashboard: {self.server.url}  (open it in a browser to watch the fleet)", file=sys.stderr,
              flush=True)

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server.watch.stop()


def device_plots(result: Any, devices: list[dict[str, Any]]) -> list[str]:
    from cli.plots import _pyplot, round_plots
    from protocol.metrics_schema import MetricsSchemaError, read_metrics

    out = result.out
    try:
        rounds = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "round"]
    except MetricsSchemaError:  # a shard > 0 keeps no metrics file
        rounds = []
    made = round_plots(out, rounds, f"{result.spec.extra.get('strategy')}: {len(result.spec.devices)} emulated "
                                    f"devices", "over the emulated links, all devices")
    plt = _pyplot()
    with_acc = [d for d in devices if d["final_acc"] is not None]
    if plt is not None and with_acc:
        names = sorted({d["profile"] for d in with_acc})
        colors = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(names)}
        fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(with_acc) + 2), 4), dpi=110)
        ax.bar(range(len(with_acc)), [d["final_acc"] for d in with_acc],
               color=[colors[d["profile"]] for d in with_acc])
        if len(with_acc) <= 60:
            ax.set_xticks(range(len(with_acc)), [d["device"] for d in with_acc], rotation=90, fontsize=7)
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names], labels=names,
                  fontsize=8)
        ax.set_ylabel("test accuracy")
        ax.set_title("personal model accuracy per device after the federation")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(out / "device_accuracy.png")
        plt.close(fig)
        made.append("device_accuracy.png")
    return made
