"""The launcher: one shard of an emulated fleet, from an empty folder to the final report.

Shard 0 (the default, and the only shard of a one-machine fleet) starts the broker (unless given
one), creates every user's credentials, writes the coordinator's config and starts the real
coordinator in its own process (:mod:`emulator.coordinator_proc`); every shard starts its worker
processes (:mod:`emulator.worker`), each hosting its share of the shard's devices as threads. The
launcher then follows the event files, reports each round, and watches the round plan through a
monitor connection: at the ``final`` plan (or when the coordinator exits) it tells its workers to
wrap up, waits for them, and stops exactly the processes it started (by PID), Ctrl-C included.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flayer.config import ConfigError
from flayer.engine.secure import corrupt_fraction
from flayer.engine.secure_plan import accepted_dropout
from flayer.engine.selection import cohort_size
from protocol.metrics_schema import MetricsFile, end_record, run_record

from .events import JsonlTail
from .fleet import THREAD_MODE_LIMIT, FleetSpec, device_ids
from .options import EmulateConfig, federation_table
from .plan_watch import PlanWatch
from .procs import Child
from .profiles import assign_profiles, load_profiles, parse_mix, secure_dropout_for
from .progress import FleetProgress
from .report import FleetResult, emulate_round_record
from .setup import (
    clear_round_plan,
    ensure_credentials,
    make_partition_file,
    monitor_id,
    parse_broker_url,
    prepare_out,
    raise_open_files,
    wait_accepted,
    write_federation_toml,
)

__all__ = ["EmulatorError", "FleetResult", "LaunchOptions", "run_fleet"]

log = logging.getLogger(__name__)

OnEvent = Callable[[str, dict[str, Any]], None]


class EmulatorError(RuntimeError):
    """The fleet could not run (a process failed, a timeout); the message says which and where its log is."""


@dataclass(frozen=True)
class LaunchOptions:
    cfg: EmulateConfig
    out: Path
    shard: int = 0
    shards: int = 1
    broker_url: str | None = None
    broker_state: Path | None = None
    verbose: int = 0


class _Launch:
    def __init__(self, opts: LaunchOptions, on_event: OnEvent) -> None:
        self.opts, self.on_event = opts, on_event
        self.cfg: EmulateConfig = opts.cfg
        self.out = opts.out.resolve()
        self.broker: Any = None  # ours to stop
        self.nginx: Any = None  # ours to stop (http_models)
        self.broker_desc = ""
        self.coordinator: Child | None = None
        self.workers: list[Child] = []
        self.monitor: PlanWatch | None = None
        self.wrapped = False
        self.metrics: Any = None  # the schema's metrics.jsonl (shard 0)

    def note(self, text: str) -> None:
        self.on_event("note", {"text": text})

    # ---- setup -----------------------------------------------------------------------------------------
    def setup(self) -> FleetSpec:
        o, cfg, emu = self.opts, self.cfg, self.cfg.emulator
        if o.shard > 0 and o.broker_state is None:
            raise ConfigError("a shard other than 0 joins shard 0's broker: give --broker-state (shard 0's "
                              "OUT/broker on this machine, or a copy of it) and --broker URL if it is "
                              "elsewhere")
        if o.broker_url is not None and o.broker_state is None:
            raise ConfigError("--broker URL needs --broker-state DIR: the folder holding the credentials "
                              "files")
        profiles = load_profiles(emu.profiles)
        if emu.mix:
            profiles = profiles.with_mix(parse_mix(emu.mix, profiles.profiles))
        prepare_out(self.out)
        part_file, n = make_partition_file(cfg.run, self.out)
        ids = device_ids(n)
        assigned = assign_profiles(n, profiles.mix, cfg.run.seed)
        trace = None
        if emu.trace:
            from .availability import load_trace

            trace = load_trace(emu.trace, ids, emu.trace_scale)
        mine = [k for k in range(n) if k % o.shards == o.shard]
        if not mine:
            raise ConfigError(f"shard {o.shard}/{o.shards} of a {n}-device fleet hosts no device")
        workers = min(emu.workers or os.cpu_count() or 1, len(mine))
        per_worker = -(-len(mine) // workers)
        network = emu.network
        if network == "auto":
            network = "thread" if per_worker <= THREAD_MODE_LIMIT else "shared"
        host = port = None
        if o.broker_url is not None:
            host, port = parse_broker_url(o.broker_url)
        # descriptors: the broker's (when this launcher starts it) one per device, a worker's one per device it hosts
        raise_open_files((n if o.broker_state is None else per_worker) + 256)
        state = self._broker(o, n)
        hosted_users = range(n) if o.shard == 0 else mine  # shard 0 makes everyone's credentials
        users = [(ids[k], "device") for k in hosted_users] + [(monitor_id(o.shard), "device")]
        t = time.monotonic()
        made = ensure_credentials(state, users, self.broker, self.note)
        from mqtt_broker import load_credentials

        probe = load_credentials(state, monitor_id(o.shard))
        if host is not None and port is not None:
            probe = dataclasses.replace(probe, host=host, port=port)
        wait_accepted(probe)
        if made:
            self.note(f"credentials: {made} users added in {time.monotonic() - t:.1f}s")
        spec = FleetSpec(
            federation=probe.federation, devices=tuple(ids), profile_of=tuple(assigned),
            profiles=profiles.profiles,
            seed=cfg.run.seed, dataset=cfg.run.data.dataset, data_dir=cfg.run.data.data_dir,
            partition_file=str(part_file), credentials_dir=str(state / "credentials"),
            state_root=str(self.out / "devices"), events_dir=str(self.out / "events"), edge=cfg.edge,
            shard=o.shard, shards=o.shards, workers=workers, network=network, model_slots=emu.model_slots,
            broker_host=host,
            broker_port=port,
            trace=trace, extra={"rounds": cfg.run.rounds, "strategy": cfg.run.strategy,
                                "mix": dict(profiles.mix)})
        spec.save(self.out / "fleet.json")
        if o.shard == 0:
            if o.broker_state is not None:  # a broker that may have served this federation before
                coord = load_credentials(state, "coordinator")
                if host is not None and port is not None:
                    coord = dataclasses.replace(coord, host=host, port=port)
                clear_round_plan(coord)
            fed = federation_table(cfg, n)
            if emu.http_models:  # models over HTTP: nginx serves the coordinator's model files for the run
                fed.update(self._model_server(state))
            cohort = cohort_size(n, int(fed["quorum"]), float(fed["over_selection"]))  # what a round selects
            run = self._secure_dropout(cfg.run, profiles.profiles, assigned, float(fed["deadline_s"]), trace, cohort)
            write_federation_toml(self.out / "federation.toml", fed, run,
                                  state / "credentials/coordinator.toml",
                                  self.out / "coordinator")
            from coordinator.config import load_coordinator_config

            load_coordinator_config(self.out / "federation.toml")  # a bad config fails before anything starts
        return spec

    def _secure_dropout(self, run: Any, profiles: Any, assigned: list[str], deadline_s: float, trace: Any,
                        cohort: int | None = None) -> Any:
        """Secure rounds: unless ``[privacy] secure_dropout`` is set, the threshold and the neighbour graph are
        chosen for the dropouts this fleet's profiles predict within a round's deadline, at most the highest the
        coordinator accepts for the ``cohort`` it selects a round (:func:`flayer.engine.secure_plan.accepted_dropout`:
        above it, every round would be refused)."""
        if not run.privacy.secure_aggregation or self.cfg.extra.get("secure_dropout_given"):
            return run
        if trace is not None:
            self.note(f"secure aggregation: availability comes from a trace, so the threshold is chosen for "
                      f"secure_dropout = {run.privacy.secure_dropout:g} ([privacy] secure_dropout to change it)")
            return run
        rate = secure_dropout_for(profiles, assigned, deadline_s)
        capped = accepted_dropout(cohort, rate, corrupt_fraction(run.privacy)) if cohort is not None else rate
        if capped is None:
            raise ConfigError(f"secure aggregation: the profiles predict a dropout rate of {rate:g} within the "
                              f"{deadline_s:g} s deadline, and a cohort of {cohort} devices is accepted at none down "
                              f"to 0.01: select more devices ([federation] quorum, over_selection)")
        if capped < rate:
            self.note(f"secure aggregation: the profiles predict a dropout rate of {rate:g} (the chance that a device "
                      f"goes off or crashes within the {deadline_s:g} s deadline); the cohort of {cohort} is "
                      f"accepted up to {capped:g}: using {capped:g} (a larger cohort, [federation] quorum or "
                      f"over_selection, takes more; [privacy] secure_dropout to set it)")
        else:
            self.note(f"secure aggregation: threshold chosen for a dropout rate of {rate:g}, the profiles' chance "
                      f"that a device goes off or crashes within the {deadline_s:g} s deadline ([privacy] "
                      f"secure_dropout to set it)")
        return dataclasses.replace(run, privacy=dataclasses.replace(run.privacy, secure_dropout=capped))

    def _model_server(self, state: Path) -> dict[str, str]:
        from coordinator.model_server import NginxServer
        from mqtt_broker.state import BrokerFiles, write_models_htpasswd

        taken = sorted({"models_dir", "models_url"} & set(self.cfg.federation))
        if taken:
            raise ConfigError(f"[federation] {', '.join(taken)}: set by the emulator with http_models; leave them out")
        files = BrokerFiles.at(state)  # the federation's devices and coordinator only (transport.models_auth)
        htpasswd = write_models_htpasswd(files) if files.config.exists() else None
        self.nginx = NginxServer(self.out / "models", self.out / "nginx", htpasswd=htpasswd).start()
        self.note(f"models over HTTP: nginx pid {self.nginx.pid} serving {self.nginx.root} at {self.nginx.url}"
                  + (" to the federation's devices" if htpasswd is not None else " to anyone (no broker.json)"))
        return {"models_dir": str(self.nginx.root), "models_url": self.nginx.url}

    def _broker(self, o: LaunchOptions, devices: int) -> Path:
        from mqtt_broker import BrokerConfig, start_broker
        from mqtt_broker.config import DEFAULT_MAX_CONNECTIONS

        if o.broker_state is not None:
            self.broker_desc = f"broker of {o.broker_state}" + (f" at {o.broker_url}" if o.broker_url else "")
            return o.broker_state.resolve()
        state = self.out / "broker"
        self.broker = start_broker(BrokerConfig(federation=self.cfg.emulator.federation, persistence=False,
                                                max_connections=devices + 256 if devices + 256 >
                                                DEFAULT_MAX_CONNECTIONS else 0),
                                   state,
                                   kind=self.cfg.emulator.broker_kind, timeout=30)
        self.broker_desc = f"{self.broker.kind} broker pid {self.broker.pid} on 127.0.0.1:{self.broker.port}"
        return state

    # ---- processes ---------------------------------------------------------------------------------------
    def start(self, spec: FleetSpec) -> None:
        o = self.opts
        logs = self.out / "logs"
        verbose = ["-v"] * o.verbose
        if o.shard == 0:
            args = ["--config", str(self.out / "federation.toml"), "--events",
                    str(self.out / "coordinator/events.jsonl")]
            if spec.broker_host is not None:
                args += ["--host", spec.broker_host, "--port", str(spec.broker_port)]
            self.coordinator = Child("coordinator", "emulator.coordinator_proc", args + verbose,
                                     logs / "coordinator.log")
        for w in range(spec.workers):
            self.workers.append(Child(f"worker {w}", "emulator.worker",
                                      ["--fleet", str(self.out / "fleet.json"), "--worker", str(w), *verbose],
                                      logs / f"worker-{o.shard}-{w}.log"))
        self._start_monitor(spec)

    def _start_monitor(self, spec: FleetSpec) -> None:
        from transport import Credentials

        creds = Credentials.load(Path(spec.credentials_dir) / f"{monitor_id(spec.shard)}.toml")
        if spec.broker_host is not None and spec.broker_port is not None:
            creds = dataclasses.replace(creds, host=spec.broker_host, port=spec.broker_port)
        mine = {spec.devices[k] for k in spec.mine()}

        def on_plan(plan: Any) -> None:
            self.on_event("plan", {"round": plan.round, "selected": len(plan.selected),
                                   "here": len(mine & set(plan.selected))})

        self.monitor = PlanWatch(creds, on_plan if spec.shard > 0 else None).start()  # only plans the coordinator signed (emulator.plan_watch)

    # ---- following the fleet -------------------------------------------------------------------------------
    def follow(self, spec: FleetSpec, progress: FleetProgress) -> None:
        tails = [JsonlTail(self.out / "coordinator/events.jsonl")] if self.coordinator else []
        tails += [JsonlTail(spec.events_file(w)) for w in range(spec.workers)]
        timeout = self.cfg.emulator.timeout_s
        t0 = time.monotonic()
        assert self.monitor is not None, "start() first"
        while True:
            for tail in tails:
                for ev in tail.read():
                    kind = progress.feed(ev)
                    self._show(kind, ev, progress)
            self.monitor.poll()
            coord_rc = self.coordinator.poll() if self.coordinator else None
            if coord_rc not in (None, 0):
                raise EmulatorError(f"the coordinator exited with status {coord_rc}; its log "
                                    f"({self.coordinator.log_file}):\n{self.coordinator.tail()}")  # type: ignore[union-attr]
            if not self.wrapped and (self.monitor.final_seen or coord_rc == 0):
                self.wrapped = True
                self.on_event("wrap_up", {})
                for w in self.workers:
                    w.signal(signal.SIGUSR1)
            for w in self.workers:
                rc = w.poll()
                if rc not in (None, 0) and not self.wrapped:
                    raise EmulatorError(f"{w.name} exited with status {rc}; its log ({w.log_file}):\n"
                                        f"{w.tail()}")
            workers_done = all(w.poll() is not None for w in self.workers)
            if workers_done and (coord_rc is not None or not self.coordinator):
                for tail in tails:  # the last words
                    for ev in tail.read():
                        progress.feed(ev)
                return
            if timeout and time.monotonic() - t0 > timeout:
                raise EmulatorError(f"the fleet did not finish within {timeout:.0f} s (timeout_s); logs in "
                                    f"{self.out / 'logs'}")
            time.sleep(0.25)

    def _show(self, kind: str | None, ev: dict[str, Any], progress: FleetProgress) -> None:
        if kind == "open":
            self.on_event("open", ev)
        elif kind == "round":
            r = int(ev["record"]["round"])
            if self.metrics is not None:
                self.metrics.write(emulate_round_record(ev["record"], progress.opens.get(r, {}),
                                                        progress.online_at_close.get(r), progress.link_bytes(r)))
            self.on_event("round", progress.rows()[-1] if progress.records and max(progress.records) == r else
                          {"round": r})
        elif kind in ("crash", "restart", "error", "waiting"):
            self.on_event(kind, ev)

    def shutdown(self) -> dict[str, int | None]:
        """Stop what this launcher started, by PID (Ctrl-C and SIGTERM are ignored meanwhile)."""
        main = threading.current_thread() is threading.main_thread()  # signals can be set there only
        old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        exits: dict[str, int | None] = {}
        try:
            for w in self.workers:
                exits[w.name] = w.stop(timeout=60)
            if self.coordinator is not None:
                exits["coordinator"] = self.coordinator.stop(timeout=30)
            if self.monitor is not None:
                self.monitor.stop(timeout=1.0)
            if self.broker is not None:
                self.broker.stop()
            if self.nginx is not None:
                self.nginx.stop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return exits


def run_fleet(opts: LaunchOptions, on_event: OnEvent = lambda kind, info: None) -> FleetResult:
    """Run one shard of the fleet to the end (see module docstring); writes ``rounds.jsonl``,
    ``devices.jsonl`` and ``summary.json`` under ``opts.out``."""
    from .report import write_outputs

    launch = _Launch(opts, on_event)
    t0 = time.monotonic()
    exits: dict[str, int | None] = {}
    try:
        spec = launch.setup()
        progress = FleetProgress(dict(zip(spec.devices, spec.profile_of)))
        if opts.shard == 0:
            launch.metrics = MetricsFile(launch.out / "metrics.jsonl", "w")
            launch.metrics.write(run_record("emulate", time.time(), str(spec.extra.get("strategy")),
                                            opts.cfg.run.rounds, len(spec.devices), federation=spec.federation))
        on_event("setup", {"spec": spec, "broker": launch.broker_desc, "out": launch.out})
        launch.start(spec)
        on_event("started", {"coordinator": launch.coordinator.pid if launch.coordinator else None,
                             "workers": [w.pid for w in launch.workers]})
        t1 = time.monotonic()
        launch.follow(spec, progress)
    finally:
        exits = launch.shutdown()
    t2 = time.monotonic()
    if opts.shard == 0:
        finished = bool(progress.coordinator_done and progress.coordinator_done.get("finished"))
    else:
        finished = all(rc == 0 for rc in exits.values())
    if launch.metrics is not None:
        rows = progress.rows()
        launch.metrics.write(end_record("emulate", time.time(), len(rows), finished, rows[-1]["acc"] if rows else None,
                                        run_s=round(t2 - t1, 1)))
        launch.metrics.close()
    result = FleetResult(launch.out, spec, progress, progress.rows(), t1 - t0, t2 - t1, launch.broker_desc,
                         finished,
                         exits)
    write_outputs(result)
    return result
