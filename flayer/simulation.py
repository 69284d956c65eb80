"""In-process federation: every client in one process, the same strategy code as over MQTT.

The round loop is written once here. Per round: select clients (join ratio, seeded); every client
runs :func:`client_round` -- download (``receive``), evaluate on its test split (PFLlib's protocol),
and, if selected, local training and upload; the server folds the uploads into the next global
model with the strategy's aggregator. After the last round each client's personal model is
evaluated too. A strategy that ``needs_calibration()`` first runs :func:`calibrate` ("round 0": every
client reports on the common initial model, the server resolves the reports into options), and the
rounds run with the strategy those options configure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .aggregate import UpdateError
from .links import LinkHooks
from .strategies.base import ClientState, LocalResult, RoundContext, Strategy, derive_seed
from .train import ClientData, evaluate
from .update import Update, float_state

__all__ = [
    "ClientEval",
    "RoundRecord",
    "SimulationResult",
    "calibrate",
    "client_round",
    "divergence",
    "initial_global_state",
    "select_clients",
    "simulate",
]

log = logging.getLogger(__name__)


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
                 val: bool = False) -> tuple[ClientEval, LocalResult | None]:
    """One client's round: receive, evaluate on test (before training), then train if ``train``.

    With ``val`` the received model is also evaluated on the client's validation hold-out (what
    ``flayer tune`` chooses learning rates by: the test split never steers a choice).
    The simulator and the edge client both call this, so both run exactly the same code.
    """
    model = strategy.receive(global_state, state, data, ctx)
    correct, total, loss = evaluate(model, data.test, ctx.device)
    val_eval = ClientEval(*evaluate(model, data.val, ctx.device)) if val and len(data.val) else None
    result = strategy.local_round(model, global_state, state, data, ctx) if train else None
    return ClientEval(correct, total, loss, val_eval), result


def select_clients(num_clients: int, join_ratio: float, seed: int, round_: int) -> list[int]:
    """PFLlib's selection: round(join_ratio * N) clients (at least 1), uniformly, seeded per round."""
    k = max(1, int(round(join_ratio * num_clients)))
    if k >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(derive_seed(seed, round_, "select"))
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


def initial_global_state(strategy: Strategy, seed: int) -> dict[str, torch.Tensor]:
    """The round-1 global model: the strategy's model initialised from ``seed``."""
    with torch.random.fork_rng(devices=[]):  # leaves the caller's global RNG state as it was
        torch.manual_seed(derive_seed(seed, "init"))
        return float_state(strategy.new_model())


@dataclass(frozen=True)
class RoundRecord:
    round: int
    acc: float  # sample-weighted test accuracy over all clients, after download, before training
    loss: float
    train_loss: float  # mean over selected clients
    selected: tuple[int, ...]
    sent: int  # coordinates uploaded, all selected clients together
    numel: int  # coordinates a dense upload of the same tensors would hold
    upload_bytes: int  # wire bytes (0 when no sizer was given)
    seconds: float
    client_acc: tuple[float, ...]
    unsent: int = 0  # coordinates of the global model no selected client sent (rule zero sets them to 0)
    coordinates: int = 0  # coordinates of the global model
    indexed: int = 0  # explicit positions uploaded (sparse deltas), all selected clients together
    val_acc: float | None = None  # as ``acc``, on the clients' validation hold-outs (when evaluated)
    download_bytes: int = 0  # bytes the selected clients received for this round's model (LinkHooks only)

    @property
    def upload_fraction(self) -> float:
        return self.sent / self.numel if self.numel else 0.0

    @property
    def unsent_fraction(self) -> float:
        return self.unsent / self.coordinates if self.coordinates else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"round": self.round, "acc": self.acc, "loss": self.loss, "train_loss": self.train_loss,
                "selected": list(self.selected), "sent": self.sent, "numel": self.numel,
                "upload_fraction": self.upload_fraction, "upload_bytes": self.upload_bytes,
                "seconds": self.seconds, "client_acc": list(self.client_acc), "unsent": self.unsent,
                "unsent_fraction": self.unsent_fraction, "indexed": self.indexed, "val_acc": self.val_acc,
                "download_bytes": self.download_bytes}


@dataclass
class SimulationResult:
    rounds: list[RoundRecord]
    final_acc: float  # personal models after the last round
    final_client_acc: list[float]
    global_state: dict[str, torch.Tensor]
    states: list[ClientState] = field(default_factory=list)
    calibration: dict[str, Any] = field(default_factory=dict)  # options resolved in round 0 (if any)
    diverged: str | None = None  # why the run stopped early (non-finite or blown-up loss), None if it did not

    @property
    def best_acc(self) -> float:
        return max([r.acc for r in self.rounds] + [self.final_acc])


def _weighted(evals: Sequence[ClientEval]) -> tuple[float, float]:
    total = sum(e.total for e in evals)
    return (sum(e.correct for e in evals) / total if total else 0.0,
            sum(e.loss_sum for e in evals) / total if total else 0.0)


def calibrate(strategy: Strategy, clients: Sequence[ClientData], global_state: Mapping[str, torch.Tensor],
              seed: int, device: torch.device = torch.device("cpu")) -> tuple[Strategy, dict[str, Any]]:
    """Round 0: every client calibrates on the common initial model, the server resolves the reports.

    Returns the configured strategy (``strategy.with_options(resolved)``) and the resolved options.
    The MQTT coordinator runs the same two halves over the wire: ``strategy.calibrate`` on each edge
    client, ``strategy.resolve_calibration`` on the server.
    """
    reports = []
    for i, data in enumerate(clients):
        ctx = RoundContext(round=0, client=i, seed=seed, device=device)
        reports.append(strategy.calibrate(global_state, data, ctx))
    resolved = strategy.resolve_calibration(reports, [float(d.num_train) for d in clients])
    configured = strategy.with_options(resolved)
    if configured.needs_calibration():
        raise ValueError(f"strategy {strategy.name!r}: the calibration resolved {resolved}, which does not "
                         f"settle what it needs")
    log.info("calibration of %s resolved %s", strategy.name, resolved)
    return configured, resolved


