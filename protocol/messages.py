"""Small JSON-bodied messages: the round plan, acks, presence status and client metrics.

Each travels as one single-chunk envelope (kind plan / ack / status / metrics, codec json) whose
body is a UTF-8 JSON object with exactly the fields of its dataclass (no more, no fewer), within
``WireLimits.max_json_bytes``; a field in a message's ``OPTIONAL`` set (added after the first
release) is left out while at its default and may be absent. Parsing is strict: no duplicate keys, no NaN/Infinity, integers are
JSON integers (not booleans or floats), ids follow :func:`protocol.topics.validate_id`, digests are
64 lowercase hex characters, and the ``round`` field equals the envelope's round. Anything else
raises :class:`~protocol.errors.WireError`.

==========  ======================  ===============================================================
message     topic                   fields
==========  ======================  ===============================================================
Plan        ``round`` (retained)    round, selected client ids, deadline (unix s), strategy
                                    name and options, model spec, model digest / chunks / size,
                                    value codec and zstd flag the clients should upload with,
                                    phase (train | calibrate | final), run seed, training
                                    settings (lr, batch size, epochs), total rounds, the largest
                                    update the coordinator accepts (0 = only the wire limits),
                                    the delta from the previous model, if offered
                                    (:class:`protocol.model_delta.DeltaRef`; empty when none),
                                    what devices may choose for their uploads
                                    (:class:`protocol.upload_cap.UploadCap`; empty: nothing),
                                    optional: the ``models_url`` devices may fetch the model's
                                    and deltas' files from (:mod:`protocol.model_url`)
Ack         ``ack/<client>``        round, client, update digest, status, reason
Status      ``status/<client>``     round (last seen), state, time (unix s), info (device facts)
Metrics     ``metrics/<client>``    round, time (unix s), values (name -> finite float)
==========  ======================  ===============================================================
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Union

from .envelope import Codec, Envelope, Kind, Trust, decode_envelope
from .errors import EncodeError, WireError
from .limits import DEFAULT_LIMITS, WireLimits
from .model_delta import delta_ref
from .model_url import models_url_problem
from .signing import SigningKey
from .topics import TopicError, validate_id
from .upload_cap import upload_cap
from .values import VALUE_CODECS

__all__ = [
    "ACK_STATUSES",
    "CLIENT_STATES",
    "DEVICE_LABEL",
    "PLAN_PHASES",
    "Ack",
    "Message",
    "Metrics",
    "Plan",
    "Status",
    "decode_message",
    "encode_message",
    "parse_message",
]

Scalar = Union[str, int, float, bool]
Checks = dict[str, Callable[[Any, str], Any]]
ACK_STATUSES = ("accepted", "duplicate", "rejected", "late", "not_selected")
# train: selected devices run a local round and upload; calibrate: "round 0", devices report a small
# metrics map instead of an update; final: the federation is over, the plan names the final model
PLAN_PHASES = ("train", "calibrate", "final")
PLAN_MODES = ("sync", "async")
CLIENT_STATES = ("online", "idle", "training", "uploading", "offline")
# a device's kind as its Status info "label" carries it ([edge] label): the coordinator's metrics group by it
DEVICE_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,39}")
MAX_SELECTED = 100_000
_DIGEST = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")


# ---- field checkers: (value, field name) -> normalised value, or WireError ---------------------

def _int(lo: int, hi: int) -> Callable[[Any, str], int]:
    def check(v: Any, name: str) -> int:
        if type(v) is not int or not lo <= v < hi:
            raise WireError(f"{name} must be an integer in [{lo}, {hi}), got {v!r}")
        return v
    return check


def _time(v: Any, name: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
        raise WireError(f"{name} must be a finite number >= 0 (unix seconds), got {v!r}")
    return float(v)


_LINK = re.compile(r"[0-9a-f]{64}:[0-9a-f]{64}:[0-9a-f]{64}:[1-9][0-9]{0,17}:[1-9][0-9]{0,17}")


def _links(v: Any, name: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > 8 or not all(isinstance(x, str) and _LINK.fullmatch(x) for x in v):
        raise WireError(f"{name} must be a list of at most 8 base:target:digest:chunks:size entries")
    return tuple(v)


def _models_url(v: Any, name: str) -> str:
    problem = models_url_problem(v)
    if problem is not None:
        raise WireError(f"{name} {problem}")
    return str(v)


def _bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise WireError(f"{name} must be true or false, got {v!r}")
    return v


def _id(v: Any, name: str) -> str:
    try:
        return validate_id(v, name)
    except TopicError as exc:
        raise WireError(str(exc)) from None


def _ids(v: Any, name: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_SELECTED:
        raise WireError(f"{name} must be a list of at most {MAX_SELECTED} client ids")
    out = tuple(_id(x, f"{name} entry") for x in v)
    if len(set(out)) != len(out):
        raise WireError(f"{name} repeats a client id")
    return out


def _digest(v: Any, name: str) -> str:
    if not isinstance(v, str) or not _DIGEST.fullmatch(v):
        raise WireError(f"{name} must be 64 lowercase hex characters (sha256)")
    return v


def _text(max_len: int) -> Callable[[Any, str], str]:
    def check(v: Any, name: str) -> str:
        if not isinstance(v, str) or len(v) > max_len:
            raise WireError(f"{name} must be a string of at most {max_len} characters")
        return v
    return check


def _choice(options: tuple[str, ...]) -> Callable[[Any, str], str]:
    def check(v: Any, name: str) -> str:
        if v not in options or not isinstance(v, str):
            raise WireError(f"{name} must be one of {', '.join(options)}, got {v!r}")
        return v
    return check


def _scalar(v: Any, name: str) -> Scalar:
    if type(v) is bool or (type(v) is str and len(v) <= 256):
        return v
    if type(v) is int and abs(v) < 2**53:
        return v
    if type(v) is float and math.isfinite(v):
        return v
    raise WireError(f"{name} must be a string (<= 256 characters), bool, integer (< 2**53) or finite number")


def _mapping(max_items: int, value: Callable[[Any, str], Any]) -> Callable[[Any, str], dict[str, Any]]:
    def check(v: Any, name: str) -> dict[str, Any]:
        if not isinstance(v, Mapping) or len(v) > max_items:
            raise WireError(f"{name} must be an object of at most {max_items} entries")
        out = {}
        for k, x in v.items():
            if not isinstance(k, str) or not _KEY.fullmatch(k):
                raise WireError(f"{name}: key {k!r} must be 1-64 characters of [A-Za-z0-9_.:/-]")
            out[k] = value(x, f"{name}[{k!r}]")
        return out
    return check


def _finite(v: Any, name: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise WireError(f"{name} must be a finite number, got {v!r}")
    return float(v)


_ROUND = _int(0, 2**32)


# ---- the messages ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    round: int
    selected: tuple[str, ...]
    deadline: float
    strategy: str
    options: Mapping[str, Scalar]
    model: Mapping[str, Scalar]
    model_digest: str
    model_chunks: int
    model_size: int
    value_codec: str = "fp32"
    compress: bool = False
    phase: str = "train"
    seed: int = 0
    train: Mapping[str, Scalar] = field(default_factory=dict)
    rounds: int = 0
    max_update_bytes: int = 0
    mode: str = "sync"  # async: devices keep an older round's upload until answered (flayer.engine.versions)
    max_staleness: int = 0  # async: how many versions behind an update is still taken
    delta: Mapping[str, Scalar] = field(default_factory=dict)
    upload_fit: Mapping[str, Scalar] = field(default_factory=dict)
    close_by: float = 0.0  # when an update should arrive to count (expected close; 0: unknown)
    delta_chain: tuple[str, ...] = ()  # older deltas, base:target:digest:chunks:size (protocol.model_delta)
    privacy: Mapping[str, Scalar] = field(default_factory=dict)  # a private round's C, z, m (flayer.engine.privacy)
    secure: Mapping[str, Scalar] = field(default_factory=dict)  # a secure round's public parameters (flayer.engine.secure)
    models_url: str = ""  # models over HTTP: <models_url>/<digest> serves each model and delta (protocol.model_url)
    issued: float = 0.0  # when the coordinator published it: later plans of one round are issued later (0: unknown)

    CHECKS: ClassVar[Checks] = {
        "round": _ROUND, "selected": _ids, "deadline": _time, "strategy": _id,
              "options": _mapping(256, _scalar), "model": _mapping(64, _scalar), "model_digest": _digest,
              "model_chunks": _int(1, 2**32), "model_size": _int(1, 2**63),
              "value_codec": _choice(tuple(VALUE_CODECS)), "compress": _bool, "phase": _choice(PLAN_PHASES),
              "seed": _int(0, 2**63), "train": _mapping(16, _scalar), "rounds": _int(0, 2**32),
              "max_update_bytes": _int(0, 2**63), "mode": _choice(PLAN_MODES), "max_staleness": _int(0, 1000),
              "delta": _mapping(8, _scalar), "upload_fit": _mapping(8, _scalar), "close_by": _time,
              "delta_chain": _links, "privacy": _mapping(16, _scalar), "secure": _mapping(24, _scalar),
              "models_url": _models_url, "issued": _time}
    # fields added after the first release: left out of the JSON while at their default, so a plan that
    # does not use them is byte for byte what earlier devices decode (their decoders want exactly their fields)
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"models_url", "issued"})

    def problems(self) -> str | None:
        """Checks across fields: round 0 is the calibration phase and only that."""
        if (self.round == 0) != (self.phase == "calibrate"):
            return f"round must be >= 1 in phase {self.phase} (round 0 is the calibration phase), got {self.round}"
        try:
            delta_ref(self.delta)
            upload_cap(self.upload_fit)
        except WireError as exc:
            return exc.reason
        return None


@dataclass(frozen=True)
class Ack:
    round: int
    client: str
    update_digest: str
    status: str
    reason: str = ""
    version: int = 0  # asynchronous rounds: the version whose buffer the accepted update went into (0: none)

    CHECKS: ClassVar[Checks] = {
        "round": _ROUND, "client": _id, "update_digest": _digest, "status": _choice(ACK_STATUSES),
        "reason": _text(512), "version": _ROUND}


@dataclass(frozen=True)
class Status:
    round: int
    state: str
    time: float
    info: Mapping[str, Scalar] = field(default_factory=dict)

    CHECKS: ClassVar[Checks] = {
        "round": _ROUND, "state": _choice(CLIENT_STATES), "time": _time, "info": _mapping(64, _scalar)}


@dataclass(frozen=True)
class Metrics:
    round: int
    time: float
    values: Mapping[str, float]

    CHECKS: ClassVar[Checks] = {"round": _ROUND, "time": _time, "values": _mapping(256, _finite)}


Message = Union[Plan, Ack, Status, Metrics]
_KIND: dict[type, Kind] = {Plan: Kind.PLAN, Ack: Kind.ACK, Status: Kind.STATUS, Metrics: Kind.METRICS}
_CLASS: dict[Kind, type] = {v: k for k, v in _KIND.items()}


def _from_obj(cls: type, obj: Any) -> Any:
    checks: Checks = cls.CHECKS  # type: ignore[attr-defined]
    what = cls.__name__.lower()
    if not isinstance(obj, dict):
        raise WireError(f"{what}: body is not a JSON object")
    optional: frozenset[str] = getattr(cls, "OPTIONAL", frozenset())
    if set(obj) - set(checks) or set(checks) - optional - set(obj):
        extra, lacking = sorted(set(obj) - set(checks)), sorted(set(checks) - optional - set(obj))
        raise WireError(f"{what}: unexpected fields {extra[:5]} / missing fields {lacking}")
    try:
        msg = cls(**{name: check(obj[name], name) for name, check in checks.items() if name in obj})
    except WireError as exc:
        raise WireError(f"{what}: {exc.reason}") from None
    problem = msg.problems() if hasattr(msg, "problems") else None
    if problem:
        raise WireError(f"{what}: {problem}")
    return msg


def _no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise WireError(f"JSON object repeats key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> None:
    raise WireError(f"JSON contains {name}")


def _to_obj(msg: Message) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    optional: frozenset[str] = getattr(msg, "OPTIONAL", frozenset())
    for f in fields(msg):
        v = getattr(msg, f.name)
        if f.name in optional and v == f.default:
            continue  # a later field at its default: the JSON earlier decoders know
        obj[f.name] = list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v
    return obj


def encode_message(msg: Message, federation: str, sender: str, limits: WireLimits = DEFAULT_LIMITS,
                   key: SigningKey | None = None) -> bytes:
    """The envelope payload carrying ``msg``, signed with ``key`` (the sender's: every receiver refuses an
    unsigned one); EncodeError if a field is invalid or it is too large."""
    if type(msg) not in _KIND:
        raise EncodeError(f"not a message: {type(msg).__name__}")
    obj = _to_obj(msg)
    try:
        _from_obj(type(msg), obj)
    except WireError as exc:
        raise EncodeError(exc.reason) from None
    body = json.dumps(obj, separators=(",", ":"), sort_keys=True, allow_nan=False).encode("utf-8")
    if len(body) > limits.max_json_bytes:
        raise EncodeError(f"{type(msg).__name__} body of {len(body)} bytes exceeds {limits.max_json_bytes}")
    return Envelope(_KIND[type(msg)], federation, sender, msg.round, 0, 1, len(body),
                    hashlib.sha256(body).hexdigest(), body).encode(key)


def parse_message(env: Envelope, limits: WireLimits = DEFAULT_LIMITS) -> Message:
    """The message in an already decoded envelope; WireError if it is not a valid one."""
    if env.codec != Codec.JSON or env.kind not in _CLASS:
        raise WireError(f"envelope of kind {env.kind.name.lower()} does not carry a JSON message")
    if len(env.body) > limits.max_json_bytes:
        raise WireError(f"message body of {len(env.body)} bytes exceeds {limits.max_json_bytes}")
    try:
        obj = json.loads(env.body.decode("utf-8"), object_pairs_hook=_no_dupes, parse_constant=_no_constant)
    except WireError:
        raise
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, an over-long integer, deep nesting
        raise WireError(f"message body is not valid JSON ({type(exc).__name__})") from None
    msg = _from_obj(_CLASS[env.kind], obj)
    if msg.round != env.round:
        raise WireError(f"message round {msg.round} differs from its envelope's round {env.round}")
    return msg


def decode_message(payload: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS,
                   kind: Kind | None = None, trust: Trust | None = None) -> tuple[Envelope, Message]:
    """Decode an envelope and its JSON message; ``kind`` (optional) is the one the caller expects; ``trust``:
    the signature is checked (:func:`protocol.envelope.decode_envelope`)."""
    env = decode_envelope(payload, limits, trust)
    if kind is not None and env.kind != kind:
        raise WireError(f"expected a {kind.name.lower()} message, got {env.kind.name.lower()}")
    return env, parse_message(env, limits)
