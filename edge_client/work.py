"""The device's share of a round, off the network thread: build the strategy the plan names, run the
same :func:`flayer.simulation.client_round` as ``flayer simulate``, encode the update, check its size.

The plan chooses the strategy, the model and its arguments, but not the code: a model entry point that
is neither a built-in nor in this device's ``[edge] allow_entry_points`` is refused before anything is
imported (:func:`check_entry_point`, in :meth:`StrategyCache.get`, the one place a plan's model is built).

Mixed precision: on CUDA (and ``amp`` on) the whole client round runs under ``torch.autocast`` with
bfloat16 when the GPU supports it (no gradient scaler needed); the weights, the optimiser and the
uploaded deltas stay fp32. fp16 would need a gradient scaler inside the strategies' training loops,
so a GPU without bf16 trains in fp32. On CPU and MPS nothing changes. The region runs with autocast's
weight-cast cache off: the cache keeps each parameter's first bf16 copy until the region ends, so over a
whole local round every forward pass would read the weights as they were before the first step (the round
trained nothing; measured on an H200: 0.36 accuracy after three rounds against 0.91 in fp32).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flayer.aggregate import is_finite_state
from flayer.config import ConfigError, TrainConfig, from_mapping
from flayer.engine import ClientEval, client_round
from flayer.engine.privacy import UNCLIPPED_KEY, RoundPrivacy, private_strategy, privatize
from flayer.engine.secure import secure_from_plan
from flayer.registry import (
    architecture,
    architecture_diff,
    entry_point_allowed,
    fingerprint,
    model_entry_point,
)
from flayer.secagg.prg import KeystreamRandom
from flayer.spec import ModelSpec
from flayer.state import save_model
from flayer.strategies import make_strategy
from flayer.strategies.base import ClientState, LocalResult, RoundContext, Strategy
from flayer.train import ClientData, evaluate
from flayer.update import Update, float_state, neutral_update
from protocol import (
    EncodeError,
    Kind,
    Metrics,
    Plan,
    SigningKey,
    UpdateHeader,
    UpdateOptions,
    WireError,
    WireLimits,
    blob_digest,
    chunk_blob,
    decode_state,
    encode_message,
    encode_update,
)
from protocol.plan_digest import plan_digest
from protocol.values import FP16_MAX

from .budget import plan_problem

log = logging.getLogger("edge_client.client")

__all__ = [
    "EdgeError",
    "EntryPointRefused",
    "SkipRound",
    "StrategyCache",
    "UpdateTooLarge",
    "Upload",
    "autocast_for",
    "bf16_region",
    "calibration_report",
    "check_data_fits",
    "check_entry_point",
    "check_finite_round",
    "decode_global",
    "neutral_update",
    "plan_terms",
    "private_upload",
    "round_context",
    "save_personal",
    "train_and_encode",
]


class EdgeError(RuntimeError):
    """The edge client cannot go on (refused by the broker, a plan it cannot follow, ...)."""


class UpdateTooLarge(EdgeError):
    """The encoded update exceeds the limit; raised before anything is sent."""


class SkipRound(Exception):
    """This round cannot be trained (a global model, loss or update that is not finite): the device
    reports the reason and waits for the next round; nothing is sent."""


def check_finite_round(plan: Plan, global_state: Mapping[str, torch.Tensor] | None = None,
                       result: LocalResult | None = None) -> None:
    """SkipRound when the global model, the training loss or the update holds NaN or Inf."""
    if global_state is not None and (bad := is_finite_state(global_state)) is not None:
        raise SkipRound(f"the global model of round {plan.round} is not finite (tensor {bad!r})")
    if result is None:
        return
    loss = result.metrics.get("train_loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        raise SkipRound(f"round {plan.round}: the training loss is {loss}")
    for name, d in result.update.deltas.items():
        if not np.isfinite(d.values).all():
            raise SkipRound(f"round {plan.round}: the update of tensor {name!r} is not finite (a gradient norm or "
                            f"weight went to NaN or Inf during training)")


@dataclass(frozen=True)
class Upload:
    round: int
    digest: str
    blob: bytes
    payloads: tuple[bytes, ...]  # envelope chunks, each <= max_payload
    eval: ClientEval | None = None
    state: ClientState | None = None
    metrics: Mapping[str, float] | None = None
    update: Update | None = None  # a secure round's upload, before masking (edge_client.secure): no blob yet
    trained_under: str = ""  # a secure round: plan_terms() of the plan it was trained, clipped and noised under


def plan_terms(plan: Plan) -> str:
    """The terms a secure session is opened under: the digest of every plan field a device's input depends on (all
    but those a re-publication may change: :func:`protocol.plan_digest.plan_digest`). A secure session masks only
    an upload trained under the very terms it was opened with (edge_client.secure)."""
    return plan_digest(plan).hex()


class EntryPointRefused(EdgeError):
    """The plan names model code this device did not agree to run (nothing was imported)."""


def check_entry_point(plan: Plan, allowed: Collection[str]) -> None:
    """EntryPointRefused unless the plan's model is a built-in or listed in ``allowed`` (this device's
    ``[edge] allow_entry_points``). Runs before the model spec is built, so before any import."""
    name = plan.model.get("name")
    if not isinstance(name, str):
        raise EdgeError(f"round {plan.round}'s plan names no model (model.name = {name!r})")
    if entry_point_allowed(name, allowed):
        return
    entry = model_entry_point(name)
    listed = ", ".join(sorted(allowed)) or "none"
    raise EntryPointRefused(
        f"the plan of round {plan.round} names the model entry point {entry!r}, which this device does not allow "
        f"(allowed besides the built-ins: {listed}); nothing was imported. If you trust this code, add it to "
        f"[edge] allow_entry_points = [\"{entry}\"] in device.toml, or pass --allow-entry-point {entry} to "
        f"'flayer edge' (a kit: 'flayer broker add-device ID --kit KIT --allow-entry-point {entry}')")


class StrategyCache:
    """The strategy a plan names, built once per (name, options, model, training settings); only for a
    model entry point in ``allowed`` or a built-in (:func:`check_entry_point`, before any import)."""

    def __init__(self, device_train: Mapping[str, Any], allowed: Collection[str] = ()) -> None:
        self.device_train = dict(device_train)
        self.allowed = frozenset(allowed)
        self._key: str | None = None
        self._strategy: Strategy | None = None

    def get(self, plan: Plan) -> Strategy:
        key = json.dumps([plan.strategy, dict(plan.options), dict(plan.model), dict(plan.train)], sort_keys=True)
        if key != self._key or self._strategy is None:
            check_entry_point(plan, self.allowed)
            try:
                spec = ModelSpec(**dict(plan.model))  # type: ignore[arg-type]  # checked by ModelSpec
                train = from_mapping(TrainConfig, {**dict(plan.train), **self.device_train}, "round plan [train]")
                self._strategy = make_strategy(plan.strategy, spec, train, dict(plan.options))
            except (TypeError, ValueError, ConfigError) as exc:
                raise EdgeError(f"cannot build the strategy of round {plan.round}'s plan: {exc}") from exc
            self._key = key
        return self._strategy


def check_data_fits(strategy: Strategy, data: ClientData) -> None:
    """EdgeError when this device's samples do not fit the plan's model (wrong data set)."""
    spec, x = strategy.spec, data.train.x
    if spec.is_text:
        ok = x.ndim == 2
        want = "token ids"
    else:
        ok = x.ndim == 4 and tuple(x.shape[1:]) == (spec.in_channels, spec.height, spec.width)
        want = f"{spec.in_channels}x{spec.height}x{spec.width} images"
    if not ok:
        raise EdgeError(f"the plan's model ({spec.name}) expects {want}; this device's data has samples of shape "
                        f"{tuple(x.shape[1:])}: check [data] dataset in device.toml")


def decode_global(blob: bytes, strategy: Strategy, limits: WireLimits) -> dict[str, torch.Tensor]:
    """The global model from its blob, checked to hold exactly the plan's model tensors.

    When the plan's architecture fingerprint differs from this device's build of the model, the
    error names the first tensor that differs (from the blob) and nothing is trained."""
    model = strategy.new_model()
    shapes = {k: tuple(v.shape) for k, v in float_state(model).items()}
    want = strategy.spec.fingerprint
    if want and fingerprint(model) != want:
        try:
            theirs = {k: torch.from_numpy(v.copy()) for k, v in decode_state(blob, limits).items()}
            mine = architecture(float_state(model))
            order = {name: i for i, (name, _, _) in enumerate(mine)}  # name the first difference in forward order
            diff = architecture_diff(sorted(architecture(theirs), key=lambda t: order.get(t[0], len(order))), mine,
                                     ordered=False)
        except WireError as exc:
            diff = f"the global model is unreadable ({exc.reason})"
        raise EdgeError(f"this device's build of model {strategy.spec.name!r} is not the federation's: "
                        f"{diff or 'dtypes or integer buffers differ'} (fingerprint {fingerprint(model)[:12]} here, "
                        f"{want[:12]} in the plan). Install the federation's version of the model")
    try:
        arrays = decode_state(blob, limits, expected=shapes)
    except WireError as exc:
        raise EdgeError(f"the global model does not fit the plan's model: {exc.reason}") from None
    return {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}


def round_context(plan: Plan, client_index: int, device: torch.device) -> RoundContext:
    return RoundContext(round=plan.round, client=client_index, seed=plan.seed, device=device)


@contextlib.contextmanager
def autocast_for(device: torch.device, amp: bool) -> Iterator[str]:
    """bf16 autocast on CUDA when asked and supported; yields the precision used."""
    if amp and device.type == "cuda" and torch.cuda.is_bf16_supported():
        with bf16_region("cuda"):
            yield "bf16"
    else:
        yield "fp32"


def bf16_region(device_type: str) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast for a whole local round on ``device_type``: the weight-cast cache off, so each forward
    pass casts the weights as the last optimiser step left them (the module's docstring says why)."""
    return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False)