def simulate(strategy: Strategy, clients: Sequence[ClientData], rounds: int, seed: int,
             join_ratio: float = 1.0, device: torch.device = torch.device("cpu"),
             global_state: Mapping[str, torch.Tensor] | None = None,
             on_round: Callable[[RoundRecord], None] | None = None,
             on_client: Callable[[int, int], None] | None = None,
             sizer: Callable[[Update], int] | None = None, val: bool = False,
             blowup: float | None = None, links: LinkHooks | None = None) -> SimulationResult:
    """Run ``rounds`` federated rounds of ``strategy`` over ``clients``.

    ``on_round(record)`` after each round, ``on_client(round, done)`` after each client (progress);
    ``sizer(update)`` returns an update's size on the wire; ``val`` also evaluates every received
    model on the validation hold-outs (``RoundRecord.val_acc``). The run stops early, with
    ``SimulationResult.diverged`` saying why, when the global model or the clients' mean training
    loss is not finite, or (``blowup``) when that loss exceeds ``blowup`` times the cross-entropy of a
    uniform guess, ln(classes). ``links`` (:class:`flayer.links.LinkHooks`): fold the updates as
    decoded, publish the model as rebuilt, count the bytes both ways (instead of ``sizer``).
    """
    g = dict(global_state) if global_state is not None else initial_global_state(strategy, seed)
    resolved: dict[str, Any] = {}
    if strategy.needs_calibration():
        strategy, resolved = calibrate(strategy, clients, g, seed, device)
    states = [strategy.initial_state() for _ in clients]
    records: list[RoundRecord] = []
    diverged: str | None = None
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        selected = set(select_clients(len(clients), join_ratio, seed, r))
        agg = strategy.aggregator(g)
        evals: list[ClientEval] = []
        losses: list[float] = []
        sent = numel = nbytes = indexed = 0
        down = sum(links.download(r, i) for i in sorted(selected)) if links is not None else 0  # thin links
        for i, data in enumerate(clients):
            ctx = RoundContext(round=r, client=i, seed=seed, device=device)
            ev, result = client_round(strategy, g, states[i], data, ctx, train=i in selected, val=val)
            evals.append(ev)
            if result is not None and diverged is None:
                states[i] = result.state
                losses.append(result.metrics.get("train_loss", float("nan")))
                update, wire = result.update, 0
                try:
                    if links is not None:  # thin links: the update as the server decodes it
                        update, wire = links.upload(r, i, update)
                    agg.fold(update)
                except UpdateError as exc:  # e.g. non-finite values: the learning rate made training diverge
                    diverged = f"diverged: client {i}'s update in round {r} was refused ({exc})"
                else:
                    sent += update.sent
                    numel += update.numel
                    indexed += sum(d.count for d in update.deltas.values() if d.indices is not None)
                    nbytes += wire if links is not None else sizer(update) if sizer is not None else 0
            if on_client is not None:
                on_client(r, i + 1)
        unsent = agg.unsent() if agg.contributors else 0
        coordinates = sum(v.numel() for v in g.values())
        if diverged is None:  # a refused update leaves the global model as it was
            g = agg.result() if links is None else links.publish(r, g, agg.result())
        acc, loss = _weighted(evals)
        vals = [e.val for e in evals if e.val is not None]
        rec = RoundRecord(r, acc, loss, float(np.mean(losses)) if losses else float("nan"), tuple(sorted(selected)),
                          sent, numel, nbytes, time.perf_counter() - t0, tuple(e.acc for e in evals),
                          unsent, coordinates, indexed, _weighted(vals)[0] if vals else None, down)
        records.append(rec)
        log.info("round %d: acc %.4f loss %.4f train_loss %.4f upload %.3f", r, acc, loss, rec.train_loss,
                 rec.upload_fraction)
        if on_round is not None:
            on_round(rec)
        diverged = diverged or divergence(records, g, blowup, strategy.spec.num_classes)
        if diverged is not None:
            log.warning("round %d: %s; the run stops here", r, diverged)
            break
    finals = []
    for i, data in enumerate(clients):
        ctx = RoundContext(round=rounds + 1, client=i, seed=seed, device=device)
        model = strategy.personal_model(g, states[i], data, ctx)
        finals.append(ClientEval(*evaluate(model, data.test, device)))
    final_acc, _ = _weighted(finals)
    return SimulationResult(records, final_acc, [e.acc for e in finals], g, states, resolved, diverged)


def divergence(records: Sequence[RoundRecord], global_state: Mapping[str, torch.Tensor],
               blowup: float | None, num_classes: int) -> str | None:
    """Why the run has diverged after its latest round, or None: a non-finite global model, a
    non-finite mean training loss, or (with ``blowup``) a loss above ``blowup`` x ln(num_classes),
    the cross-entropy of a uniform guess, which any learning run starts near and stays under."""
    bad = [k for k, v in global_state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        return f"diverged: the global model holds non-finite values ({bad[0]})"
    last = records[-1].train_loss
    if not np.isfinite(last):
        return f"diverged: training loss {last} in round {records[-1].round}"
    bound = None if blowup is None else blowup * float(np.log(num_classes))
    if bound is not None and last > bound:
        return (f"diverged: training loss {last:.4g} in round {records[-1].round} is over {blowup:g} x "
                f"ln({num_classes}) = {bound:.4g}")
    return None
