"""benchmarks/thin_links.py reuses a finished run only when it was made with the same settings: every
setting that changes the result is in the reuse key (the simulate arguments recorded in the run folder),
so a run made with another --lr, --keep, --clients, --samples, --rounds or seed is run again."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("thin_links_bench", ROOT / "benchmarks/thin_links.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(out: Path, **kw: Any) -> argparse.Namespace:
    base = {"rounds": 15, "samples": 6000, "clients": 20, "keep": 0.15, "lr": 0.05, "data_dir": None, "out": out}
    return argparse.Namespace(**{**base, **kw})


def test_every_setting_that_changes_the_result_is_in_the_key(bench: Any, tmp_path: Path) -> None:
    key = bench.simulate_args("int8-topk-ef", True, 0, _args(tmp_path))
    for change in ({"lr": 0.1}, {"keep": 0.25}, {"clients": 10}, {"samples": 12000}, {"rounds": 30}):
        assert bench.simulate_args("int8-topk-ef", True, 0, _args(tmp_path, **change)) != key, change
    assert bench.simulate_args("int8-topk-ef", True, 1, _args(tmp_path)) != key
    assert bench.simulate_args("int8-topk-ef", False, 0, _args(tmp_path)) != key
    # where the data lies and where the run goes do not change it; the top-k share only where it is used
    assert bench.simulate_args("int8-topk-ef", True, 0, _args(tmp_path / "x", data_dir="/d")) == key
    assert bench.simulate_args("fp32", True, 0, _args(tmp_path, keep=0.25)) == \
        bench.simulate_args("fp32", True, 0, _args(tmp_path))
    # no --lr: the default it stands for is named, so a changed default is a new run
    assert "--lr" in bench.simulate_args("fp32", False, 0, _args(tmp_path, lr=None))


def _finished_run(folder: Path, settings: list[str] | None) -> None:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"rounds": 15, "final_personal_acc": 0.9}))
    (folder / "config.json").write_text(json.dumps({"data": {"samples": 6000}}))
    if settings is not None:
        (folder / "bench-settings.json").write_text(json.dumps({"simulate": settings}))


def test_a_run_made_with_other_settings_is_run_again(bench: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        ran.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"rounds": 15, "final_personal_acc": 0.5}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    old = _args(tmp_path, lr=0.005)
    folder = tmp_path / "runs" / bench.run_name("fp32", False, 0)
    _finished_run(folder, bench.simulate_args("fp32", False, 0, old))  # same rounds and samples, another lr

    assert bench.run_one("fp32", False, 0, old)["final_personal_acc"] == 0.9 and not ran  # same settings: reused
    new = _args(tmp_path, lr=0.05)
    assert bench.run_one("fp32", False, 0, new)["final_personal_acc"] == 0.5 and len(ran) == 1
    assert "0.05" in ran[0] and ran[0][ran[0].index("--lr") + 1] == "0.05"
    recorded = json.loads((folder / "bench-settings.json").read_text())["simulate"]
    assert recorded == bench.simulate_args("fp32", False, 0, new)
    assert bench.run_one("fp32", False, 0, new)["final_personal_acc"] == 0.5 and len(ran) == 1  # now reused

    unknown = tmp_path / "runs" / bench.run_name("fp16", False, 0)
    _finished_run(unknown, None)  # a run whose settings were not recorded is not trusted
    bench.run_one("fp16", False, 0, new)
    assert len(ran) == 2