def _report(result: LocalResult, ev: ClientEval, secure: bool = False) -> dict[str, float]:
    """What a non-private upload reports beside its deltas (a secure round's: the update's own and the test
    counts, which travel in a Metrics message)."""
    info = {k: float(v) for k, v in result.update.info.items()}
    info.update({"test_correct": float(ev.correct), "test_total": float(ev.total)})
    for k, v in ({} if secure else result.metrics).items():
        if isinstance(v, (int, float)) and math.isfinite(float(v)) and 1 <= len(k) <= 64:
            info.setdefault(k, float(v))
    return {k: v for k, v in info.items() if math.isfinite(v)}


def private_upload(plan: Plan, result: LocalResult, private: RoundPrivacy) -> tuple[Update, bool]:
    """(what a private round sends, whether the local round's result stands). Clipped (and, in local mode,
    noised from the operating system's entropy, :func:`flayer.engine.privacy.privatize`); a fixed weight of 1
    instead of the sample count; beside the values only the clip bit (adaptive clipping: inside the secure sum,
    or to the coordinator that sees the clipped update anyway in central mode); no evaluation, no loss. A
    local round that went non-finite sends a neutral contribution -- zeros at the round's public positions,
    clipped and noised like any other -- so a skip does not show (docs/reference/private-fields.md)."""
    raw, kept = result.update, True
    try:
        check_finite_round(plan, None, result)
    except SkipRound as exc:
        log.warning("round %d: %s; sending a neutral contribution (a skip would show in a private round)",
                    plan.round, exc)
        raw, kept = neutral_update(raw), False
    # a private round's noise share is drawn from the operating system's entropy: nobody can replay it
    out = privatize(raw, private, KeystreamRandom())  # type: ignore[arg-type]  # a CSPRNG with numpy's normal()
    bits = {k: v for k, v in out.info.items() if k == UNCLIPPED_KEY}
    return Update(out.deltas, 1, bits), kept


