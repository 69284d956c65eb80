"""The client's share of a round, the same code in ``flayer simulate`` and on an edge device:
receive the global model, evaluate it on the test split (PFLlib's protocol: before training), and,
when selected, train and produce the update."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from flayer.strategies.base import ClientState, LocalResult, RoundContext, Strategy
from flayer.train import ClientData, evaluate

from .privacy import RoundPrivacy, privatize

__all__ = ["ClientEval", "client_round"]


@dataclass(frozen=True)
class ClientEval:
    correct: int
    total: int
    loss_sum: float
    val: ClientEval | None = None  # the same model on the validation hold-out, when asked for

    @property
    def acc(self) -> float:
        return self.correct / self.total if self.total else 0.0


def client_round(strategy: Strategy, global_state: Mapping[str, torch.Tensor], state: ClientState,
                 data: ClientData, ctx: RoundContext, train: bool = True,
                 val: bool = False, privacy: RoundPrivacy | None = None,
                 noise_rng: np.random.Generator | None = None) -> tuple[ClientEval, LocalResult | None]:
    """One client's round: receive, evaluate on test (before training), then train if ``train``.

    With ``val`` the received model is also evaluated on the client's validation hold-out (what
    ``flayer tune`` chooses learning rates by: the test split never steers a choice). ``privacy``: a
    private round -- the upload is clipped (and, in local mode, noised with ``noise_rng``, the device's own
    generator) before it leaves (:func:`flayer.engine.privacy.privatize`).
    """
    model = strategy.receive(global_state, state, data, ctx)
    correct, total, loss = evaluate(model, data.test, ctx.device)
    val_eval = ClientEval(*evaluate(model, data.val, ctx.device)) if val and len(data.val) else None
    result = strategy.local_round(model, global_state, state, data, ctx) if train else None
    if result is not None and privacy is not None:
        if privacy.mode == "local" and noise_rng is None:
            raise ValueError("local-mode privacy needs the device's noise generator")
        result.update = privatize(result.update, privacy, noise_rng)
    return ClientEval(correct, total, loss, val_eval), result
