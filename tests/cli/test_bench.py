"""``flayer bench``: real runs (subprocesses) on digits, resumed without re-running; the table's measures."""

from __future__ import annotations

import csv
import json

import pytest

from cli.bench_report import convergence_round, rounds_to_reach
from cli.main import main

ARGS = ["bench", "--dataset", "digits", "--samples", "450", "--clients", "3", "--partition", "iid", "--rounds", "2",
        "--seeds", "0",
        "--methods", "fedavg,local,flayer", "--jobs", "2", "--lr", "0.05"]


@pytest.mark.slow  # ~18 s; the resume rule stays in the default run through test_ablate_takes_the_runs_a_bench_already_ran
def test_bench_runs_then_resumes_without_rerunning(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(ARGS + ["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "3 to run" in err
    summaries = {m: out / "runs" / m / "seed0" / "summary.json" for m in ("fedavg", "local", "flayer")}
    stamps = {m: (p.stat().st_mtime_ns, (p.parent / "log.txt").stat().st_mtime_ns) for m, p in summaries.items()}
    table = (out / "results.md").read_text()
    (out / "results.md").unlink()

    assert main(ARGS + ["--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "3 already done" in captured.err and "0 to run" in captured.err
    assert {m: (p.stat().st_mtime_ns, (p.parent / "log.txt").stat().st_mtime_ns)
            for m, p in summaries.items()} == stamps  # nothing re-ran
    assert (out / "results.md").read_text() == table  # the table is written again, the same
    assert "| fedavg | 1 |" in table and "| local | 1 |" in table and "| fedavg |" in captured.out
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["row"], r["method"]) for r in rows} == {(kind, m) for kind in ("run", "method")
                                                     for m in ("fedavg", "local", "flayer")}
    per_round = {r["method"]: float(r["upload_bytes_per_client_round"]) for r in rows if r["row"] == "run"}
    assert 0 < per_round["local"] < 200  # an empty update: the codec's header only
    numel = json.loads(summaries["fedavg"].read_text())["sent_total"] / 6  # 3 clients x 2 rounds
    # the wire codec's bytes: fp32 values plus headers and tensor names (well under 1% here)
    assert 4 * numel < per_round["fedavg"] < 4 * numel * 1.01
    assert per_round["flayer"] < per_round["fedavg"]  # masked, sparse uploads
    for png in ("accuracy_vs_round.png", "client_spread.png"):
        assert (out / png).stat().st_size > 1000

    # other settings in the same folder are refused
    other = list(ARGS)
    other[other.index("--rounds") + 1] = "3"
    assert main(other + ["--out", str(out)]) == 2
    assert "other settings (rounds differ)" in capsys.readouterr().err

    # --report-only: a table of what finished, nothing started, the missing runs named
    more = [x if x != "0" else "0,1" for x in ARGS]  # --seeds 0,1: seed 1 never ran
    assert main(more + ["--out", str(out), "--report-only"]) == 0
    captured = capsys.readouterr()
    assert "3 run(s) not finished" in captured.err and "fedavg seed1" in captured.err
    assert not (out / "runs" / "fedavg" / "seed1").exists()
    assert "| fedavg | 1 |" in (out / "results.md").read_text() and "seeds 0,1" in captured.out
    assert main(more + ["--out", str(tmp_path / "none"), "--report-only"]) == 2
    assert "holds no bench" in capsys.readouterr().err and not (tmp_path / "none").exists()


def test_rounds_to_reach():
    assert rounds_to_reach([0.1, 0.5, 0.7, 0.9], 0.7) == 3
    assert rounds_to_reach([0.1, 0.5], 0.7) is None


@pytest.mark.parametrize("acc,expected", [
    ([0.2, 0.4, 0.6, 0.7, 0.8] + [0.8] * 7, 9),  # moving average flat from round 9 on
    ([0.1 * i for i in range(1, 11)], 10),  # still rising at the end: the last round
    ([0.5, 0.6, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7004, 0.7], 7),  # a rise within 0.1 points is not a rise
    ([0.5, 0.6, 0.7], None),  # fewer rounds than the window
])
def test_convergence_round(acc, expected):
    assert convergence_round(acc) == expected


def test_time_to_a_target_accuracy_counts_rounds_and_their_cpu_time():
    from cli.bench_report import RunResult, aggregate, markdown_table

    def run(method, seed, acc, cpu, diverged=False):
        return RunResult(method, seed, tuple(acc), acc[-1], acc[-1], max(acc), (acc[-1],), cpu, 100.0, {}, cpu,
                         diverged)

    runs = [run("flayer", 0, [0.5, 0.92, 0.95, 0.96], 40.0), run("flayer", 1, [0.5, 0.8, 0.94, 0.95], 80.0),
            run("local", 0, [0.6, 0.7, 0.8, 0.93], 20.0), run("local", 1, [0.6, 0.7], 20.0, diverged=True)]
    rows, per_run = aggregate(runs, ["flayer", "local"], target=0.94)
    assert per_run[("flayer", 0)]["to_target"] == 3 and per_run[("flayer", 0)]["cpu_to_target"] == 30.0
    assert per_run[("flayer", 1)]["cpu_to_target"] == 60.0 and per_run[("local", 0)]["to_target"] is None
    flayer, local = rows
    assert flayer.to_target == 3 and flayer.target_reached == 2 and flayer.cpu_to_target == 45.0
    assert local.to_target is None and local.target_reached == 0
    table = markdown_table(rows, 0.94)
    assert "rounds to 94% | CPU s to 94% |" in table
    assert "| 3.0 | 45 |" in table and "| - | - |" in table
    assert "| local **1/2 diverged** |" in table and "| flayer |" in table  # a diverged run is named
    assert "rounds to" not in markdown_table(rows)  # no target, no FedAvg row: no such columns
    # FedAvg's best is a column only where FedAvg ran; every line has as many cells as the header
    assert "FedAvg best" not in table
    with_fedavg, _ = aggregate(runs + [run("fedavg", 0, [0.3, 0.5, 0.6, 0.7], 10.0)], ["flayer", "fedavg"])
    for t, cells in ((table, 10), (markdown_table(with_fedavg), 9)):
        assert {line.count("|") for line in t.splitlines()} == {cells + 1}
    assert "| rounds to FedAvg best |" in markdown_table(with_fedavg)
    assert "| flayer | 2 | 95.50 ± 0.71 | 95.50 ± 0.71 | 2.0 (1/2) |" in markdown_table(with_fedavg)  # seed 0 only


def test_a_target_outside_0_1_is_refused(capsys):
    assert main(ARGS + ["--target", "94"]) == 2
    assert "--target 94" in capsys.readouterr().err