def train_and_encode(strategy: Strategy, plan: Plan, global_state: Mapping[str, torch.Tensor], state: ClientState,
                     data: ClientData, ctx: RoundContext, *, federation: str, sender: str, max_payload: int,
                     max_update_bytes: int, amp: bool, key: SigningKey | None = None,
                     prepare: Callable[[Update], tuple[Update, UpdateOptions]] | None = None,
                     secure: bool = False) -> Upload:
    """The local round (``client_round``, exactly as the simulator runs it) and the upload's bytes.

    Raises :class:`UpdateTooLarge` naming the sizes and the limit before anything is sent, and
    :class:`SkipRound` when the global model, the loss or the update is not finite. ``prepare``: the
    step between training and encoding (error feedback and link fitting, :mod:`edge_client.thin`). ``secure``:
    a secure round -- the update comes back unencoded (``Upload.update``), to be masked (:mod:`edge_client.secure`)."""
    check_finite_round(plan, global_state)
    try:
        private = RoundPrivacy.from_plan(plan.privacy)
        if private is not None and plan.secure:  # its noise share against the plan's privacy (distributed DP)
            secure_from_plan(plan.secure, plan.round, tuple(plan.selected), privacy=plan.privacy)
    except ValueError as exc:
        raise SkipRound(str(exc)) from None
    why = plan_problem(plan, private) if private is not None else None
    if why is not None:  # a plan that would strip the noise this device counts (edge_client.budget)
        raise SkipRound(f"privacy plan refused: {why}")
    if private is not None:  # upload positions no noise covers: only the ones private_strategy gives (public)
        try:
            public = private_strategy(strategy)
        except ValueError as exc:
            raise SkipRound(f"privacy plan refused: {exc}") from None
        if public.options_dict() != strategy.options_dict():
            raise SkipRound("privacy plan refused: its strategy options would choose the upload's positions from "
                            "this device's data (a private round needs positions = \"public\")")
        if plan.value_codec == "fp16" and private.clip >= FP16_MAX:  # a public fact, decided before training
            raise SkipRound(f"privacy plan refused: value codec fp16 cannot carry values up to its clip "
                            f"C = {private.clip:g} (fp16 holds |x| < {FP16_MAX:g})")
    with autocast_for(ctx.device, amp):
        ev, result = client_round(strategy, global_state, state, data, ctx, train=True)
    assert result is not None
    if private is None:
        check_finite_round(plan, None, result)
        update = Update(result.update.deltas, result.update.num_samples, _report(result, ev, secure))
    else:
        update, kept = private_upload(plan, result, private)
        if not kept:  # the personal state of a failed local round is not kept either
            result = LocalResult(result.update, state, result.metrics)
    if secure:  # masked once the round's shares are in: what leaves is data-independent in layout, so no fitting
        return Upload(plan.round, "", b"", (), ev, result.state, result.metrics, update)
    # a private upload is not compressed: zstd's size depends on the values, and the size is seen by the broker
    options = UpdateOptions(plan.value_codec, zstd=plan.compress and private is None)
    if prepare is not None and private is None:  # thin links (a private upload is sent whole: fitting keeps a
        # device's largest values and error feedback its residual, both chosen by its data)
        update, options = prepare(update)
    try:
        blob = encode_update(update, UpdateHeader(federation, plan.round, sender, plan.model_digest), options)
    except EncodeError as exc:  # e.g. a value past fp16's range: this round is skipped, the device goes on
        raise SkipRound(f"the update of round {plan.round} cannot be encoded with value codec "
                        f"{plan.value_codec}: {exc}") from None
    if max_update_bytes and len(blob) > max_update_bytes:
        raise UpdateTooLarge(
            f"the update of round {plan.round} is {len(blob):,} bytes ({update.sent:,} of {update.numel:,} values, "
            f"codec {options.values}{' + zstd' if plan.compress else ''}); the limit is {max_update_bytes:,} bytes. "
            f"Nothing was sent. Raise [federation] max_update_bytes on the coordinator, or upload less "
            f"(a sparser strategy, value_codec int8, compress = true)")
    payloads = chunk_blob(blob, Kind.UPDATE_CHUNK, federation, sender, plan.round, max_payload, key=key)
    worst = max(len(p) for p in payloads)
    if worst > max_payload:  # chunk_blob guarantees it; checked again because the broker drops the link
        raise UpdateTooLarge(f"an update chunk of {worst} bytes exceeds the broker's max_payload {max_payload}")
    return Upload(plan.round, blob_digest(blob), blob, tuple(payloads), ev, result.state, result.metrics)


