"""What an emulated device holds in memory: eight devices (FLAYER, which keeps a personal head between
rounds) in a worker host of this process, the real coordinator in a thread, a real broker, 2 model slots.

- An idle device holds no model: once its round is trained, sent and acknowledged (and the plan open
  has nothing more for it), nothing reachable
  from its client is a tensor, a torch module or an optimiser (its data set aside): the global model is
  on disk (``global_model.bin``), its client state in its state file, read back for the next round.
- At most the worker's model slots hold a model at once: counted by the clients themselves (a client
  holds a model from the fetch that starts it to the moment it is idle again), in the rounds and in the
  final phase, where all eight devices take the final plan together.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from emutestlib import start_test_broker

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from emulator.fleet import FleetSpec
from emulator.options import DEFAULT_EDGE
from emulator.profiles import DeviceProfile
from emulator.worker import build_host

pytestmark = pytest.mark.integration

N, SLOTS = 8, 2
# what a client refers to that is not its own (its data, the network, the host's hooks and queues)
NOT_ITS_OWN = {"data", "source", "link", "events", "jobs", "_thread", "on_progress", "after_compute", "sleep",
               "clock", "shaper", "model_slots", "_slot_lock", "_stopped", "topics", "creds", "settings", "limits",
               "rng", "device"}


def torch_objects(client: EdgeClient) -> list[str]:
    """Tensors, modules and optimisers reachable from the client's own attributes."""
    found: list[str] = []
    seen: set[int] = set()
    todo = [(k, v) for k, v in vars(client).items() if k not in NOT_ITS_OWN]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, type(gc), str, bytes, int, float)) or callable(obj) \
                and not isinstance(obj, torch.nn.Module):
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
            found.append(f"{path}: {type(obj).__name__}")
            continue
        todo += [(path, r) for r in gc.get_referents(obj)]
    return found


class Holders:
    """Clients holding a model at once (from their fetch to their idle point), per phase."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now: set[str] = set()
        self.peak = {"train": 0, "final": 0}
        self.idle: dict[str, list[str]] = {}  # device -> torch objects it held, idle after a round


def counted(holders: Holders) -> type[EdgeClient]:
    class Counted(EdgeClient):
        def _fetch(self, plan: Any) -> None:
            with holders.lock:
                holders.now.add(self.id)
                holders.peak[plan.phase] = max(holders.peak.get(plan.phase, 0), len(holders.now))
            super()._fetch(plan)

        def _release_idle(self) -> None:
            super()._release_idle()
            if self._model is None and not self._busy and self._download is None:
                with holders.lock:
                    holders.now.discard(self.id)
            plan = self.plan  # idle: trained, answered, and nothing to train on the plan now open
            if plan is not None and plan.phase == "train" and self.rounds_trained and not self._busy \
                    and self._download is None and self._pending is None and not self._trains_on(plan) \
                    and self.id not in holders.idle:
                holders.idle[self.id] = torch_objects(self)

    return Counted


def test_idle_devices_hold_no_model_and_slots_bound_the_holders(tmp_path: Path, digits: Any) -> None:
    from coordinator.config import load_coordinator_config
    from coordinator.server import Coordinator
    from flayer.partition import make_partition, save_partition

    ids = [f"dev-{i:03d}" for i in range(N)]
    tb = start_test_broker(tmp_path, ids)
    part = make_partition(digits.y, digits.num_classes, N, "iid", 0,
                          meta={"dataset": "digits", "dataset_fingerprint": digits.fingerprint()})
    part_file = save_partition(part, tmp_path / "partition.npz")
    fed = tmp_path / "federation.toml"
    fed.write_text(f'[federation]\ncredentials = "{tb.state}/credentials/coordinator.toml"\n'
                   f'state_dir = "{tmp_path}/coord"\nquorum = {N}\nmin_devices = {N}\nover_selection = 1.0\n'
                   f'grace_s = 0.0\ndeadline_s = 120.0\n[run]\nstrategy = "flayer"\nrounds = 2\n'
                   f'[data]\ndataset = "digits"\n[train]\nlr = 0.05\n')
    coord = Coordinator(load_coordinator_config(fed), tb.coordinator)
    spec = FleetSpec(federation="etest", devices=tuple(ids), profile_of=("fast",) * N,
                     profiles={"fast": DeviceProfile("fast")}, seed=0, dataset="digits",
                     partition_file=str(part_file), credentials_dir=str(tb.state / "credentials"),
                     state_root=str(tmp_path / "devices"), events_dir=str(tmp_path / "events"),
                     edge=EdgeSettings(**{**DEFAULT_EDGE, "heartbeat_s": 1.0}), model_slots=SLOTS)
    host, events = build_host(spec, 0, dataset=digits)
    holders = Holders()
    for d in host.devices:
        d.client_factory = counted(holders)
    coord_thread = coord.start()
    host_thread = threading.Thread(target=host.run, daemon=True)
    host_thread.start()
    try:
        coord_thread.join(180)
        assert not coord_thread.is_alive(), "the federation did not finish"
        result = coord._thread_result
        assert not isinstance(result, BaseException) and result is not None and result.finished
        assert [r["accepted"] for r in result.history] == [N, N]
        host.wrap_up()
        host_thread.join(60)
        assert not host_thread.is_alive()
        assert all(d.state == "finished" and d.rounds_trained == [1, 2] and d.final_acc is not None
                   for d in host.devices)
        # idle after its round (most devices are, before the round closes): no tensor, module or optimiser
        assert len(holders.idle) >= N // 2, holders.idle
        assert all(found == [] for found in holders.idle.values()), holders.idle
        # never more than the slots holding a model; the final phase filled them (all eight wanted one)
        assert holders.peak["final"] == SLOTS and 1 <= holders.peak["train"] <= SLOTS, holders.peak
        assert host.slots is not None and host.slots.peak == SLOTS and host.slots.held == 0
        assert host.slots.waited >= N - SLOTS
    finally:
        host.stop()
        coord.stop()
        host_thread.join(30)
        coord_thread.join(30)
        events.close()
        tb.broker.stop()
