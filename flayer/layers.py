"""The layer plan: which tensors form layer i = 1..L, and which layers are the head.

Rule: a *layer* is a module listed in the model's ``layer_names`` (the three built-in models list
their top-level children with parameters, in forward order) or, for any other ``nn.Module``, each
top-level child that holds parameters, in registration order. Parameters set directly on the
root module form a layer of their own, first. A plan can be overridden with an explicit list of
module paths. Layers are numbered from 1 (input side) to L (output side); the head is the last
``head_layers`` layers (FLAYER's ``s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["Layer", "LayerPlan", "layer_plan"]


@dataclass(frozen=True)
class Layer:
    name: str  # module path ("" for parameters on the root module)
    index: int  # 1..L, input side first
    params: tuple[str, ...]  # state-dict names of trainable parameters, in order
    buffers: tuple[str, ...]  # floating-point buffers (BatchNorm statistics), in order
    is_head: bool

    @property
    def tensors(self) -> tuple[str, ...]:
        return self.params + self.buffers


@dataclass(frozen=True)
class LayerPlan:
    layers: tuple[Layer, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def head(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.is_head)

    @property
    def body(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if not layer.is_head)

    def tensors(self, head: bool | None = None) -> tuple[str, ...]:
        """State-dict names of every layer's tensors (``head=True``: head only, ``False``: body only)."""
        return tuple(t for layer in self.layers if head is None or layer.is_head == head for t in layer.tensors)

    def params(self, head: bool | None = None) -> tuple[str, ...]:
        return tuple(p for layer in self.layers if head is None or layer.is_head == head for p in layer.params)

    def layer_of(self, tensor: str) -> Layer:
        for layer in self.layers:
            if tensor in layer.tensors:
                return layer
        raise KeyError(f"tensor {tensor!r} belongs to no layer of the plan")

    def with_head(self, head_layers: int) -> LayerPlan:
        """The same layers with the last ``head_layers`` marked as head."""
        if not 0 <= head_layers <= len(self.layers):
            raise ValueError(f"head_layers must be in [0, {len(self.layers)}], got {head_layers}")
        cut = len(self.layers) - head_layers
        return LayerPlan(tuple(Layer(l.name, l.index, l.params, l.buffers, l.index > cut) for l in self.layers))


def _default_paths(model: nn.Module) -> list[str]:
    declared = getattr(model, "layer_names", None)
    if declared is not None:
        return list(declared)
    paths = []
    if any(True for _ in model.named_parameters(recurse=False)):
        paths.append("")
    for name, child in model.named_children():
        if any(True for _ in child.parameters()):
            paths.append(name)
    return paths


def layer_plan(model: nn.Module, head_layers: int = 1, paths: Sequence[str] | None = None) -> LayerPlan:
    """Number ``model``'s layers (see module docstring) and mark the last ``head_layers`` as head.

    ``paths`` overrides the rule with explicit module paths (e.g. ``["features.0", "classifier"]``);
    every parameter must fall under exactly one of them.
    """
    layer_paths = list(paths) if paths is not None else _default_paths(model)
    if not layer_paths:
        raise ValueError("model has no parameters, so no layers")
    modules = dict(model.named_modules())
    for p in layer_paths:
        if p not in modules:
            raise ValueError(f"layer path {p!r} is not a module of {type(model).__name__}")
    float_buffers = [n for n, b in model.named_buffers() if b.is_floating_point()]
    params = [n for n, _ in model.named_parameters()]

    def owner(tensor: str) -> str | None:
        matches = [p for p in layer_paths if p and (tensor == p or tensor.startswith(p + "."))]
        if not matches and "" in layer_paths and "." not in tensor:
            return ""
        return max(matches, key=len) if matches else None

    assigned: dict[str, tuple[list[str], list[str]]] = {p: ([], []) for p in layer_paths}
    for n in params:
        o = owner(n)
        if o is None:
            raise ValueError(f"parameter {n!r} falls under none of the layer paths {layer_paths}")
        assigned[o][0].append(n)
    for n in float_buffers:
        o = owner(n)
        if o is not None:
            assigned[o][1].append(n)
    empty = [p for p in layer_paths if not assigned[p][0]]
    if empty:
        raise ValueError(f"layer path(s) {empty} hold no parameters")
    layers = tuple(Layer(p, i + 1, tuple(assigned[p][0]), tuple(assigned[p][1]), False)
                   for i, p in enumerate(layer_paths))
    return LayerPlan(layers).with_head(head_layers)
