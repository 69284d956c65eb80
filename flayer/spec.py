"""The description of a model architecture that travels in round plans and model files (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODEL_NAMES", "ModelSpec"]

MODEL_NAMES = ("cnn", "resnet18", "fasttext")


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild a model on another machine (sent in the round plan)."""

    name: str
    in_channels: int = 1
    height: int = 28
    width: int = 28
    num_classes: int = 10
    vocab_size: int = 0
    hidden_dim: int = 32
    stem: str = "imagenet"

    def __post_init__(self) -> None:
        if self.name not in MODEL_NAMES:
            raise ValueError(f"unknown model {self.name!r}; choose one of {', '.join(MODEL_NAMES)}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if self.name == "fasttext" and self.vocab_size < 2:
            raise ValueError("fasttext needs vocab_size >= 2")
