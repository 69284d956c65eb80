"""``flayer tune``: choices by validation accuracy, divergence recorded without ending the tuning,
resumable runs, and ``flayer bench --tuned`` running each method at its chosen point."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from cli.common import CliError
from cli.main import main
from cli.tune import FORMAT, Point, choose, grid_points, parse_grid, parse_lrs
from cli.tuned import load_tuned
from flayer.config import TrainConfig
from flayer.partition import make_partition
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.train import client_data


def _row(method: str, lr: float, val: float | None, test: float, diverged: str | None = None) -> dict[str, Any]:
    return {"method": method, "lr": lr, "set": [], "label": f"lr{lr:g}", "best_val_acc": val,
            "best_test_acc": test, "diverged": diverged}


def test_the_choice_follows_validation_never_test() -> None:
    rows = [_row("fedavg", 0.01, 0.80, 0.99),  # best test accuracy, worse validation accuracy
            _row("fedavg", 0.05, 0.85, 0.90),
            _row("fedavg", 0.1, 0.95, 0.10, diverged="diverged: training loss nan in round 3"),
            _row("local", 0.01, 0.70, 0.70), _row("local", 0.02, 0.70, 0.75),  # a tie goes to the earlier point
            _row("ditto", 0.01, None, 0.9)]  # no validation accuracy: never chosen
    got = choose(rows)
    assert got["fedavg"].lr == 0.05 and got["fedavg"].test_acc == 0.90
    assert got["local"].lr == 0.01
    assert "ditto" not in got


def test_grid_flags_are_validated() -> None:
    assert parse_lrs("0.005, 0.05") == [0.005, 0.05]
    for bad in ("", "0.1,0.1", "0,0.1", "nan", "x", "11"):
        with pytest.raises(CliError, match="--lrs"):
            parse_lrs(bad)
    grid = parse_grid(["ditto.mu=0.01,0.1"], ["ditto", "fedavg"])
    assert grid == {"ditto": [["ditto.mu=0.01", "ditto.mu=0.1"]]}
    points = grid_points(["fedavg", "ditto"], [0.01, 0.1], grid)
    assert len(points) == 2 + 4 and Point("ditto", 0.1, ("ditto.mu=0.1",)) in points
    assert Point("ditto", 0.1, ("ditto.mu=0.1",)).label == "lr0.1_mu=0.1"
    for bad, words in (("ditto.mu", "expected"), ("mu=0.1", "expected"), ("fedala.eta=1", "not among")):
        with pytest.raises(CliError, match=words):
            parse_grid([bad], ["ditto"])


def _tuned(tmp_path: Path, **changes: Any) -> Path:
    doc = {"format": FORMAT, "settings": {"dataset": "digits", "partition": "iid"},
           "choice": {"fedavg": {"lr": 0.05, "set": [], "best_val_acc": 0.9, "best_test_acc": 0.9}}, **changes}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(("changes", "words"), [
    ({"format": "other"}, "not a tuned.json"),
    ({"settings": {"dataset": "fmnist", "partition": "iid"}}, "tuned on dataset 'fmnist'"),
    ({"choice": {}}, "no choice for fedavg"),
    ({"choice": {"fedavg": {"lr": -1, "best_val_acc": 0.9, "best_test_acc": 0.9}}}, "out of range"),
    ({"choice": {"fedavg": {"lr": "x"}}}, "malformed"),
    ({"choice": {"fedavg": {"lr": 0.1, "set": ["ditto.mu=1"], "best_val_acc": 0.9, "best_test_acc": 0.9}}},
     "another method"),
])
def test_a_bad_tuned_file_is_refused_before_any_run(tmp_path: Path, capsys: Any, changes: dict[str, Any],
                                                     words: str) -> None:
    rc = main(["bench", "--dataset", "digits", "--partition", "iid", "--clients", "2", "--rounds", "1", "--seeds",
               "0", "--methods", "fedavg", "--tuned", str(_tuned(tmp_path, **changes)), "--out",
               str(tmp_path / "b")])
    assert rc == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "b" / "partition.npz").exists()


def test_a_good_tuned_file_is_read() -> None:
    class Cfg:
        class data:
            dataset, partition = "digits", "iid"

    path = Path(__file__).parent / "_tuned_example.json"
    got = load_tuned(path, ["fedavg", "ditto"], Cfg)
    assert got["fedavg"].lr == 0.05 and got["ditto"].sets == ("ditto.mu=0.1",)


def test_a_diverging_run_stops_early_and_says_why(digits: Any) -> None:
    part = make_partition(digits.y, digits.num_classes, 2, "iid", seed=0, samples=300)
    clients = [client_data(digits, c) for c in part.clients]
    spec = digits.model_spec()
    ok = simulate(make_strategy("fedavg", spec, TrainConfig(lr=0.05, batch_size=10), {}), clients, 2, 0, val=True)
    assert ok.diverged is None and len(ok.rounds) == 2
    assert all(r.val_acc is not None and 0 <= r.val_acc <= 1 for r in ok.rounds)
    # lr 9: round 1's loss ~1e32, finite (a blow-up); lr 10: NaN weights, refused by the aggregator
    for lr, words in ((9.0, "over 10 x ln(10)"), (10.0, "refused")):
        bad = simulate(make_strategy("fedavg", spec, TrainConfig(lr=lr, batch_size=10), {}), clients, 5, 0,
                       val=True, blowup=10.0)
        assert bad.diverged is not None and words in bad.diverged and len(bad.rounds) == 1, bad.diverged
        assert all(math.isfinite(float(v.abs().max())) for v in bad.global_state.values())


@pytest.mark.slow
def test_tune_then_bench_tuned_end_to_end(tmp_path: Path, capsys: Any) -> None:
    common = ["--dataset", "digits", "--partition", "iid", "--clients", "2", "--samples", "300", "--rounds", "2",
              "--methods", "fedavg", "--jobs", "2"]
    out = tmp_path / "tune"
    assert main(["tune", *common, "--lrs", "0.05,10", "--out", str(out)]) == 0
    doc = json.loads((out / "tuned.json").read_text())
    runs = {r["lr"]: r for r in doc["runs"]}
    assert runs[10.0]["diverged"] and runs[0.05]["diverged"] is None
    assert doc["choice"]["fedavg"]["lr"] == 0.05
    assert main(["tune", *common, "--lrs", "0.05,10", "--out", str(out)]) == 0  # resumed: nothing re-run
    assert "2 already done" in capsys.readouterr().err
    assert main(["tune", *common, "--lrs", "0.02,0.05,10", "--out", str(out)]) == 0  # a wider grid: one more run
    assert "2 already done in" in capsys.readouterr().err
    assert {r["lr"] for r in json.loads((out / "tuned.json").read_text())["runs"]} == {0.02, 0.05, 10.0}
    assert main(["tune", *common, "--lrs", "0.05", "--out", str(out)]) == 2  # dropping a point: another grid
    assert "lrs differ" in capsys.readouterr().err
    bench = tmp_path / "bench"
    assert main(["bench", *common, "--seeds", "0,1", "--tuned", str(out / "tuned.json"), "--out", str(bench)]) == 0
    err = capsys.readouterr().err
    assert "1 run(s) taken from the tuning" in err and "1 to run" in err  # seed 0 is the tuning's run
    lr = json.loads((out / "tuned.json").read_text())["choice"]["fedavg"]["lr"]
    assert (bench / "runs/fedavg/seed0/summary.json").read_text() == (out / f"runs/fedavg/lr{lr:g}/summary.json").read_text()
    assert f"--lr {lr:g}" in (bench / "runs/fedavg/seed1/log.txt").read_text().splitlines()[0]


def test_a_choice_at_the_grids_edge_is_flagged() -> None:
    from cli.tune import markdown

    rows = [_row("fedavg", 0.01, 0.80, 0.8), _row("fedavg", 0.1, 0.95, 0.9), _row("local", 0.01, 0.7, 0.7),
            _row("local", 0.05, 0.9, 0.9), _row("local", 0.1, 0.8, 0.8)]
    text = markdown(rows, choose(rows))
    assert text.count("at the grid's edge") == 1 and "**chosen**" in text.split("local")[2]


def test_fedbabu_is_validated_on_the_personal_models_it_is_judged_by(digits: Any) -> None:
    part = make_partition(digits.y, digits.num_classes, 2, "iid", seed=0, samples=300)
    clients = [client_data(digits, c) for c in part.clients]
    res = simulate(make_strategy("fedbabu", digits.model_spec(), TrainConfig(lr=0.05, batch_size=10), {}),
                   clients, 2, 0, val=True)
    rounds = [r.val_acc for r in res.rounds]
    assert res.final_val_acc is not None and all(v is not None for v in rounds)
    assert res.best_val_acc == max([*rounds, res.final_val_acc])  # the same maximum as best_acc, on validation
    assert res.best_acc == max([r.acc for r in res.rounds] + [res.final_acc])
    plain = simulate(make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05, batch_size=10), {}),
                     clients, 1, 0)
    assert plain.final_val_acc is None and plain.best_val_acc is None  # no validation asked for


def test_a_summary_without_the_final_validation_is_redone_only_for_fedbabu(tmp_path: Path) -> None:
    from cli.tune import deploys_received, read_run

    assert not deploys_received("fedbabu") and deploys_received("fedavg") and deploys_received("flayer")
    base = {"acc": [0.5, 0.6], "best_acc": 0.9, "final_personal_acc": 0.9, "best_val_acc": 0.6,
            "wall_seconds": 1.0, "diverged": None}
    for method, counts in (("fedavg", True), ("fedbabu", False)):
        f = tmp_path / method / "summary.json"
        f.parent.mkdir()
        f.write_text(json.dumps({**base, "strategy": method}))
        assert (read_run(f, Point(method, 0.1), 2) is not None) is counts
        f.write_text(json.dumps({**base, "strategy": method, "final_personal_val_acc": 0.88, "best_val_acc": 0.88}))
        row = read_run(f, Point(method, 0.1), 2)
        assert row is not None and row["best_val_acc"] == 0.88 and row["final_personal_val_acc"] == 0.88


def test_a_bench_resumed_with_more_tuned_methods_keeps_its_runs() -> None:
    from cli.bench import _grows

    old = {"fedavg": {"lr": 0.1, "set": []}}
    assert _grows(old, {**old, "fedbabu": {"lr": 0.05, "set": []}})
    assert not _grows(old, {"fedavg": {"lr": 0.2, "set": []}})  # a changed choice is another bench
    assert _grows({**old, "local": {"lr": 0.1, "set": []}}, {"fedbabu": {"lr": 0.05, "set": []}})  # other methods
    assert _grows([0.1], [0.1, 0.2]) and not _grows([0.1, 0.2], [0.2])


def test_the_stable_choice_keeps_a_factor_2_margin_from_divergence() -> None:
    from cli.tune import choose_stable

    nan = "diverged: training loss nan in round 2"
    rows = [_row("flayer", 0.05, 0.96, 0.95), _row("flayer", 0.1, 0.97, 0.95), _row("flayer", 0.2, 0.5, 0.5, nan),
            _row("fedala", 0.05, 0.95, 0.9), _row("fedala", 0.1, 0.96, 0.9), _row("fedala", 0.2, 0.955, 0.9),
            _row("fedavg", 0.1, 0.80, 0.8), _row("fedavg", 0.2, 0.84, 0.8),  # the best is the grid's top
            _row("local", 0.1, 0.9, 0.9, nan), _row("local", 0.2, 0.9, 0.9, nan)]
    best, stable = choose(rows), choose_stable(rows)
    assert best["flayer"].lr == 0.1 and stable["flayer"].lr == 0.05  # 0.2 diverged: 0.1 has no margin
    assert best["fedala"].lr == stable["fedala"].lr == 0.1  # 0.2 ran to the end
    assert best["fedavg"].lr == 0.2 and stable["fedavg"].lr == 0.1  # nothing above 0.2 was tried
    assert "local" not in best and "local" not in stable


def test_bench_reads_the_stable_pick_and_refuses_a_file_without_one(tmp_path: Path) -> None:
    class Cfg:
        class data:
            dataset, partition = "digits", "iid"

    doc = json.loads((Path(__file__).parent / "_tuned_example.json").read_text())
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    with pytest.raises(CliError, match="no stable_choice"):
        load_tuned(old, ["fedavg"], Cfg, "stable")
    doc["stable_choice"] = {"fedavg": {**doc["choice"]["fedavg"], "lr": 0.02}}
    new = tmp_path / "new.json"
    new.write_text(json.dumps(doc))
    assert load_tuned(new, ["fedavg"], Cfg, "stable")["fedavg"].lr == 0.02
    assert load_tuned(new, ["fedavg"], Cfg)["fedavg"].lr == 0.05
    with pytest.raises(CliError, match="no stable choice for ditto"):
        load_tuned(new, ["fedavg", "ditto"], Cfg, "stable")
