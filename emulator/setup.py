"""Getting a fleet ready: the output folder, the partition, the broker and everyone's credentials,
the coordinator's config file.

Broker choices (see docs/explanation/emulator.md):

- default (shard 0): the emulator starts its own broker in ``OUT/broker`` (Mosquitto when installed,
  else the embedded one; ``broker_kind`` picks) and stops it at the end;
- ``broker_state=DIR``: the state folder of a broker started by ``flayer broker start`` (or by shard 0
  of this fleet). Missing credentials are created there (``add_device``) and the recorded broker is
  told to reload; a broker not recorded there (another machine) needs them made beforehand;
- ``broker_url=mqtt://HOST:PORT`` (with ``broker_state``): connect there instead of the address in the
  credentials files.

Users: the coordinator, every device (its id), and one monitor per shard (``emu-monitor-<i>``, a
device-role user that only reads the round plan).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from flayer.config import ConfigError, RunConfig

__all__ = [
    "OWNED",
    "clear_round_plan",
    "ensure_credentials",
    "make_partition_file",
    "monitor_id",
    "parse_broker_url",
    "prepare_out",
    "wait_accepted",
    "write_federation_toml",
]

log = logging.getLogger(__name__)

# what a previous emulator run leaves in its output folder (removed before a new run there)
OWNED = ("fleet.json", "partition.npz", "federation.toml", "metrics.jsonl", "rounds.jsonl", "devices.jsonl",
         "summary.json", "accuracy.png", "bytes.png", "device_accuracy.png", "broker", "coordinator", "devices", "events",
         "logs", "models", "nginx")


def monitor_id(shard: int) -> str:
    return f"emu-monitor-{shard}"


def prepare_out(out: Path) -> None:
    """Create ``out``; a previous emulator run's files there are removed, anything else is refused."""
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"--out {out} exists and is not a folder")
        if any(out.iterdir()) and not (out / "fleet.json").exists():
            raise ConfigError(f"--out {out} is not empty and holds no emulator run (no fleet.json); "
                              f"choose another folder")
        from mqtt_broker import recorded_process

        if (out / "broker" / "run.json").exists() and recorded_process(out / "broker") is not None:
            raise ConfigError(f"a broker still runs for {out / 'broker'}; is another emulation using {out}?")
        for name in OWNED:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def make_partition_file(run: RunConfig, out: Path) -> tuple[Path, int]:
    """The fleet's partition (one client per device): the run's saved file, or made from the run's
    settings (seeded) and saved as ``OUT/partition.npz``. Returns (path, number of clients)."""
    from flayer.data import load_dataset
    from flayer.partition import load_partition, make_partition, save_partition

    ds = load_dataset(run.data.dataset, run.data.data_dir)
    if run.data.partition_file:
        part = load_partition(run.data.partition_file, len(ds), ds.fingerprint())
        return Path(run.data.partition_file).resolve(), part.num_clients
    part = make_partition(ds.y, ds.num_classes, run.data.clients, run.data.partition, run.partition_seed,
                          samples=run.data.samples, test_fraction=run.data.test_fraction,
                          val_fraction=run.data.val_fraction, batch_size=run.train.batch_size,
                          meta={"dataset": ds.name, "dataset_fingerprint": ds.fingerprint()})
    return save_partition(part, out / "partition.npz").resolve(), part.num_clients


