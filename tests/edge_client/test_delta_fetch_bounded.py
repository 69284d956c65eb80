"""The device's delta fetch is bounded: it never takes a link from a model to itself or one that does
not lead to the plan's model, and after ``MAX_DELTA_STEPS`` deltas that did not bring the plan's model
it downloads the full model. The fetch loop (edge_client.fetch.ModelFetch) is driven here with real
blobs and chunk envelopes, one chunk at a time, without a broker."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import edge_client.fetch as fetch_mod
from edge_client.delta_fetch import HeldModel, delta_source
from edge_client.fetch import MAX_DELTA_STEPS, ModelFetch
from protocol import (
    Kind,
    PeerTrust,
    Plan,
    SigningKey,
    Topics,
    UpdateHeader,
    WireLimits,
    blob_digest,
    chunk_blob,
    decode_state,
    encode_state,
)
from protocol.model_delta import DeltaRef, chain_entry, make_delta

SHAPES = {"fc.weight": (10, 36), "fc.bias": (10,)}


def _d(c: str) -> str:
    return c * 64


def _plan(model: str, delta: DeltaRef | None = None, chain: tuple[DeltaRef, ...] = (), size: int = 100) -> Plan:
    return Plan(3, ("dev",), 0.0, "fedavg", {}, {"name": "cnn"}, model, 1, size,
                delta=delta.as_plan() if delta else {}, delta_chain=tuple(chain_entry(r) for r in chain))


def test_delta_source_never_takes_a_self_link_and_follows_only_paths_to_the_plans_model() -> None:
    a, b, w, z = _d("a"), _d("b"), _d("e"), _d("f")
    held = {"x": torch.zeros(1)}
    a_b, b_b, b_z = DeltaRef(a, _d("1"), 1, 5, b), DeltaRef(b, _d("2"), 1, 5, b), DeltaRef(b, _d("3"), 1, 5)
    plan = _plan(z, b_z, (a_b, b_b))  # a round that folded nothing left the link b -> b in the chain
    assert delta_source(plan, (b, held)) == b_z  # not the self-link, listed first
    assert delta_source(plan, (a, held)) == a_b
    a_w = DeltaRef(a, _d("4"), 1, 5, w)  # a dead end: no link leaves w
    assert delta_source(_plan(z, b_z, (a_w, a_b)), (a, held)) == a_b
    b_a = DeltaRef(b, _d("5"), 1, 5, a)  # a cycle that never reaches z
    assert delta_source(_plan(z, DeltaRef(_d("c"), _d("6"), 1, 5), (a_b, b_a)), (a, held)) is None
    assert delta_source(_plan(z, DeltaRef(z, _d("7"), 1, 5)), (z, held)) is None  # holds the plan's model
    assert delta_source(_plan(z, DeltaRef(a, _d("8"), 1, 5), (a_b,)), (a, held)) == DeltaRef(a, _d("8"), 1, 5)


def test_a_walk_of_deltas_that_costs_more_than_the_model_takes_the_model() -> None:
    a, b, c, z = _d("a"), _d("b"), _d("c"), _d("f")
    held = {"x": torch.zeros(1)}
    a_b, b_c, c_z = DeltaRef(a, _d("1"), 1, 40, b), DeltaRef(b, _d("2"), 1, 40, c), DeltaRef(c, _d("3"), 1, 40)
    assert delta_source(_plan(z, c_z, (a_b, b_c), size=100), (c, held)) == c_z  # one delta: 40 < 100 bytes
    assert delta_source(_plan(z, c_z, (a_b, b_c), size=100), (b, held)) == b_c  # two: 80 < 100
    assert delta_source(_plan(z, c_z, (a_b, b_c), size=100), (a, held)) is None  # three: 120 >= 100


class _Link:
    def subscribe(self, topics: list[str]) -> None: ...
    def unsubscribe(self, topics: list[str]) -> None: ...


COORD = SigningKey.generate()  # the coordinator's key, which the device's kit carries


class _Device(ModelFetch):
    """Just the state ModelFetch needs (edge_client.client.EdgeClient holds it in the real device)."""

    def __init__(self, state_dir: Path, held: tuple[str, dict[str, torch.Tensor]]) -> None:
        self.id, self.link, self.topics, self.limits = "dev", _Link(), Topics("fed"), WireLimits()  # type: ignore[assignment]
        self.plan = None
        self.trust = PeerTrust("fed", COORD.public)  # type: ignore[assignment]
        self.strategies = SimpleNamespace(get=lambda plan: None)  # type: ignore[assignment]
        self.clock, self.sleep, self.shaper = (lambda: 0.0), (lambda s: None), None
        self._download, self._delta, self._held, self._model, self._link_kbps = None, None, HeldModel(state_dir), held, None
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.ready = 0

    def _set_state(self, name: str) -> None: ...

    def _progress(self, kind: str, **info: Any) -> None:
        self.events.append((kind, info))

    def _model_ready(self) -> None:
        self.ready += 1


def _drive(dev: _Device, plan: Plan, blobs: dict[str, bytes], cap: int = 40) -> list[str]:
    """Hand the device the plan, then every chunk of whatever it downloads, until it downloads nothing
    more (or ``cap`` downloads); the digests it downloaded, in order."""
    dev.plan = plan
    dev._fetch(plan)
    fetched: list[str] = []
    while dev._download is not None and len(fetched) < cap:
        digest = dev._download.digest
        fetched.append(digest)
        for payload in chunk_blob(blobs[digest], Kind.MODEL_CHUNK, "fed", "coordinator", plan.round, 4096,
                                  key=COORD):
            dev._on_model_chunk(digest, payload)
    return fetched


@pytest.fixture
def models(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Two versions x -> z, the self-delta x -> x and the delta x -> z, all as real blobs."""
    monkeypatch.setattr(fetch_mod, "decode_global", lambda blob, strategy, limits: {
        k: torch.from_numpy(v.copy()) for k, v in decode_state(blob, limits).items()})
    rng = np.random.default_rng(0)
    x = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    z = {k: v + np.float32(0.01) * (rng.random(v.shape) < 0.3) for k, v in x.items()}
    xb, zb = encode_state(x), encode_state(z)
    header = UpdateHeader("fed", 3, "coordinator", blob_digest(xb))
    self_blob, xz_blob = make_delta(x, x, "exact", header), make_delta(x, z, "exact", header)

    def ref(blob: bytes, target: str = "") -> DeltaRef:
        return DeltaRef(blob_digest(xb), blob_digest(blob), len(chunk_blob(blob, Kind.MODEL_CHUNK, "f", "c", 3, 4096)),
                        len(blob), target)

    return {"x": (blob_digest(xb), {k: torch.from_numpy(v) for k, v in x.items()}), "z": blob_digest(zb),
            "self": ref(self_blob, blob_digest(xb)), "xz": ref(xz_blob), "size": len(zb),
            "blobs": {blob_digest(b): b for b in (zb, self_blob, xz_blob)}}


