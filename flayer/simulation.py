"""In-process federation: every client in one process, driving the round engine directly.

Per round (:mod:`flayer.engine`): select clients (PFLlib's join ratio, seeded); every client runs
:func:`flayer.engine.client_round` -- download (``receive``), evaluate on its test split (PFLlib's
protocol), and, if selected, local training and upload; each upload passes the validity gate and the
admission policy and is folded into the open aggregate, whose result is the next global model.
After the last round each client's personal model is evaluated too. A strategy that
``needs_calibration()`` first runs :func:`flayer.engine.calibrate` (round 0). The MQTT coordinator
drives the same engine from network events; ``emulator.virtual`` drives it on a simulated clock
(synchronous or asynchronous rounds, device profiles).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .aggregate import DPSumAggregator, UpdateError
from .engine import (
    Bounds,
    ClientEval,
    OpenAggregate,
    RoundRecord,
    admit,
    calibrate,
    check,
    client_round,
    initial_global_state,
    select_clients,
)
from .engine.privacy import (
    PrivacySettings,
    RoundPrivacy,
    central_std,
    next_clip,
    private_strategy,
    privatize,
    server_bound,
)
from .engine.round import noise_seed
from .engine.server_step import ServerStep
from .engine.secure import abandon_kind, drops_for, secure_sum
from .links import LinkHooks
from .secagg.prg import KeystreamRandom
from .strategies.base import ClientState, LocalResult, RoundContext, Strategy, derive_seed
from .train import ClientData, evaluate
from .update import Update, neutral_update

__all__ = ["SimulationResult", "divergence", "simulate", "weighted"]

log = logging.getLogger(__name__)


@dataclass
class SimulationResult:
    rounds: list[RoundRecord]
    final_acc: float  # personal models after the last round
    final_client_acc: list[float]
    global_state: dict[str, torch.Tensor]
    states: list[ClientState] = field(default_factory=list)
    calibration: dict[str, Any] = field(default_factory=dict)  # options resolved in round 0 (if any)
    diverged: str | None = None  # why the run stopped early (non-finite or blown-up loss), None if it did not
    final_val_acc: float | None = None  # the personal models after the last round, on the validation hold-outs
    epsilon: float | None = None  # private runs: epsilon spent, at ``delta``
    delta: float | None = None
    budget_stop: str | None = None  # private runs: why the run stopped before its last round (target_epsilon)
    epsilon_coordinator: float | None = None  # private runs: against the coordinator (inf: no guarantee)
    server_step: tuple[float, float] | None = None  # the server step's (eta, beta) as run ("auto" resolved)

    @property
    def best_acc(self) -> float:
        """The best test figure: any round's received models, or the personal models at the end."""
        return max([r.acc for r in self.rounds] + [self.final_acc])

    @property
    def best_val_acc(self) -> float | None:
        """The same maximum on the validation hold-outs (None without ``val``): it scores the models the
        best test figure is taken over, FedBABU's fine-tuned personal models included."""
        vals = [r.val_acc for r in self.rounds if r.val_acc is not None]
        vals += [self.final_val_acc] if self.final_val_acc is not None else []
        return max(vals) if vals else None


def weighted(evals: Sequence[ClientEval]) -> tuple[float, float]:
    """(accuracy, mean loss) over ``evals``, weighted by their sample counts."""
    total = sum(e.total for e in evals)
    return (sum(e.correct for e in evals) / total if total else 0.0,
            sum(e.loss_sum for e in evals) / total if total else 0.0)


