"""Tensors on disk: safetensors files with JSON metadata, written atomically and private (0600, through
:func:`flayer.files.atomic_write`). No pickle.

Used for a device's personal state (so a rebooted device resumes), the coordinator's checkpoints,
and the models ``flayer export`` reads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .files import atomic_write
from .models import ModelSpec, build_model
from .registry import ModelError, architecture, architecture_diff
from .strategies.base import ClientState

__all__ = [
    "StateFileError",
    "atomic_write",
    "load_client_state",
    "load_initial_model",
    "load_model",
    "load_tensors",
    "save_client_state",
    "save_model",
    "save_tensors",
]

_META_KEY = "flayer"


class StateFileError(ValueError):
    """A state file is missing, truncated or not what it claims to be."""


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
    body = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return atomic_write(path, st_save(body, metadata={_META_KEY: json.dumps(dict(meta))}))


def load_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise StateFileError(f"state file {path} does not exist")
    data = path.read_bytes()
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_len])
        meta = json.loads(header.get("__metadata__", {}).get(_META_KEY, "{}"))
    except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
        raise StateFileError(f"state file {path} is not a readable safetensors file ({exc})") from exc
    if not isinstance(meta, dict):
        raise StateFileError(f"state file {path}: metadata is not a JSON object")
    return tensors, meta


def save_client_state(path: str | Path, state: ClientState, meta: Mapping[str, Any] | None = None) -> Path:
    return save_tensors(path, state.tensors, {"kind": "client_state", "scalars": state.scalars, **(meta or {})})


def load_client_state(path: str | Path) -> tuple[ClientState, dict[str, Any]]:
    tensors, meta = load_tensors(path)
    if meta.get("kind") != "client_state":
        raise StateFileError(f"{path} is not a client state file (kind {meta.get('kind')!r})")
    scalars = meta.pop("scalars", {})
    if not isinstance(scalars, dict):
        raise StateFileError(f"{path}: scalars must be a JSON object")
    return ClientState(tensors, scalars), meta


def save_model(path: str | Path, state: Mapping[str, torch.Tensor], spec: ModelSpec,
               meta: Mapping[str, Any] | None = None) -> Path:
    """A standalone model file: the tensors plus the ModelSpec that rebuilds the architecture."""
    return save_tensors(path, state, {"kind": "model", "spec": dataclasses.asdict(spec), **(meta or {})})


def load_model(path: str | Path) -> tuple[torch.nn.Module, ModelSpec, dict[str, Any]]:
    """Rebuild the model saved by :func:`save_model`; checks names and shapes against the spec."""
    tensors, meta = load_tensors(path)
    if meta.get("kind") != "model" or not isinstance(meta.get("spec"), dict):
        raise StateFileError(f"{path} is not a model file (kind {meta.get('kind')!r}); expected one written by "
                             f"'flayer simulate --save-models', an edge client or the coordinator")
    try:
        spec = ModelSpec(**meta["spec"])
    except (TypeError, ValueError) as exc:
        raise StateFileError(f"{path}: bad model spec {meta['spec']!r} ({exc})") from exc
    try:
        model = build_model(spec)
    except ModelError as exc:
        raise StateFileError(f"{path}: {exc}") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if v.is_floating_point()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:4]
        raise StateFileError(f"{path}: tensors do not match a {spec.name} model (first differences: {diff})")
    model.load_state_dict(tensors, strict=False)
    return model, spec, meta


def load_initial_model(path: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The floating-point tensors of a checkpoint (any safetensors file holding the model's state
    dict, e.g. a pretrained model), checked against ``model``'s architecture: the same names, shapes
    and dtypes, all finite. The error names the first tensor that differs."""
    tensors, _ = load_tensors(path)
    want = tuple(t for t in architecture(model) if model.state_dict()[t[0]].is_floating_point())
    have = tuple(t for t in architecture(tensors) if tensors[t[0]].is_floating_point())
    diff = architecture_diff(want, have, "the federation's model", f"checkpoint {path}", ordered=False)
    if diff:
        raise StateFileError(f"initial_model {path} does not fit the federation's model: {diff}")
    for name, value in tensors.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise StateFileError(f"initial_model {path}: tensor {name!r} holds NaN or Inf values")
    return {n: tensors[n].to(torch.float32).clone() for n, _, _ in want}