def test_a_device_offered_a_self_link_takes_the_delta_to_the_plans_model(tmp_path: Path, models: dict) -> None:
    dev = _Device(tmp_path, models["x"])
    plan = _plan(models["z"], models["xz"], (models["self"],), size=models["size"])
    fetched = _drive(dev, plan, models["blobs"])
    assert fetched == [models["xz"].digest]  # one delta, straight to the plan's model
    assert dev._model is not None and dev._model[0] == models["z"] and dev.ready == 1
    assert [k for k, _ in dev.events] == ["downloaded"]


def test_deltas_that_never_reach_the_plans_model_end_in_the_full_model(tmp_path: Path, models: dict,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the plan offers (here a source that keeps naming the self-link), a device takes at most
    MAX_DELTA_STEPS deltas towards one plan's model, then downloads the model itself."""
    monkeypatch.setattr(fetch_mod, "delta_source", lambda plan, held: models["self"])
    dev = _Device(tmp_path, models["x"])
    plan = _plan(models["z"], models["xz"], size=models["size"])
    fetched = _drive(dev, plan, models["blobs"])
    assert fetched == [models["self"].digest] * MAX_DELTA_STEPS + [models["z"]]
    assert dev._model is not None and dev._model[0] == models["z"] and dev.ready == 1
    refused = [info["reason"] for kind, info in dev.events if kind == "delta_refused"]
    assert refused == [f"{MAX_DELTA_STEPS} deltas taken, model not rebuilt"]
    dev._fetch(plan)  # the plan again (a reconnect): the model is held, nothing more is fetched
    assert dev._download is None and dev.ready == 2
    # the next plan's model starts a fresh count: its delta is taken again
    plan2 = _plan(_d("9"), DeltaRef(models["z"], _d("8"), 1, 5))
    monkeypatch.setattr(fetch_mod, "delta_source", delta_source)
    dev.plan = plan2
    dev._fetch(plan2)
    assert dev._download is not None and dev._download.digest == _d("8")
