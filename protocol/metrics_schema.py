"""The metrics file every learning command writes: one versioned JSON-lines schema.

``flayer simulate`` (``OUT/metrics.jsonl``), ``flayer coordinator`` (``STATE_DIR/metrics.jsonl``)
and ``flayer emulate`` (``OUT/metrics.jsonl``, beside the coordinator's own file) write the same
records, one per line, flushed as the run goes:

- ``run``: once per start (a resumed coordinator writes another): source, strategy, rounds planned;
- ``round``: one per closed round (per aggregation in asynchronous mode): who was selected, who
  reported, refusals with reasons, bytes up and down, accuracy and what it measures, per-device rows;
- ``end``: once when the run ends: rounds done, whether every round ran, final accuracy.

Every record carries ``schema`` = ``"flayer-metrics"`` and ``version``; the fields are documented one
by one in ``docs/reference/metrics.md``. A reader (:func:`read_metrics`) upgrades the coordinator's
pre-schema lines (version 0) and refuses anything else it cannot read with a message naming the file,
the line and what to do. Fields a source adds beyond the common ones are kept as they are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from flayer.files import open_private

__all__ = [
    "ACC_DEFINITIONS",
    "DEVICE_RESULTS",
    "SCHEMA",
    "SOURCES",
    "VERSION",
    "MetricsFile",
    "MetricsSchemaError",
    "end_record",
    "epsilon_value",
    "read_metrics",
    "round_record",
    "run_record",
    "upgrade",
    "validate_record",
]

SCHEMA = "flayer-metrics"
VERSION = 1
SOURCES = ("simulate", "coordinator", "emulate")
KINDS = ("run", "round", "end")
MODES = ("sync", "async")
DEVICE_RESULTS = ("accepted", "refused", "late", "missing")
MAX_REFUSALS = 50  # per round record: the latest refusals with their reasons

ACC_DEFINITIONS = {
    "simulate": "sample-weighted test accuracy over every client's test split, measured after the "
                "download and before local training",
    "coordinator": "sample-weighted test accuracy the accepted devices measured on their test splits after "
                   "the download and before local training",
    "emulate": "sample-weighted test accuracy the accepted devices measured on their test splits after "
               "the download and before local training",
}


class MetricsSchemaError(ValueError):
    """A metrics record or file does not follow the schema (the message names the field or line)."""


def _head(kind: str, source: str, time: float) -> dict[str, Any]:
    if source not in SOURCES:
        raise MetricsSchemaError(f"source must be one of {SOURCES}, got {source!r}")
    return {"schema": SCHEMA, "version": VERSION, "kind": kind, "source": source, "time": round(float(time), 3)}


def run_record(source: str, time: float, strategy: str, rounds: int, devices: int | None,
               **extra: Any) -> dict[str, Any]:
    return {**_head("run", source, time), "strategy": strategy, "rounds": int(rounds), "devices": devices, **extra}


def round_record(source: str, time: float, *, round: int, wall_s: float, selected: Iterable[str],
                 devices: list[dict[str, Any]], refused: Mapping[str, int], bytes_up: int, bytes_down: int,
                 acc: float | None, train_loss: float | None, closed: str, late: int = 0,
                 refusals: list[dict[str, str]] | None = None, mode: str = "sync", **extra: Any) -> dict[str, Any]:
    """One ``round`` record; ``reported`` is counted from the device rows marked ``accepted``."""
    rec = {**_head("round", source, time), "round": int(round), "mode": mode, "wall_s": round_s(wall_s),
           "selected": [str(s) for s in selected], "reported": sum(d["result"] == "accepted" for d in devices),
           "late": int(late), "refused": {str(k): int(v) for k, v in refused.items() if v},
           "refusals": list(refusals or [])[-MAX_REFUSALS:], "bytes_up": int(bytes_up),
           "bytes_down": int(bytes_down), "acc": acc, "acc_definition": ACC_DEFINITIONS[source],
           "train_loss": train_loss, "closed": closed, "devices": devices, **extra}
    return validate_record(rec)


def round_s(x: float) -> float:
    return round(float(x), 3)


def end_record(source: str, time: float, rounds_done: int, finished: bool, final_acc: float | None,
               **extra: Any) -> dict[str, Any]:
    return {**_head("end", source, time), "rounds_done": int(rounds_done), "finished": bool(finished),
            "final_acc": final_acc, **extra}


# ---- validation ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _nonneg_int(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _opt_num(v: Any) -> bool:
    return v is None or _is_num(v)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _counts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _nonneg_int(n) for k, n in v.items())


def _refusals(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_REFUSALS and all(
        isinstance(r, dict) and isinstance(r.get("reason"), str) and isinstance(r.get("detail", ""), str)
        for r in v)


def _device_rows(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(d, dict) and isinstance(d.get("id"), str) and d.get("result") in DEVICE_RESULTS
        and _opt_num(d.get("acc")) for d in v)


_COMMON = {"schema": lambda v: v == SCHEMA, "version": _is_int, "kind": lambda v: v in KINDS,
           "source": lambda v: v in SOURCES, "time": _is_num}
_FIELDS: dict[str, dict[str, Any]] = {
    "run": {"strategy": lambda v: isinstance(v, str), "rounds": _nonneg_int,
            "devices": lambda v: v is None or _nonneg_int(v)},
    "round": {"round": _nonneg_int, "mode": lambda v: v in MODES, "wall_s": lambda v: _is_num(v) and v >= 0,
              "selected": _str_list, "reported": _nonneg_int, "late": _nonneg_int, "refused": _counts,
              "refusals": _refusals, "bytes_up": _nonneg_int, "bytes_down": _nonneg_int, "acc": _opt_num,
              "acc_definition": lambda v: isinstance(v, str) and bool(v), "train_loss": _opt_num,
              "closed": lambda v: isinstance(v, str), "devices": _device_rows},
    "end": {"rounds_done": _nonneg_int, "finished": lambda v: isinstance(v, bool), "final_acc": _opt_num},
}


def validate_record(rec: Any) -> dict[str, Any]:
    """``rec`` when it is a valid record of this version; MetricsSchemaError naming the first bad field."""
    if not isinstance(rec, dict):
        raise MetricsSchemaError(f"a record must be a JSON object, got {type(rec).__name__}")
    for name, ok in _COMMON.items():
        if name not in rec:
            raise MetricsSchemaError(f"missing field {name!r}")
        if not ok(rec[name]):
            raise MetricsSchemaError(f"field {name!r} has a bad value {rec[name]!r}")
    if rec["version"] != VERSION:
        raise MetricsSchemaError(f"version {rec['version']} is not {VERSION}")
    for name, ok in _FIELDS[rec["kind"]].items():
        if name not in rec:
            raise MetricsSchemaError(f"{rec['kind']} record: missing field {name!r}")
        if not ok(rec[name]):
            raise MetricsSchemaError(f"{rec['kind']} record: field {name!r} has a bad value {rec[name]!r:.200}")
    if rec["kind"] == "round":
        ids = [d["id"] for d in rec["devices"]]
        if len(set(ids)) != len(ids):
            raise MetricsSchemaError("round record: a device appears twice in 'devices'")
        if rec["reported"] != sum(d["result"] == "accepted" for d in rec["devices"]):
            raise MetricsSchemaError("round record: 'reported' differs from the devices marked accepted")
        acc = rec["acc"]
        if acc is not None and not 0.0 <= acc <= 1.0:
            raise MetricsSchemaError(f"round record: acc {acc} is not in [0, 1]")
    if rec["kind"] in ("round", "end") and not _epsilon(rec.get("epsilon")):  # private runs (docs/reference/metrics.md)
        raise MetricsSchemaError(f"{rec['kind']} record: epsilon {rec.get('epsilon')!r} is neither null, a number "
                                 f">= 0 nor \"inf\"")
    return rec


def epsilon_value(eps: float | None) -> float | str | None:
    """Epsilon as a record holds it: a number, ``"inf"`` (no noise: JSON has no infinity), or null (not private)."""
    return None if eps is None else "inf" if math.isinf(eps) else float(eps)


def _epsilon(v: Any) -> bool:
    return v is None or v == "inf" or (_is_num(v) and v >= 0)


# ---- reading, older files included ---------------------------------------------------------------------------
_LEGACY_COORDINATOR = {"round", "selected", "accepted", "rejected", "bytes_in", "bytes_out", "closed", "wall_s"}


def upgrade(obj: Any, where: str = "record") -> dict[str, Any]:
    """A record of this version from a line of a metrics file: a current record is validated; a line of
    the coordinator's pre-schema format (version 0) is converted; anything else is refused."""
    if isinstance(obj, dict) and "schema" in obj:
        if obj.get("schema") != SCHEMA:
            raise MetricsSchemaError(f"{where}: schema {obj.get('schema')!r} is not {SCHEMA!r}")
        version = obj.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            raise MetricsSchemaError(f"{where}: written by a newer FLAYER Edge (metrics schema version {version}; "
                                     f"this one reads versions 0 to {VERSION}); upgrade flayer-edge to read it")
        try:
            return validate_record(obj)
        except MetricsSchemaError as exc:
            raise MetricsSchemaError(f"{where}: {exc}") from None
    if isinstance(obj, dict) and _LEGACY_COORDINATOR <= set(obj):
        try:
            return _from_legacy_coordinator(obj)
        except (KeyError, TypeError, ValueError, MetricsSchemaError) as exc:
            raise MetricsSchemaError(f"{where}: unreadable pre-schema coordinator line: {exc}") from None
    raise MetricsSchemaError(
        f"{where}: not a metrics record of schema {SCHEMA!r} (no 'schema' field): the file was written before "
        f"metrics schema version 1 by 'flayer simulate' or 'flayer emulate', whose old formats are not read; "
        f"run the command again to get a version {VERSION} file")


