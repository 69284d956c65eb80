"""Delta downloads on a live Mosquitto with the real coordinator and edge clients: devices holding the
previous model fetch only the delta and rebuild the published model bit for bit; a tampered delta
or one whose chunks never come is refused and the full model fetched."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fedtestlib import FedBroker, Recorder, federation_toml, finished, iid_shards

from coordinator.config import load_coordinator_config
from coordinator.deltas import DeltaChain
from coordinator.publish import ModelBlob, Publisher
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.work import SkipRound
from flayer.update import state_numpy
from protocol import UpdateHeader, blob_digest
from protocol.model_delta import make_delta


def held_digest(client: EdgeClient) -> str | None:
    """The digest of the model a device holds: its global_model.bin (an idle client keeps none in memory)."""
    held = client._held.load(client.limits)
    return held[0] if held is not None else None


pytestmark = [pytest.mark.integration]
DEVICES = ["dev-a", "dev-b"]


@pytest.fixture
def fed(fed_broker):  # type: ignore[no-untyped-def]
    return fed_broker(DEVICES)


@pytest.fixture(scope="module")
def shards(digits):  # type: ignore[no-untyped-def]
    return iid_shards(digits, 2)


class TamperedChain(DeltaChain):
    """Offers a valid delta blob that leads to another model than the published one."""

    def advance(self, old: ModelBlob | None, old_state: Any, new_state: Any, round_: int) -> Any:
        state, model = super().advance(old, old_state, new_state, round_)
        if self.blob is not None and old is not None:
            target = {k: v + np.float32(1e-3) for k, v in state_numpy(state).items()}
            blob = make_delta(state_numpy(old_state), target, "exact",
                              UpdateHeader(self.federation, round_, self.sender, old.digest))
            self.blob = ModelBlob(blob, blob_digest(blob))
        return state, model


class MissingChain(DeltaChain):
    """Names a delta in the plan but never publishes its chunks."""

    def publish(self, publisher: Publisher, model: ModelBlob, round_: int) -> int:
        if self.blob is not None and self.target == model.digest:
            self.chunks = 1
        return 0


def _run(tmp: Path, fb: FedBroker, shards: list, mode: str, chain: type[DeltaChain] = DeltaChain) -> tuple:
    path = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                           strategy="fedavg", rounds=3, dataset="digits", quorum=2, min_devices=2,
                           delta_downloads=mode)
    coord = Coordinator(load_coordinator_config(path), fb.coordinator)
    coord.publishing.deltas = chain(mode, fb.coordinator.federation, fb.coordinator.username)
    events: dict[str, list[tuple[str, dict]]] = {d: [] for d in DEVICES}
    lock = threading.Lock()
    clients = []
    for i, d in enumerate(DEVICES):
        def record(kind: str, info: dict, d: str = d) -> None:
            with lock:
                events[d].append((kind, dict(info)))
        settings = EdgeSettings(state_dir=str(tmp / d), client_index=i, device="cpu", heartbeat_s=1.0,
                                download_stall_s=1.0, threads=1)
        clients.append(EdgeClient(settings, fb.devices[d], shards[i], on_progress=record))
    thread = coord.start()
    for c in clients:
        c.start()
    try:
        result = finished(coord, thread, 120, 3)
        for c in clients:
            assert c.wait(60) and c.error is None and c.rounds_trained == [1, 2, 3]
            assert held_digest(c) == result.model_digest  # the final model, bit for bit (on disk: idle, none in memory)
    finally:
        for c in clients:
            c.stop()
    return result, events, coord


@pytest.mark.parametrize("mode", ["exact", "int8"])
def test_devices_download_deltas_and_hold_the_published_models(tmp_path: Path, fed: FedBroker, shards: list,
                                                               mode: str) -> None:
    result, events, coord = _run(tmp_path, fed, shards, mode)
    for evs in events.values():
        downloads = [info for kind, info in evs if kind == "downloaded"]
        assert len(downloads) == 4  # rounds 1-3 and the final model
        assert "delta_bytes" not in downloads[0]  # nothing held yet: the full model
        assert all("delta_bytes" in info for info in downloads[1:]), downloads
        assert not [e for e in evs if e[0] == "delta_refused"]
    model_bytes = result.history[0]["model_bytes"]
    deltas = [info["delta_bytes"] for info in (i for k, i in events[DEVICES[0]] if k == "downloaded")
              if "delta_bytes" in info]
    assert max(deltas) < (0.5 if mode == "int8" else 1.0) * model_bytes
    # on the broker only the final model and the chain of deltas to it stay retained: older models were cleared
    rec = Recorder(fed.devices[DEVICES[0]], [f"fl/{fed.coordinator.federation}/model/+/+"])
    try:
        retained = {m.topic.split("/")[3] for m in rec.drain(1.0) if m.payload and m.retain}
    finally:
        rec.close()
    assert coord.publishing.deltas.blob is not None and coord.publishing.deltas.target == result.model_digest
    assert retained == {result.model_digest, *(link.blob.digest for link in coord.publishing.deltas.links)}, retained
    assert len(coord.publishing.deltas.links) == 3  # the deltas to rounds 2, 3 and the final model


@pytest.mark.parametrize("chain", [TamperedChain, MissingChain])
def test_a_bad_or_missing_delta_falls_back_to_the_full_model(tmp_path: Path, fed: FedBroker, shards: list,
                                                           chain: type[DeltaChain]) -> None:
    _, events, _ = _run(tmp_path, fed, shards, "exact", chain)
    for evs in events.values():
        downloads = [info for kind, info in evs if kind == "downloaded"]
        assert len(downloads) == 4 and not any("delta_bytes" in info for info in downloads)
        if chain is TamperedChain:
            refused = [info["reason"] for kind, info in evs if kind == "delta_refused"]
            assert len(refused) == 3 and all("rebuilt model" in r for r in refused), refused


def test_a_device_on_a_1_mbit_link_fits_its_upload_to_the_deadline(tmp_path: Path, fed: FedBroker,
                                                                    shards: list) -> None:
    """digits' CNN is 363 kB of fp32: 2.9 s at 1 Mbit/s, more than a 4 s round leaves after its local
    round (the margin and the 80% safety included). The device (its uplink configured, shaped by the
    emulator's token bucket) picks a smaller codec or share each round, and every upload is acknowledged
    before the plan's deadline."""
    import time

    from emulator.profiles import DeviceProfile
    from emulator.shaping import LinkShaper

    path = federation_toml(tmp_path / "federation.toml", fed.state_dir / "credentials/coordinator.toml",
                           tmp_path / "coord", strategy="fedavg", rounds=3, dataset="digits", deadline_s=4.0)
    coord = Coordinator(load_coordinator_config(path), fed.coordinator)
    seen: list[tuple[float, float, Any]] = []
    client: list[EdgeClient] = []

    def record(kind: str, info: dict) -> None:
        if kind == "trained":  # after the publish and its PUBACKs
            plan = client[0].plan
            assert plan is not None
            seen.append((time.time(), plan.deadline, dict(info)))

    settings = EdgeSettings(state_dir=str(tmp_path / "dev-a"), device="cpu", heartbeat_s=1.0, threads=1,
                            upload="fit", uplink_kbps=1000.0, error_feedback=True)
    shaper = LinkShaper(DeviceProfile("thin", up_mbps=1.0))
    client.append(EdgeClient(settings, fed.devices["dev-a"], shards[0], shaper=shaper, on_progress=record))
    thread = coord.start()
    client[0].start()
    try:
        result = finished(coord, thread, 120, 3)
        assert client[0].wait(60) and client[0].error is None
    finally:
        client[0].stop()
    model_bytes = result.history[0]["model_bytes"]
    assert [r["accepted"] for r in result.history] == [1, 1, 1]
    assert all(r["closed"] != "deadline" for r in result.history), [r["closed"] for r in result.history]
    assert len(seen) == 3
    for done_at, deadline, info in seen:
        assert info["codec"] in ("fp16", "int8") and 0 < info["budget"] < model_bytes, info
        assert info["bytes"] <= info["budget"] or info["keep"] == 0.1, info  # within budget, or at the floor
        assert done_at < deadline, (done_at, deadline, info)
    assert (tmp_path / "dev-a" / "residual-3.safetensors").exists()  # error feedback kept what was left out


def test_a_rebooted_device_rebuilds_from_the_model_it_stored(tmp_path: Path, fed: FedBroker, shards: list) -> None:
    """A device that crashes after round 1 comes back holding round 1's model (global_model.bin) and
    fetches round 2's delta instead of the whole model."""
    path = federation_toml(tmp_path / "federation.toml", fed.state_dir / "credentials/coordinator.toml",
                           tmp_path / "coord", strategy="fedavg", rounds=3, dataset="digits",
                           delta_downloads="exact")
    coord = Coordinator(load_coordinator_config(path), fed.coordinator)
    before: list[tuple[str, dict]] = []
    after: list[tuple[str, dict]] = []
    settings = EdgeSettings(state_dir=str(tmp_path / "dev-a"), device="cpu", heartbeat_s=1.0, threads=1)
    first = EdgeClient(settings, fed.devices["dev-a"], shards[0], on_progress=lambda k, i: before.append((k, i)))
    thread = coord.start()
    first.start()
    second = None
    try:
        deadline = time.monotonic() + 60
        while not any(k == "ack" and i["round"] == 1 for k, i in before) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any(k == "ack" and i["round"] == 1 for k, i in before), before
        first.crash()
        second = EdgeClient(settings, fed.devices["dev-a"], shards[0], on_progress=lambda k, i: after.append((k, i)))
        second.start()
        result = finished(coord, thread, 120)
        assert second.wait(60) and second.error is None and 3 in second.rounds_trained
        downloads = [i for k, i in after if k == "downloaded"]
        assert downloads and all("delta_bytes" in i for i in downloads), downloads
        assert held_digest(second) == result.model_digest
    finally:
        if second is not None:
            second.stop()


class SkipsRound2(EdgeClient):
    """A device that cannot train round 2 (edge_client.work.SkipRound: it reports why and sends nothing)."""

    def _train_job(self, strategy: Any, plan: Any, *args: Any) -> Any:
        if plan.round == 2:
            raise SkipRound("this test's device skips round 2")
        return super()._train_job(strategy, plan, *args)


def test_a_round_that_folds_nothing_leaves_devices_a_bounded_fetch(tmp_path: Path, fed: FedBroker,
                                                                   shards: list) -> None:
    """int8 delta downloads, and round 2 closes at its deadline with 0 updates (both devices skip it):
    the model keeps its digest, the chain gains no link from it to itself, and every device ends on the
    final model with one fetch per model change -- the full model once, then one delta each."""
    path = federation_toml(tmp_path / "federation.toml", fed.state_dir / "credentials/coordinator.toml",
                           tmp_path / "coord", strategy="fedavg", rounds=3, dataset="digits", quorum=2,
                           min_devices=2, deadline_s=6.0, delta_downloads="int8")
    coord = Coordinator(load_coordinator_config(path), fed.coordinator)
    events: dict[str, list[tuple[str, dict]]] = {d: [] for d in DEVICES}
    clients: list[EdgeClient] = []
    for i, d in enumerate(DEVICES):
        def record(kind: str, info: dict, d: str = d) -> None:
            events[d].append((kind, dict(info)))
        settings = EdgeSettings(state_dir=str(tmp_path / d), client_index=i, device="cpu", heartbeat_s=1.0,
                                download_stall_s=1.0, threads=1)
        clients.append(SkipsRound2(settings, fed.devices[d], shards[i], on_progress=record))
    thread = coord.start()
    for c in clients:
        c.start()
    try:
        result = finished(coord, thread, 120, 3)
        for c in clients:
            assert c.wait(60) and c.error is None, c.error
            assert held_digest(c) == result.model_digest  # the final model, bit for bit (on disk: idle, none in memory)
    finally:
        for c in clients:
            c.stop()
    assert result.history[1]["accepted"] == 0 and "deadline" in result.history[1]["closed"], result.history[1]
    assert all(link.base != link.target for link in coord.publishing.deltas.links)
    assert len(coord.publishing.deltas.links) == 2  # rounds 1 and 3 changed the model; round 2 added nothing
    for d, evs in events.items():
        assert [e[1]["round"] for e in evs if e[0] == "skipped"] == [2], evs
        fetches = [(kind, info) for kind, info in evs if kind in ("downloaded", "delta_step", "delta_refused")]
        assert [kind for kind, _ in fetches] == ["downloaded"] * 3, (d, fetches)  # round 1, round 2, final
        assert "delta_bytes" not in fetches[0][1] and all("delta_bytes" in info for _, info in fetches[1:]), fetches