def parse_broker_url(url: str) -> tuple[str, int]:
    """``mqtt://HOST:PORT`` -> (host, port)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "mqtt" or not u.hostname or u.path not in ("", "/") or u.username or u.query:
        raise ConfigError(f"--broker {url!r}: expected mqtt://HOST:PORT (plain MQTT; credentials come from "
                          f"--broker-state)")
    try:
        port = u.port or 1883
    except ValueError:
        raise ConfigError(f"--broker {url!r}: bad port") from None
    return u.hostname, port


def ensure_credentials(state_dir: Path, users: Iterable[tuple[str, str]], managed: Any = None,
                       on_note: Any = None) -> int:
    """Make sure ``users`` ((name, role) pairs) have credentials in ``state_dir``; missing device users
    are added when the folder is a broker's (broker.json) and that broker reloaded. Returns how many
    were created."""
    from mqtt_broker import BrokerFiles, add_device, load_credentials, reload_recorded

    files = BrokerFiles.at(state_dir)
    missing = [(u, r) for u, r in users if not files.credentials(u).exists()]
    if missing and not files.config.exists():
        raise ConfigError(f"{state_dir}: no credentials for {', '.join(u for u, _ in missing[:5])}"
                          f"{'...' if len(missing) > 5 else ''} and no broker.json to make them with; "
                          f"give the state folder of the broker (--broker-state)")
    bad = [u for u, r in missing if r != "device"]
    if bad:
        raise ConfigError(f"{state_dir}: no credentials for the {', '.join(bad)}")
    for i, (user, _) in enumerate(missing):
        add_device(state_dir, user, exist_ok=True)
        if on_note is not None and (i + 1) % 200 == 0:
            on_note(f"credentials: {i + 1}/{len(missing)}")
    for user, role in users:
        creds = load_credentials(state_dir, user)
        if creds.role != role:
            raise ConfigError(f"{files.credentials(user)} is a {creds.role}'s, not a {role}'s")
    if missing:
        if managed is not None:
            managed.reload()
        elif reload_recorded(state_dir) is None:
            log.warning("added %d device(s) to %s but no broker is recorded there: make its broker re-read "
                        "its password file (SIGHUP, or 'flayer broker add-device' does it)", len(missing),
                        state_dir)
    return len(missing)


def _toml_value(v: Any) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise ConfigError(f"cannot write {v!r} into a TOML file (strings, numbers and booleans only)")


def write_federation_toml(path: Path, fed: Mapping[str, Any], run: RunConfig, credentials: Path,
                          state_dir: Path) -> Path:
    """The coordinator's ``federation.toml`` for this fleet (read back by ``flayer coordinator``'s loader)."""
    lines = ["# written by flayer emulate: the coordinator of this emulated fleet", "[federation]",
             f"credentials = {_toml_value(str(credentials))}", f"state_dir = {_toml_value(str(state_dir))}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in fed.items() if v is not None]
    lines += ["", "[run]", f"strategy = {_toml_value(run.strategy)}", f"rounds = {run.rounds}",
              f"seed = {run.seed}",
              "", "[data]", f"dataset = {_toml_value(run.data.dataset)}"]
    if run.data.model:
        lines.append(f"model = {_toml_value(run.data.model)}")
    t = run.train
    lines += ["", "[train]", f"lr = {t.lr!r}", f"batch_size = {t.batch_size}",
              f"local_epochs = {t.local_epochs}"]
    for name, opts in run.strategy_options.items():
        if opts:
            lines += ["", f"[strategy.{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in opts.items()]
    if run.privacy.enabled or run.privacy.secure_aggregation:  # DP: the population defaults to the fleet
        dp = {k: v for k, v in dataclasses.asdict(run.privacy).items() if v is not None}
        if run.privacy.enabled:
            dp.setdefault("population", run.data.clients)
        lines += ["", "[privacy]"] + [f"{k} = {_toml_value(v)}" for k, v in dp.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_accepted(creds: Any, timeout: float = 15.0) -> None:
    """Until the broker accepts ``creds`` (after a reload the password file is read asynchronously).
    Connects with a clean session and no will, so it leaves nothing behind."""
    import time

    from transport.credentials import mqtt_connect_settings
    from transport.link import probe

    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe(mqtt_connect_settings(creds))
        if last is not None and last.ok:
            return
        time.sleep(0.2)
    raise ConfigError(f"the broker at {creds.host}:{creds.port} does not accept {creds.username}'s "
                      f"credentials "
                      f"({last}); does it read this state folder's password file?")


def clear_round_plan(coordinator: Any, timeout: float = 10.0) -> None:
    """Empty the retained round plan (as the coordinator, before it starts): on a broker that served this
    federation before, the last run's ``final`` plan would tell every device the federation is over."""
    import queue

    from protocol import Topics
    from transport.credentials import mqtt_connect_settings
    from transport.link import Connected, MqttLink

    events: queue.Queue[Any] = queue.Queue()
    link = MqttLink(mqtt_connect_settings(coordinator), events.put, clean_session=True)
    link.start()
    try:
        ev = events.get(timeout=timeout)
        if not (isinstance(ev, Connected) and ev.ok):
            raise ConfigError(f"the broker refused the coordinator's credentials ({ev})")
        if not link.wait_published([link.publish(Topics(coordinator.federation).round(), b"", retain=True)],
                                   timeout):
            raise ConfigError("the broker did not acknowledge clearing the retained round plan")
    except queue.Empty:
        raise ConfigError(f"no answer from the broker at {coordinator.host}:{coordinator.port}") from None
    finally:
        link.stop(timeout=1.0)


def raise_open_files(needed: int) -> int:
    """Raise this process's open-file limit (inherited by the broker and the workers it starts) to the
    hard limit; ConfigError when even that is below ``needed`` (a broker holds one descriptor per
    connection, a worker one per device plus the shared network thread's). Returns the soft limit."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to raise
        return needed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, exc)
    if soft < needed:
        raise ConfigError(f"this fleet needs about {needed} open files per process (the broker holds one per "
                          f"connection) but the limit is {soft} (hard {hard}): raise it, e.g. 'ulimit -n "
                          f"{needed}' as root or LimitNOFILE in a service, or shard the fleet (--shard)")
    return soft
