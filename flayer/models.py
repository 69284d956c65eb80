"""The three model families of the FLAYER paper, defined by hand (no torchvision).

Every model lists its ordered layers in ``layer_names``: the top-level child modules that hold
parameters, in forward order. The layer plan (``flayer.layers``) numbers layers from this list;
parameter names match PFLlib's (FedAvgCNN, fastText) and torchvision's (ResNet-18), so state
dicts line up with the reference implementations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import build_model
from .spec import BUILTIN_NAMES, ModelSpec

__all__ = [
    "BUILTIN_NAMES",
    "FastText",
    "FedAvgCNN",
    "ModelSpec",
    "ResNet18",
    "build_model",
    "cnn_flatten_dim",
    "count_parameters",
    "fasttext",
    "fedavg_cnn",
    "resnet18",
]


def cnn_flatten_dim(height: int, width: int) -> int:
    """Flatten size of FedAvgCNN's features: two (conv5x5 valid -> maxpool 2) stages, 64 channels."""
    h, w = height, width
    for _ in range(2):
        h, w = (h - 4) // 2, (w - 4) // 2
        if h < 1 or w < 1:
            raise ValueError(
                f"FedAvgCNN needs inputs of at least 16x16 pixels (two 5x5 convolutions and 2x2 pools), "
                f"got {height}x{width}"
            )
    return 64 * h * w


class MaxPool2x2(nn.Module):
    """2x2 max-pool with stride 2 written as reshape + amax.

    Numerically the same forward as ``nn.MaxPool2d(2)`` (odd trailing rows/columns are dropped the
    same way); its backward exports correctly to ExecuTorch's training runtime, whose
    max_pool2d_with_indices backward kernel is wrong (see docs/howto/export.md).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        h2, w2 = h // 2, w // 2
        x = x[:, :, : h2 * 2, : w2 * 2]
        return x.reshape(n, c, h2, 2, w2, 2).amax(dim=(3, 5))


class FedAvgCNN(nn.Module):
    """PFLlib's FedAvgCNN: conv5x5(in,32)+ReLU+pool, conv5x5(32,64)+ReLU+pool, fc1(dim,512)+ReLU, fc.

    ``dim`` is 1024 for 28x28 inputs, 1600 for 32x32, 10816 for 64x64; 878,538 parameters for
    3x32x32 inputs and 10 classes. ``pool="reshape"`` swaps in :class:`MaxPool2x2` (same state dict).
    """

    layer_names = ("conv1", "conv2", "fc1", "fc")

    def __init__(self, in_channels: int = 1, num_classes: int = 10, dim: int = 1024, pool: str = "torch"):
        super().__init__()
        if pool not in ("torch", "reshape"):
            raise ValueError(f"FedAvgCNN pool must be 'torch' or 'reshape', got {pool!r}")

        def make_pool() -> nn.Module:
            # "reshape" is the same forward, ~2.5x slower here; needed by ExecuTorch training export
            return nn.MaxPool2d(kernel_size=2, stride=2) if pool == "torch" else MaxPool2x2()

        self.conv1 = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=5, padding=0, stride=1, bias=True),
            nn.ReLU(inplace=True),
            make_pool(),
        )
        self.conv2 = nn.Sequential(
            nn.Conv2d(32, 64, kernel_size=5, padding=0, stride=1, bias=True),
            nn.ReLU(inplace=True),
            make_pool(),
        )
        self.fc1 = nn.Sequential(nn.Linear(dim, 512), nn.ReLU(inplace=True))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(x)
        out = self.conv2(out)
        out = torch.flatten(out, 1)
        out = self.fc1(out)
        return self.fc(out)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 with torchvision's module names and parameter order.

    ``stem="imagenet"`` (default) is torchvision's stem (7x7/2 conv + 3x3/2 max-pool), which is what
    PFLlib and the FLAYER authors run on 32x32 images; ``stem="cifar"`` uses a 3x3/1 conv and no
    pool (same parameter names, smaller conv1 kernel), the usual CIFAR variant.
    """

    layer_names = ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc")

    def __init__(self, in_channels: int = 3, num_classes: int = 10, stem: str = "imagenet") -> None:
        super().__init__()
        if stem not in ("imagenet", "cifar"):
            raise ValueError(f"ResNet18 stem must be 'imagenet' or 'cifar', got {stem!r}")
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(64, 64, stride=1)
        self.layer2 = self._make_layer(64, 128, stride=2)
        self.layer3 = self._make_layer(128, 256, stride=2)
        self.layer4 = self._make_layer(256, 512, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    @staticmethod
    def _make_layer(inplanes: int, planes: int, stride: int) -> nn.Sequential:
        return nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


class FastText(nn.Module):
    """PFLlib's fastText: Embedding(vocab, h) -> mean over tokens -> fc1 Linear(h, h) -> fc.

    Input: int64 token ids (batch, length), 0 = padding. The mean runs over non-padding tokens
    (PFLlib averages over the padded length, which only rescales by the padding share).
    """

    layer_names = ("embedding", "fc1", "fc")

    def __init__(self, vocab_size: int, num_classes: int = 4, hidden_dim: int = 32, padding_idx: int = 0):
        super().__init__()
        self.padding_idx = padding_idx
        self.embedding = nn.Embedding(vocab_size, hidden_dim, padding_idx=padding_idx)
        self.fc1 = nn.Linear(hidden_dim, hidden_dim)
        self.fc = nn.Linear(hidden_dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != self.padding_idx).unsqueeze(-1).to(self.embedding.weight.dtype)
        emb = self.embedding(tokens) * mask
        mean = emb.sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
        return self.fc(F.relu(self.fc1(mean)))


# The built-ins' entry points (registered in flayer.registry.BUILTIN_MODELS, as a user model is named).
def fedavg_cnn(in_channels: int, num_classes: int, height: int, width: int) -> FedAvgCNN:
    return FedAvgCNN(in_channels, num_classes, cnn_flatten_dim(height, width))


def resnet18(in_channels: int, num_classes: int, stem: str) -> ResNet18:
    return ResNet18(in_channels, num_classes, stem)


def fasttext(vocab_size: int, num_classes: int, hidden_dim: int) -> FastText:
    return FastText(vocab_size, num_classes, hidden_dim)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
