"""A federation's own model for the fleet tests (not a built-in): imported by entry point
``fleetmodel:build`` from the folder of each machine's config, as a user's model module would be."""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """conv3x3 -> conv3x3/2 -> fc1 -> fc, on small images."""

    layer_names = ("conv1", "conv2", "fc1", "fc")  # FLAYER's layer plan, input side first

    def __init__(self, in_channels: int, num_classes: int, size: int, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU())
        self.fc1 = nn.Sequential(nn.Linear(width * (size // 2) ** 2, 32), nn.ReLU())
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc1(torch.flatten(self.conv2(self.conv1(x)), 1)))


def build(in_channels: int = 3, num_classes: int = 3, size: int = 8, width: int = 8) -> TinyNet:
    return TinyNet(in_channels, num_classes, size, width)