def calibration_report(strategy: Strategy, plan: Plan, global_state: Mapping[str, torch.Tensor], data: ClientData,
                       ctx: RoundContext, *, amp: bool, now: float, federation: str, sender: str,
                       key: SigningKey | None = None) -> bytes:
    """Round 0: the strategy's ``calibrate`` on the plan's model, as a Metrics payload (plus the
    device's training-sample count, ``sample_weight``, which the coordinator weighs reports with)."""
    with autocast_for(ctx.device, amp):
        report = strategy.calibrate(global_state, data, ctx)
    values = {str(k): float(v) for k, v in report.items()}
    values["sample_weight"] = float(data.num_train)
    return encode_message(Metrics(plan.round, now, values), federation, sender, key=key)


def save_personal(strategy: Strategy, plan: Plan, global_state: Mapping[str, torch.Tensor], state: ClientState,
                  data: ClientData, ctx: RoundContext, personal_file: Any, global_file: Any,
                  meta: Mapping[str, Any]) -> float:
    """After the federation: the strategy's personal model, saved (with the final global model) for
    ``flayer export``; returns its test accuracy."""
    model = strategy.personal_model(global_state, state, data, ctx)
    correct, total, _ = evaluate(model, data.test, ctx.device)
    meta = {"strategy": plan.strategy, "rounds": plan.rounds, "seed": plan.seed, **meta}
    save_model(personal_file, float_state(model), strategy.spec, {**meta, "role": "personal"})
    save_model(global_file, global_state, strategy.spec, {**meta, "role": "global"})
    return correct / total if total else 0.0
