"""``flayer coordinator --config federation.toml``: run the federation's rounds over the MQTT broker.

Shows each round as it closes (updates accepted of selected, MB up and down, the devices' reported
accuracy), ends with a summary table and writes checkpoint.safetensors, journal/, metrics.jsonl
and global.safetensors under the state folder. Exit status: 0 after the last round; 130 after
Ctrl-C (SIGINT) and 143 after SIGTERM -- both stop cleanly after the current event, and a restart
with the same command resumes from the checkpoint and the journal; 2 for a configuration error; 1 when
the state folder cannot be written (a full disk, a file that cannot be written: the message names it;
nothing acknowledged is lost, and the same command resumes once the cause is fixed).
``--metrics-port`` serves Prometheus metrics (docs/reference/metrics.md); ``--print-unit`` prints a systemd
unit that runs this command as a service (docs/howto/service.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from cli.common import CliError, add_mode_flags, mode_overrides, port_arg
from cli.logfile import add_log_file_flag
from cli.tensorboard import TensorBoardSink, add_tensorboard_flag
from cli.unit import add_unit_flags


def privacy_note(rec: dict[str, Any], rounds: int | None = None) -> str:
    """``, epsilon E against the models' readers, E' against the coordinator (SCHEMA)`` for a private round's record
    (empty otherwise): both adversaries named, and the participation schema the figures assume (``every round``,
    or ``k in N rounds, b apart``; ``rounds``: the run's N), as the run's closing lines say them."""
    from cli.privacy import epsilon_text
    from flayer.privacy_config import ParticipationSchema

    eps = rec.get("epsilon")
    if eps is None:
        return ""
    coord = rec.get("epsilon_coordinator")  # none recorded: no figure against the coordinator
    return (f", epsilon {epsilon_text(eps, '.3g')} against readers of the models and plans, "
            f"{epsilon_text('inf' if coord is None else coord, '.3g')} against the coordinator "
            f"({ParticipationSchema.of_record(rec).short(rounds)})")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the federation's rounds over the MQTT broker",
                       description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, metavar="FILE.toml",
                   help="federation.toml: [federation], [run], [data] or [model], [train], [strategy.NAME]")
    p.add_argument("--credentials", metavar="FILE", help="the coordinator's credentials file (overrides the config)")
    p.add_argument("--state-dir", metavar="DIR", help="checkpoint, journal, metrics (overrides the config)")
    p.add_argument("--rounds", type=int, metavar="R")
    p.add_argument("--quorum", type=int, metavar="N")
    p.add_argument("--min-devices", type=int, metavar="N")
    p.add_argument("--deadline", type=float, metavar="SECONDS", dest="deadline_s")
    add_mode_flags(p)
    p.add_argument("--metrics-port", type=port_arg, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; [federation] "
                        "metrics_port)")
    p.add_argument("--metrics-host", metavar="ADDR",
                   help="address of the metrics endpoint (127.0.0.1; any other needs a token: --metrics-token-file, "
                        "else one generated into the state folder's metrics.token)")
    p.add_argument("--metrics-token-file", metavar="FILE", help="the token scrapers present (Authorization: Bearer)")
    p.add_argument("--metrics-linger", type=float, metavar="SECONDS", dest="metrics_linger_s",
                   help="after the last round, wait up to this long for a scrape of the final values (0)")
    add_log_file_flag(p)
    add_tensorboard_flag(p)
    add_unit_flags(p)
    p.set_defaults(func=run)


class _Display:
    """One line per round on stdout; a live count of the open round on stderr when it is a terminal."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.tty = sys.stderr.isatty()
        self._waiting_shown = False

    def progress(self, kind: str, info: dict[str, Any]) -> None:
        if kind == "waiting" and not self._waiting_shown:
            self._waiting_shown = True
            print(f"waiting for devices: {info['online']} online, {info['needed']} needed", file=sys.stderr)
        elif kind == "open":
            self._waiting_shown = False
            print(f"round {info['round']}/{self.rounds} open: {info['selected']} selected", file=sys.stderr)
        elif kind == "accepted" and self.tty:
            sys.stderr.write(f"\r  round {info['round']}: {info['accepted']}/{info['selected']} updates\x1b[K")
            sys.stderr.flush()

    def round(self, rec: dict[str, Any]) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")
        acc = f"{rec['acc']:.4f}" if rec["acc"] is not None else "-"
        rejected = sum(rec["rejected"].values())
        print(f"round {rec['round']}/{self.rounds}: {rec['accepted']}/{len(rec['selected'])} updates"
              f"{f', {rejected} rejected' if rejected else ''}, up {rec['bytes_in'] / 1e6:.2f} MB, "
              f"down {rec['model_bytes'] * len(rec['selected']) / 1e6:.2f} MB, acc {acc}, {rec['wall_s']:.1f}s "
              f"({rec['closed']})" + privacy_note(rec, self.rounds), flush=True)


def _plots(cfg: Any, result: Any) -> list[str]:
    """The emulator's accuracy.png and bytes.png, from every round in the metrics file (resumed runs too)."""
    from cli.plots import round_plots
    from protocol.metrics_schema import MetricsSchemaError, read_metrics

    try:
        rounds = {r["round"]: r for r in read_metrics(cfg.state_dir / "metrics.jsonl") if r["kind"] == "round"}
    except MetricsSchemaError as exc:
        print(f"flayer coordinator: no plots: {exc}", file=sys.stderr)
        return []
    return round_plots(cfg.state_dir, [rounds[r] for r in sorted(rounds)], f"{cfg.run.strategy}: federation in "
                       f"{cfg.state_dir.name}", "the coordinator received (up) and "
                       "published (down)")


def run(args: argparse.Namespace) -> int:
    from cli.report import table
    from coordinator.checkpoint import CheckpointError
    from coordinator.config import load_coordinator_config
    from coordinator.journal import JournalError
    from coordinator.server import Coordinator, CoordinatorError, StateWriteError
    from flayer.config import ConfigError
    from transport import Credentials, CredentialsError

    def absolute(path: str | None) -> str | None:  # flags are relative to the working directory
        return str(Path(path).resolve()) if path else None

    overrides = {"federation": {"credentials": absolute(args.credentials), "state_dir": absolute(args.state_dir),
                                "quorum": args.quorum,
                                "min_devices": args.min_devices, "deadline_s": args.deadline_s,
                                "metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
                                "metrics_token_file": absolute(args.metrics_token_file),
                                "metrics_linger_s": args.metrics_linger_s, **mode_overrides(args)},
                 "run": {"rounds": args.rounds}}
    state_dir: Path | None = None
    try:
        cfg = load_coordinator_config(args.config, overrides)
        state_dir = cfg.state_dir
        if args.print_unit:  # the config is valid; nothing starts (cli.unit)
            from cli.unit import print_unit

            return print_unit(args, "coordinator", [cfg.state_dir], f"{Path(args.config).name}")
        creds = Credentials.load(cfg.credentials)
        display = _Display(cfg.run.rounds)
        tb = TensorBoardSink(args.tensorboard, cfg.state_dir / "metrics.jsonl") if args.tensorboard else None

        def on_round(rec: dict[str, Any]) -> None:
            display.round(rec)
            if tb is not None:
                tb.poll()

        coord = Coordinator(cfg, creds, on_round=on_round, on_progress=display.progress)
    except (ConfigError, CredentialsError, CoordinatorError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    except OSError as exc:  # a file of the config, or the state folder's metrics.jsonl, cannot be opened
        if state_dir is None:
            raise CliError(str(exc)) from exc
        print(f"flayer coordinator: error: {StateWriteError.of(exc, state_dir)}", file=sys.stderr)
        return 1
    got: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        got.append(signum)
        coord.stop()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"coordinator {creds.username} of federation {creds.federation} on {creds.host}:{creds.port}: "
          f"{cfg.run.strategy}, {cfg.run.rounds} rounds, quorum {cfg.federation.quorum}; state in {cfg.state_dir}",
          file=sys.stderr)
    if coord.asynchronous:
        fs = coord.fs
        print(f"asynchronous rounds: buffer {fs.buffer}, max_staleness {fs.max_staleness}, concurrency "
              f"{fs.concurrency}{''.join(f'; {k} auto: {v}' for k, v in coord.derived.items())}", file=sys.stderr)
    try:
        result = coord.run()
    except StateWriteError as exc:
        print(f"flayer coordinator: error: {exc}", file=sys.stderr)
        return 1
    except (CoordinatorError, CheckpointError, JournalError) as exc:
        raise CliError(str(exc)) from exc
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if tb is not None:
            tb.close()
    rows = [(r["round"], f"{r['accepted']}/{len(r['selected'])}", sum(r["rejected"].values()),
             r["acc"] if r["acc"] is not None else "-", f"{r['bytes_in'] / 1e6:.2f}", f"{r['wall_s']:.1f}")
            for r in result.history]
    if rows:
        print()
        print(table(["round", "updates", "rejected", "acc", "MB up", "seconds"], rows))
    counters = {k: v for k, v in sorted(result.counters.items()) if v}
    print(f"\n{result.rounds_done}/{cfg.run.rounds} rounds done; rejections and other counters: "
          f"{counters or 'none'}; final model {result.model_digest[:12]}")
    if result.history and result.history[-1].get("epsilon") is not None:  # a private federation
        from cli.privacy import epsilon_lines

        last = result.history[-1]
        print(epsilon_lines(last, last["round"]) + f"\n({cfg.run.privacy.mode} noise, z "
              f"{cfg.run.privacy.noise_multiplier:g}; docs/explanation/privacy.md)")
    plots = _plots(cfg, result)
    print(f"outputs in {cfg.state_dir}/ (metrics.jsonl, checkpoint.safetensors, journal/"
          f"{', global.safetensors' if result.finished else ''}{''.join(', ' + p for p in plots)})", file=sys.stderr)
    if got:
        print(f"stopped by signal {got[0]}; run the same command to resume", file=sys.stderr)
        return 128 + got[0]
    return 0
