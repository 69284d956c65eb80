"""--log-file and --tensorboard: the log reaches the file; the scalars come from the metrics schema, and without
the tensorboard package the flag is skipped with a warning."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import pytest

from cli.logfile import log_to_file
from cli.tensorboard import TensorBoardSink, scalars
from protocol.metrics_schema import MetricsFile, round_record, run_record


def _rec(r: int) -> dict:
    return round_record("coordinator", time.time(), round=r, wall_s=1.5, selected=["a", "b"],
                        devices=[{"id": "a", "result": "accepted"}, {"id": "b", "result": "missing"}],
                        refused={"late": 2}, bytes_up=2_000_000, bytes_down=5_000_000, acc=0.5, train_loss=None,
                        closed="deadline")


def test_scalars_of_a_round_record() -> None:
    assert scalars(_rec(1)) == {"acc": 0.5, "bytes_up_mb": 2.0, "bytes_down_mb": 5.0, "reported": 1.0,
                                "selected": 2.0, "refused": 2.0, "wall_s": 1.5}


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_flag_is_skipped_with_a_warning_when_the_package_is_missing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = MetricsFile(tmp_path / "metrics.jsonl", "w")
    f.write(run_record("coordinator", time.time(), "fedavg", 2, None))
    f.write(_rec(1))
    f.close()
    with caplog.at_level(logging.WARNING):
        sink = TensorBoardSink(tmp_path / "tb", tmp_path / "metrics.jsonl")
    assert sink.poll() == 0 and "tensorboard package is not installed" in caplog.text
    sink.close()
    assert not (tmp_path / "tb").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_scalars_are_written(tmp_path: Path) -> None:
    f = MetricsFile(tmp_path / "metrics.jsonl", "w")
    f.write(_rec(1))
    sink = TensorBoardSink(tmp_path / "tb", tmp_path / "metrics.jsonl")
    assert sink.poll() == 1
    f.write(_rec(2))
    sink.close()
    f.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_log_file_gets_the_log(tmp_path: Path) -> None:
    root = logging.getLogger()
    saved = root.level, {h: h.level for h in root.handlers}
    handler = log_to_file(tmp_path / "logs" / "run.log")
    try:
        logging.getLogger("flayer.test").info("round 3 closed")
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(saved[0])
        for h, level in saved[1].items():
            h.setLevel(level)
    assert "INFO flayer.test: round 3 closed" in (tmp_path / "logs" / "run.log").read_text()