def simulate(strategy: Strategy, clients: Sequence[ClientData], rounds: int, seed: int,
             join_ratio: float = 1.0, device: torch.device = torch.device("cpu"),
             global_state: Mapping[str, torch.Tensor] | None = None,
             on_round: Callable[[RoundRecord], None] | None = None,
             on_client: Callable[[int, int], None] | None = None,
             sizer: Callable[[Update], int] | None = None, val: bool = False,
             blowup: float | None = None, links: LinkHooks | None = None,
             privacy: PrivacySettings | None = None, secure_drop: float = 0.0,
             seeded_noise: bool = False, clip_only: tuple[float, str] | None = None) -> SimulationResult:
    """Run ``rounds`` federated rounds of ``strategy`` over ``clients``.

    ``on_round(record)`` after each round, ``on_client(round, done)`` after each client (progress);
    ``sizer(update)`` returns an update's size on the wire; ``val`` also evaluates every received
    model, and the personal models at the end, on the validation hold-outs (``RoundRecord.val_acc``,
    ``SimulationResult.final_val_acc``). The run stops early, with
    ``SimulationResult.diverged`` saying why, when the global model or the clients' mean training
    loss is not finite, or (``blowup``) when that loss exceeds ``blowup`` times the cross-entropy of a
    uniform guess, ln(classes). ``links`` (:class:`flayer.links.LinkHooks`): fold the updates as
    decoded, publish the model as rebuilt, count the bytes both ways (instead of ``sizer``).
    ``privacy`` (enabled): private rounds (:mod:`flayer.engine.privacy`): uploads clipped on the device,
    re-clipped before folding, a noised fixed-denominator sum, epsilon composed per round
    (:mod:`flayer.engine.accountant`); with ``target_epsilon`` the run stops before a round would exceed it
    (``SimulationResult.budget_stop``). ``privacy.secure_aggregation``: secure rounds
    (:mod:`flayer.engine.secure`): the uploads are masked and only their sum is unmasked and folded, by the
    same protocol code the coordinator runs; ``secure_drop``: each selected device drops out at a random
    protocol step with this probability (planning a fleet's dropouts). The privacy noise (central, the
    devices' local shares, the secure rounds' entropy) comes from the operating system's CSPRNG;
    ``seeded_noise`` draws it from the run seed instead, for a reproducible run that protects nothing.
    A private run's next model takes the server step of ``privacy.server_lr`` / ``server_momentum``
    (:class:`flayer.engine.server_step.ServerStep`, post-processing; ``"auto"`` resolved from z C / m).
    ``clip_only`` ``(C, average)``, for measuring what the clip costs, not private (no noise, no epsilon): the
    uploads as a private round's (public positions), clipped to norm C, averaged by the strategy's sample weights
    (``"weighted"``) or summed over the fixed denominator m of a private round (``"fixed"``), the server step
    applied as in a private run (``"auto"`` is the plain step there: no noise to size it by).
    """
    g = dict(global_state) if global_state is not None else initial_global_state(strategy, seed)
    resolved: dict[str, Any] = {}
    if strategy.needs_calibration():
        strategy, resolved = calibrate(strategy, clients, g, seed, device)
    dp = privacy if privacy is not None and privacy.enabled else None
    secure = privacy if privacy is not None and privacy.secure_aggregation else None
    if clip_only is not None and (dp is not None or clip_only[1] not in ("weighted", "fixed")
                                  or not 1e-6 <= clip_only[0] <= 1e6):
        raise ValueError(f"clip_only needs no [privacy] noise, C in [1e-6, 1e6] and 'weighted' or 'fixed', got {clip_only}")
    if dp is not None or secure is not None or clip_only is not None:
        strategy = private_strategy(strategy)
    fixed_m = len(select_clients(len(clients), join_ratio, seed, 1))
    if dp is not None:
        dp = dp.resolve(len(clients), fixed_m)
    step = None
    if privacy is not None and (dp is not None or clip_only is not None):
        lr = (dp or privacy).server_lr  # resolved with noise; clip_only: "auto" is the plain step
        step = ServerStep(1.0 if lr == "auto" else float(lr), privacy.server_momentum)
    private = _Private(dp, rounds) if dp is not None else None
    states = [strategy.initial_state() for _ in clients]
    records: list[RoundRecord] = []
    diverged: str | None = None
    budget_stop: str | None = None
    schema = dp.schema if dp is not None and dp.schema.active else None
    taken: dict[int, list[int]] = {}  # the participation schema's public history: who was in which cohort
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        selected = set(select_clients(len(clients), join_ratio, seed, r, schema, taken))
        if schema is not None and not selected:
            budget_stop = (f"participation schema: no client may take part in round {r} (max_participations "
                           f"{schema.most}, min_separation {schema.separation}); the run stops after round {r - 1}")
            log.warning("%s", budget_stop)
            break
        for c in selected:
            taken.setdefault(c, []).append(r)
        rp = private.round(len(selected)) if private is not None else None
        if rp is not None and secure is not None and rp.mode == "local":  # distributed DP: shares in the ring
            rp = dataclasses.replace(rp, ring=True)
        if private is not None and (budget_stop := private.over_budget(r)) is not None:
            log.warning("%s", budget_stop)
            break
        agg = OpenAggregate(strategy, g, rp, noise_seed(seed, r) if seeded_noise else None)
        if private is not None and private.s.banded:  # correlated noise: this round's w_t, drawn here
            agg.aggregator.use_noise(private.banded_noise(g, noise_seed(seed, r) if seeded_noise else None))
        bounds = Bounds(server_bound(rp, agg.coordinates), "clip") if rp is not None else Bounds()
        if clip_only is not None:
            bounds = Bounds(clip_only[0], "clip")
            if clip_only[1] == "fixed":
                agg.aggregator = DPSumAggregator(g, fixed_m, 0.0)
        evals: list[ClientEval] = []
        losses: list[float] = []
        nbytes = 0
        uploads: dict[str, Update] = {}  # secure rounds: what the devices mask
        down = sum(links.download(r, i) for i in sorted(selected)) if links is not None else 0  # thin links
        for i, data in enumerate(clients):
            ctx = RoundContext(round=r, client=i, seed=seed, device=device)
            ev, result = client_round(strategy, g, states[i], data, ctx, train=i in selected, val=val, privacy=rp,
                                      noise_rng=_noise_rng(seeded_noise, seed, r, i)
                                      if rp is not None and i in selected else None)
            evals.append(ev)
            if result is not None and diverged is None:
                if rp is not None and not all(np.isfinite(d.values).all() for d in result.update.deltas.values()):
                    # as a device does in a private round: a neutral contribution, its state kept as it was
                    result = LocalResult(privatize(neutral_update(result.update), rp,
                                                   _noise_rng(seeded_noise, seed, r, i)), states[i], {})
                states[i] = result.state
                losses.append(result.metrics.get("train_loss", float("nan")))
                update, wire = result.update, 0
                try:
                    if links is not None and secure is None:  # thin links: the update as the server decodes it
                        # (a secure round's masked input is exact in the ring: no codec; its bytes are the protocol's)
                        update, wire = links.upload(r, i, update)
                    norm = check(update, agg.shapes)
                except UpdateError as exc:  # e.g. non-finite values: the learning rate made training diverge
                    diverged = f"diverged: client {i}'s update in round {r} was refused ({exc})"
                else:
                    if secure is not None:
                        uploads[f"client-{i}"] = update
                    else:
                        agg.fold(admit(update, norm, bounds))
                    nbytes += wire if links is not None else sizer(update) if sizer is not None else 0
            if on_client is not None:
                on_client(r, i + 1)
        dropped, abandoned = 0, None
        if secure is not None and uploads and diverged is None:
            out = secure_sum(secure, "simulate", r, seed, uploads, bounds.norm_bound,
                             drops_for(tuple(uploads), secure_drop, seed, r), rp, seeded_noise)
            dropped, abandoned = len(out.dropped), out.reason
            if out.update is None:
                log.warning("round %d: secure round abandoned: %s; the model stays as it was", r, out.reason)
                if private is not None and rp is not None and abandon_kind(out.reason) == "sum_check":
                    private.accounts.unmasked_unfolded(rp)  # its noised sum decided the abandonment: published
            else:
                agg.fold_sum(out.update, len(out.survivors), out.bits, out.noised)
                for dev in out.survivors:
                    agg.tally.add_eval(uploads[dev].info, dev)
            nbytes = sum(out.bytes_per_device.values())  # every protocol message, sent and received
        unsent, t = agg.unsent(), agg.tally
        epsilon = private.close(agg) if private is not None and rp is not None else None
        if diverged is None:  # a refused update leaves the global model as it was
            new = agg.result() if step is None else step.apply(g, agg.result())
            g = new if links is None else links.publish(r, g, new)
        acc, loss = weighted(evals)
        vals = [e.val for e in evals if e.val is not None]
        rec = RoundRecord(r, acc, loss, float(np.mean(losses)) if losses else float("nan"), tuple(sorted(selected)),
                          t.sent, t.numel, nbytes, time.perf_counter() - t0, tuple(e.acc for e in evals),
                          unsent, agg.coordinates, t.indexed, weighted(vals)[0] if vals else None, down,
                          epsilon, rp.clip if rp is not None else None, dropped, abandoned)
        records.append(rec)
        log.info("round %d: acc %.4f loss %.4f train_loss %.4f upload %.3f", r, acc, loss, rec.train_loss,
                 rec.upload_fraction)
        if on_round is not None:
            on_round(rec)
        diverged = diverged or divergence(records, g, blowup, strategy.spec.num_classes, private=rp is not None)
        if diverged is not None:
            log.warning("round %d: %s; the run stops here", r, diverged)
            break
    finals, final_vals = [], []
    for i, data in enumerate(clients):
        ctx = RoundContext(round=rounds + 1, client=i, seed=seed, device=device)
        model = strategy.personal_model(g, states[i], data, ctx)
        finals.append(ClientEval(*evaluate(model, data.test, device)))
        if val and len(data.val):
            final_vals.append(ClientEval(*evaluate(model, data.val, device)))
    final_acc, _ = weighted(finals)
    return SimulationResult(records, final_acc, [e.acc for e in finals], g, states, resolved, diverged,
                            weighted(final_vals)[0] if final_vals else None,
                            private.accounts.public_epsilon(private.delta) if private is not None else None,
                            private.delta if private is not None else None, budget_stop,
                            private.accounts.epsilons(private.delta)["coordinator"] if private is not None else None,
                            (step.lr, step.momentum) if step is not None else None)


