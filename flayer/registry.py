"""One registry of models: a name or an entry point -> a builder -> an ``nn.Module``.

A model is built by calling an entry point ``"package.module:function"`` with keyword arguments.
The built-ins are entry points too (:data:`BUILTIN_MODELS`); their arguments come from the
:class:`~flayer.spec.ModelSpec` fields, a user model's from ``[model] args``. The architecture
fingerprint (sha256 of the ordered tensor names, shapes and dtypes of the state dict) lets a device
check that its build is the federation's; :func:`architecture_diff` names the first tensor that
differs.

Which entry points a *device* runs is the device's decision, not the round plan's: the plan names a
model and its arguments, and :func:`entry_point_allowed` says whether the device agreed to that code
(the built-ins always; any other only when listed in the device's own configuration). The device asks
before importing anything (docs/explanation/security.md).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .spec import ModelSpec

__all__ = [
    "BUILTIN_MODELS",
    "ModelError",
    "Tensors",
    "architecture",
    "architecture_diff",
    "build_model",
    "builder_kwargs",
    "entry_point_allowed",
    "fingerprint",
    "model_entry_point",
    "resolve_entry_point",
    "with_fingerprint",
]

# built-in name -> its entry point; a user model is named by its entry point directly
BUILTIN_MODELS: Mapping[str, str] = {
    "cnn": "flayer.models:fedavg_cnn",
    "resnet18": "flayer.models:resnet18",
    "fasttext": "flayer.models:fasttext",
}

Tensors = tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) in state-dict order


class ModelError(ValueError):
    """A model cannot be built (unknown entry point, a builder that fails or returns no module) or
    does not match the federation's architecture."""


def model_entry_point(name: str) -> str:
    """The entry point a model name stands for: a built-in's registered one, else the name itself."""
    return BUILTIN_MODELS.get(name, name)


def entry_point_allowed(name: str, allowed: Collection[str]) -> bool:
    """True when model ``name`` is a built-in (by name or by its entry point) or ``allowed`` lists it (by
    name or entry point). Imports nothing."""
    entry = model_entry_point(name)
    return entry in BUILTIN_MODELS.values() or name in allowed or entry in allowed


def resolve_entry_point(entry: str) -> Callable[..., Any]:
    """The callable named ``"package.module:function"`` (imported now)."""
    module_name, _, attr = entry.partition(":")
    if not module_name or not attr:
        raise ModelError(f"entry point {entry!r} must read \"package.module:function\"")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"cannot import {module_name!r} for entry point {entry!r}: {exc}. Install the package "
                         f"on this machine or add its folder to python_path") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelError(f"entry point {entry!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def builder_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """The keyword arguments the builder of ``spec`` is called with."""
    if not spec.builtin:
        return spec.kwargs
    if spec.name == "fasttext":
        return {"vocab_size": spec.vocab_size, "num_classes": spec.num_classes, "hidden_dim": spec.hidden_dim}
    base = {"in_channels": spec.in_channels, "num_classes": spec.num_classes}
    if spec.name == "cnn":
        return {**base, "height": spec.height, "width": spec.width}
    return {**base, "stem": spec.stem}


def build_model(spec: ModelSpec) -> nn.Module:
    """A freshly initialised model for ``spec`` (the caller seeds torch beforehand)."""
    entry = BUILTIN_MODELS.get(spec.name, spec.name)
    builder = resolve_entry_point(entry)
    try:
        model = builder(**builder_kwargs(spec))
    except ModelError:
        raise
    except Exception as exc:  # a user builder may raise anything; report it as one error
        raise ModelError(f"model builder {entry!r} failed with arguments {builder_kwargs(spec)}: "
                         f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelError(f"model builder {entry!r} returned {type(model).__name__}, not a torch.nn.Module")
    if not any(True for _ in model.parameters()):
        raise ModelError(f"model builder {entry!r} returned a module without parameters")
    return model


def architecture(model: nn.Module | Mapping[str, torch.Tensor]) -> Tensors:
    state = model.state_dict() if isinstance(model, nn.Module) else model
    return tuple((k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items())


def fingerprint(model: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """sha256 of the ordered (name, shape, dtype) list of the model's state dict."""
    text = json.dumps([[n, list(s), d] for n, s, d in architecture(model)], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def with_fingerprint(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the fingerprint of its build filled in, after checking that the model takes the
    spec's input (a batch of 2 images C x H x W, or token ids) and returns (2, num_classes) scores."""
    import dataclasses

    model = build_model(spec)
    x = torch.ones(2, 4, dtype=torch.int64) if spec.is_text else torch.zeros(2, spec.in_channels, spec.height,
                                                                                     spec.width)
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as exc:  # any failure of a user model's forward is one clear error
        raise ModelError(f"model {spec.name!r} fails on inputs of shape {tuple(x.shape)}: {type(exc).__name__}: "
                         f"{exc}") from exc
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, spec.num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelError(f"model {spec.name!r} returns {got} for a batch of 2 inputs; expected (2, "
                         f"{spec.num_classes}) class scores (num_classes = {spec.num_classes})")
    return dataclasses.replace(spec, fingerprint=fingerprint(model))


def architecture_diff(expected: Sequence[tuple[str, tuple[int, ...], str]],
                      got: Sequence[tuple[str, tuple[int, ...], str]],
                      expected_label: str = "the federation's model", got_label: str = "this build",
                      ordered: bool = True) -> str | None:
    """One sentence naming the first tensor that differs (name, shape, dtype, or order when
    ``ordered``), or None."""
    exp, have = {n: (s, d) for n, s, d in expected}, {n: (s, d) for n, s, d in got}
    for name, shape, dtype in expected:
        if name not in have:
            return f"tensor {name!r} {shape} {dtype} of {expected_label} is missing from {got_label}"
        if have[name] != (shape, dtype):
            s2, d2 = have[name]
            return (f"tensor {name!r}: {expected_label} has shape {shape} {dtype}, {got_label} has shape {s2} "
                    f"{d2}")
    for name, shape, dtype in got:
        if name not in exp:
            return f"tensor {name!r} {shape} {dtype} of {got_label} is not in {expected_label}"
    if ordered and [n for n, _, _ in expected] != [n for n, _, _ in got]:
        first = next(a for a, b in zip(expected, got) if a[0] != b[0])
        return f"tensor {first[0]!r} is at another position in {got_label} than in {expected_label}"
    return None
