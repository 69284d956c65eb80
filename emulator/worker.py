"""``python -m emulator.worker --fleet OUT/fleet.json --worker W``: one worker process of a fleet.

It loads the data set once, builds each of its devices' ClientData from the saved partition file,
loads each device's own credentials, and hosts the devices as threads (:class:`FleetHost`), with
torch limited to one thread (several workers and many devices share the cores). With the ``shared``
network mode one :class:`emulator.netloop.SharedNetwork` thread runs every connection of the
process; with ``thread`` each client has paho's own network thread.

Signals: SIGTERM stops every device cleanly and exits; SIGUSR1 means the federation is over (every
device comes online once to save its personal model, then the worker exits); SIGINT is ignored (the
launcher owns Ctrl-C and stops its workers by PID). Exit status 0 when every device finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .availability import device_timeline
from .device import ByteCounter, EmulatedDevice
from .events import EventLog
from .fleet import FleetSpec
from .host import FleetHost
from .slots import ModelSlots

__all__ = ["build_host", "main"]

log = logging.getLogger(__name__)


def load_creds(spec: FleetSpec, device: str) -> Any:
    from transport import Credentials

    creds = Credentials.load(Path(spec.credentials_dir) / f"{device}.toml")
    if spec.broker_host is not None and spec.broker_port is not None:
        creds = dataclasses.replace(creds, host=spec.broker_host, port=spec.broker_port)
    return creds


def build_host(spec: FleetSpec, worker: int, *, dataset: Any = None, network: Any = None,
               pool_threads: int = 8) -> tuple[FleetHost, EventLog]:
    """The host of worker ``worker``'s devices (data loaded here unless ``dataset`` is given)."""
    from flayer.data import load_dataset
    from flayer.partition import load_partition
    from flayer.train import client_data

    ds = dataset if dataset is not None else load_dataset(spec.dataset, spec.data_dir)
    part = load_partition(spec.partition_file, len(ds), ds.fingerprint())
    if part.num_clients != len(spec.devices):
        raise ValueError(f"{spec.partition_file} holds {part.num_clients} clients for {len(spec.devices)} "
                         f"devices")
    events = EventLog(spec.events_file(worker))
    counter = ByteCounter()
    pool = ThreadPoolExecutor(pool_threads, thread_name_prefix=f"emu-ops-{worker}")
    slots = ModelSlots(spec.model_slots) if spec.model_slots > 0 else None
    devices: list[EmulatedDevice] = []
    timelines: list[Iterator[tuple[float, str]]] = []
    for i in spec.of_worker(worker):
        dev_id = spec.devices[i]
        profile = spec.profiles[spec.profile_of[i]]
        devices.append(EmulatedDevice(i, dev_id, profile, spec.edge_settings(i), load_creds(spec, dev_id),
                                      client_data(ds, part.clients[i]), events, counter, pool, network,
                                      model_slots=slots))
        trace = spec.trace.get(dev_id) if spec.trace is not None and dev_id in spec.trace else None
        timelines.append(device_timeline(profile, spec.seed, dev_id, trace))
    from .host import process_memory

    events.write("worker", worker=f"{spec.shard}-{worker}", pid=os.getpid(), devices=[d.id for d in devices],
                 network=spec.network, model_slots=spec.model_slots,
                 **{f"base_{k}": round(v, 1) for k, v in process_memory().items()})
    return FleetHost(devices, timelines, events, counter, pool, name=f"{spec.shard}-{worker}", slots=slots), events


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m emulator.worker", description=__doc__.splitlines()[0])
    p.add_argument("--fleet", required=True, type=Path)
    p.add_argument("--worker", required=True, type=int)
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), stream=sys.stderr,
                        format=f"%(asctime)s worker {args.worker} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    spec = FleetSpec.load(args.fleet)
    network = None
    if spec.network == "shared":
        from .netloop import SharedNetwork

        network = SharedNetwork(name=f"mqtt-net-{args.worker}").start()
    host, events = build_host(spec, args.worker, network=network)
    signal.signal(signal.SIGTERM, lambda *_: host.stop())
    signal.signal(signal.SIGUSR1, lambda *_: host.wrap_up())
    try:
        counts = host.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # a late signal must not kill the interpreter's exit
            signal.signal(sig, signal.SIG_IGN)   # (Python puts SIG_DFL back for its own handlers there)
        if network is not None:
            network.close()
        events.close()
    return 0 if set(counts) <= {"finished"} else 1


if __name__ == "__main__":
    sys.exit(main())