def _noise_rng(seeded: bool, seed: int, round_: int, client: int) -> np.random.Generator:
    """A device's generator for its local noise share: keyed by the CSPRNG, or (``seeded``) by the run seed."""
    return np.random.default_rng(derive_seed(seed, round_, client, "dp-local")) if seeded else KeystreamRandom()  # type: ignore[return-value]


class _Private:
    """A private run's state between rounds: the clip bound (adaptive clipping moves it) and the ledgers, one
    per adversary (:class:`flayer.engine.adversaries.Accounts`; every round at q = 1: the cohort is public)."""

    def __init__(self, settings: PrivacySettings, rounds: int) -> None:
        from .engine.adversaries import Accounts

        assert settings.delta is not None and settings.expected_contributions is not None
        self.s, self.delta, self.clip, self.rounds = settings, settings.delta, settings.clip, rounds
        self.stream: Any = None  # banded noise (flayer.engine.correlated.BandedNoise): a secret, kept in memory
        self.accounts = Accounts(settings.mode, settings.secure_aggregation, most=settings.max_participations)
        self.ledger = self.accounts.public

    def round(self, asked: int) -> RoundPrivacy:
        return RoundPrivacy.of(self.s, self.clip)

    def banded_noise(self, g: Mapping[str, torch.Tensor], seed: int | None) -> dict[str, np.ndarray]:
        """The next round's banded noise on the sum, one flat vector per tensor of ``g`` in its order; its ``z_t``
        from the CSPRNG (``seed``: from it, --dp-seeded-noise); coefficients optimised for the run's rounds."""
        from .engine.correlated import BandedNoise, coefficients

        sizes = {k: int(v.numel()) for k, v in g.items()}
        if self.stream is None:
            self.stream = BandedNoise(coefficients(self.rounds, self.s.noise_bands),
                                      central_std(self.s.noise_multiplier, self.s.clip), sum(sizes.values()))
        w = self.stream.draw(KeystreamRandom() if seed is None else np.random.default_rng(seed))
        cuts = np.cumsum([0, *sizes.values()])
        return {k: w[cuts[i]:cuts[i + 1]] for i, k in enumerate(sizes)}

    def over_budget(self, r: int) -> str | None:
        """Why round ``r`` must not run (its epsilon would exceed target_epsilon), or None."""
        target = self.s.target_epsilon
        if target is None:
            return None
        eps = self.accounts.public_after(self.s.noise_multiplier, self.delta)
        if eps <= target:
            return None
        return (f"privacy budget: round {r} would bring epsilon to {eps:.3f} > target_epsilon {target:g} at delta "
                f"{self.delta:.3g}; the run stops after round {r - 1} with epsilon "
                f"{self.accounts.public_epsilon(self.delta):.3f}")

    def close(self, agg: OpenAggregate) -> float:
        """Compose the round just folded (with the noise its sum carries); adapt C (adaptive clipping);
        epsilon so far against readers of the models and plans."""
        assert agg.privacy is not None
        self.accounts.compose(agg.privacy, agg.tally.accepted)
        if self.s.clipping == "adaptive" and agg.tally.accepted > 0:  # C moves only after a folded round
            bits = agg.noised_bits()
            self.clip = next_clip(self.clip, bits, self.s.expected_contributions or 1, self.s.target_quantile,
                                  self.s.clip_lr)
        return self.accounts.public_epsilon(self.delta)


def divergence(records: Sequence[RoundRecord], global_state: Mapping[str, torch.Tensor],
               blowup: float | None, num_classes: int, private: bool = False) -> str | None:
    """Why the run has diverged after its latest round, or None: a non-finite global model, a
    non-finite mean training loss, or (with ``blowup``) a loss above ``blowup`` x ln(num_classes),
    the cross-entropy of a uniform guess, which any learning run starts near and stays under.
    ``private``: a private run looks at the published model only -- the training loss is the devices'
    un-noised data, and a run that stops on it would publish a data-dependent decision."""
    bad = [k for k, v in global_state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        return f"diverged: the global model holds non-finite values ({bad[0]})"
    if private:
        return None
    last = records[-1].train_loss
    if not np.isfinite(last):
        return f"diverged: training loss {last} in round {records[-1].round}"
    bound = None if blowup is None else blowup * float(np.log(num_classes))
    if bound is not None and last > bound:
        return (f"diverged: training loss {last:.4g} in round {records[-1].round} is over {blowup:g} x "
                f"ln({num_classes}) = {bound:.4g}")
    return None