def _from_legacy_coordinator(obj: Mapping[str, Any]) -> dict[str, Any]:
    selected = [str(s) for s in obj["selected"]]
    rejected = {str(k): int(v) for k, v in dict(obj["rejected"]).items()}
    rows = [{"id": s, "result": "missing"} for s in selected]
    for row in rows[:int(obj["accepted"])]:  # which ones is not recorded; the count is
        row["result"] = "accepted"
    rec = round_record("coordinator", 0.0, round=int(obj["round"]), wall_s=float(obj["wall_s"]), selected=selected,
                       devices=rows, refused=rejected, bytes_up=int(obj["bytes_in"]),
                       bytes_down=int(obj["bytes_out"]), acc=obj.get("acc"), train_loss=obj.get("train_loss"),
                       closed=str(obj["closed"]), late=rejected.get("late", 0), upgraded_from=0)
    return rec


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file (upgraded to this version); MetricsSchemaError names the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MetricsSchemaError(f"{path}: no such metrics file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MetricsSchemaError(f"{path}: unreadable: {exc}") from None
    return parse_lines(text.splitlines(), str(path))


def parse_lines(lines: Iterable[str | bytes], name: str, first_line: int = 1) -> list[dict[str, Any]]:
    out = []
    for i, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MetricsSchemaError(f"{name}:{i}: not JSON ({exc.msg})") from None
        out.append(upgrade(obj, f"{name}:{i}"))
    return out


class MetricsFile:
    """Appends records (validated) to a metrics file, one flushed line each."""

    def __init__(self, path: str | Path, mode: str = "a") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open_private(self.path, mode, encoding="utf-8")  # open for the whole run; a new file 0600

    def write(self, record: Mapping[str, Any]) -> None:
        validate_record(dict(record))
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
