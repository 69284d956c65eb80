"""The metrics schema: valid records pass, every kind of damage is named, older files are read or refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.metrics_schema import (
    VERSION,
    MetricsSchemaError,
    end_record,
    read_metrics,
    round_record,
    run_record,
    validate_record,
)


def _round(**kw: object) -> dict:
    args: dict = {"round": 1, "wall_s": 2.5, "selected": ["a", "b"], "refused": {"late": 1},
                  "devices": [{"id": "a", "result": "accepted"}, {"id": "b", "result": "late"}],
                  "bytes_up": 10, "bytes_down": 20, "acc": 0.5, "train_loss": 1.0, "closed": "deadline", "late": 1}
    args.update(kw)
    return round_record("coordinator", 1000.0, **args)


def test_records_of_every_kind_validate_and_count_reports_from_the_rows() -> None:
    rec = _round()
    assert rec["reported"] == 1 and rec["version"] == VERSION and rec["acc_definition"]
    for r in (run_record("simulate", 1.0, "flayer", 3, 4), rec, end_record("emulate", 2.0, 3, True, 0.9)):
        assert validate_record(json.loads(json.dumps(r))) == r


@pytest.mark.parametrize(("change", "named"), [
    ({"acc": 1.5}, "acc"), ({"bytes_up": -1}, "bytes_up"), ({"selected": "a"}, "selected"),
    ({"devices": [{"id": "a", "result": "maybe"}]}, "devices"), ({"reported": 2}, "reported"),
    ({"refused": {"late": "1"}}, "refused"), ({"schema": "other"}, "schema"), ({"kind": "lap"}, "kind"),
    ({"time": float("nan")}, "time"), ({"devices": [{"id": "a", "result": "accepted"}] * 2}, "twice"),
])
def test_a_bad_field_is_named(change: dict, named: str) -> None:
    rec = {**_round(), **change}
    with pytest.raises(MetricsSchemaError, match=named):
        validate_record(rec)


def test_missing_field_is_named() -> None:
    rec = _round()
    del rec["bytes_down"]
    with pytest.raises(MetricsSchemaError, match="missing field 'bytes_down'"):
        validate_record(rec)


def test_older_files_are_upgraded_or_refused_with_a_clear_message(tmp_path: Path) -> None:
    old_coord = {"round": 2, "selected": ["a", "b"], "received": 2, "accepted": 1, "rejected": {"late": 1},
                 "clipped": 0, "bytes_in": 5, "bytes_out": 7, "model_bytes": 3, "acc": 0.4, "train_loss": None,
                 "closed": "deadline", "wall_s": 1.0, "counters": {}}
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps(old_coord) + "\n")
    (rec,) = read_metrics(f)
    assert rec["version"] == VERSION and rec["upgraded_from"] == 0 and rec["reported"] == 1
    assert (rec["bytes_up"], rec["bytes_down"], rec["refused"]) == (5, 7, {"late": 1})
    f.write_text(json.dumps({"round": 1, "acc": 0.3, "client_acc": [0.3], "upload_bytes": 9}) + "\n")
    with pytest.raises(MetricsSchemaError, match=r"metrics.jsonl:1: .*before metrics schema version 1"):
        read_metrics(f)
    f.write_text(json.dumps({**_round(), "version": VERSION + 1}) + "\n")
    with pytest.raises(MetricsSchemaError, match="newer FLAYER Edge"):
        read_metrics(f)
    f.write_text(json.dumps(_round()) + "\n{torn")
    with pytest.raises(MetricsSchemaError, match=r":2: not JSON"):
        read_metrics(f)
