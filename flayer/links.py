"""What crosses the links in a simulation: hooks for thin-link studies (``flayer simulate``'s value
codec, top-k share, error feedback and delta download options).

:func:`flayer.simulation.simulate` runs without a network; with :class:`LinkHooks` it folds each
update *as the coordinator would decode it* and publishes the global model *as devices would
rebuild it*, and counts the bytes both ways. The hooks are built outside ``flayer`` (``emulator.thinsim``,
from the wire codec), so the learning code stays free of the wire format.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .update import Update

__all__ = ["LinkHooks"]


@dataclass(frozen=True)
class LinkHooks:
    """``upload(round, client, update)`` -> (the update as the server decodes it, bytes sent);
    ``publish(round, old, new)`` -> the global model the next round starts from (a lossy delta
    download defines it as the devices' reconstruction); ``download(round, client)`` -> bytes the
    client receives to hold round ``round``'s model."""

    upload: Callable[[int, int, Update], tuple[Update, int]]
    publish: Callable[[int, Mapping[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    download: Callable[[int, int], int]
