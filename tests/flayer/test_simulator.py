"""The in-process simulator: determinism, PFLlib-style evaluation records, and the CLI commands
(`flayer simulate`, `flayer ablate`) end to end on tiny data."""

from __future__ import annotations

import json

import pytest
import torch

from cli.main import main
from flayer.config import TrainConfig
from flayer.partition import make_partition
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.train import client_data
from protocol.metrics_schema import read_metrics

TRAIN = TrainConfig(lr=0.05, batch_size=10, device="cpu")


@pytest.fixture(scope="module")
def clients(digits):
    part = make_partition(digits.y, 10, 3, "dir0.5", seed=3, samples=600)
    return [client_data(digits, c) for c in part.clients]


@pytest.mark.parametrize("name", ["fedavg", "flayer", "flayer-ref"])
def test_same_seed_same_global_state(digits, clients, name):
    spec = digits.model_spec()
    runs = [simulate(make_strategy(name, spec, TRAIN), clients, rounds=2, seed=5) for _ in range(2)]
    a, b = runs[0].global_state, runs[1].global_state
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r.acc for r in runs[0].rounds] == [r.acc for r in runs[1].rounds]
    assert runs[0].final_acc == runs[1].final_acc
    other = simulate(make_strategy(name, digits.model_spec(), TRAIN), clients, rounds=2, seed=6).global_state
    assert not all(torch.equal(a[k], other[k]) for k in a)


def test_records_are_sample_weighted_and_count_uploads(digits, clients):
    res = simulate(make_strategy("flayer", digits.model_spec(), TRAIN), clients, rounds=2, seed=0)
    tests = [len(c.test) for c in clients]
    for rec in res.rounds:
        weighted = sum(a * n for a, n in zip(rec.client_acc, tests)) / sum(tests)
        assert rec.acc == pytest.approx(weighted)
        assert rec.selected == (0, 1, 2)
        assert 0 < rec.sent < rec.numel  # masked uploads
        assert rec.coordinates == sum(v.numel() for v in res.global_state.values())
        assert 0 <= rec.unsent < rec.coordinates
    assert res.states[0].scalars["participations"] == 2


def test_simulate_and_ablate_commands(tmp_path, capsys):
    common = ["--dataset", "digits", "--clients", "3", "--rounds", "2", "--seed", "1", "--threads", "1"]
    assert main(["simulate", "--strategy", "flayer", *common, "--out", str(tmp_path / "sim")]) == 0
    lines = read_metrics(tmp_path / "sim" / "metrics.jsonl")  # validated against the metrics schema
    assert [r["kind"] for r in lines] == ["run", "round", "round", "end"]
    assert [r["round"] for r in lines[1:3]] == [1, 2] and lines[3]["final_acc"] == lines[2]["acc"]
    capsys.readouterr()
    assert main(["ablate", *common, "--variants", "flayer,zero", "--out", str(tmp_path / "abl")]) == 0
    out = capsys.readouterr().out
    assert "flayer" in out and "zero" in out and "upload fraction" in out
    summary = json.loads((tmp_path / "abl" / "summary.json").read_text())
    assert set(summary["variants"]) == {"flayer", "zero"}
    assert (tmp_path / "abl" / "ablation.md").read_text().count("\n|") == 4
    assert (tmp_path / "abl" / "zero" / "seed1" / "metrics.jsonl").is_file()
    cfg = json.loads((tmp_path / "abl" / "zero" / "seed1" / "config.json").read_text())
    assert cfg["strategy_options"]["flayer"]["server_rule"] == "zero"


def test_ablate_over_seeds_at_tuned_rates_resumes(tmp_path, capsys):
    common = ["--dataset", "digits", "--clients", "2", "--rounds", "2", "--seed", "0", "--threads", "1",
              "--samples", "200", "--partition", "iid", "--variants", "flayer,flayer-ref-x1",
              "--out", str(tmp_path / "abl")]
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"format": "flayer-tune/1", "settings": {"dataset": "digits", "partition": "iid"},
                                 "choice": {"flayer": {"lr": 0.07, "set": [], "best_val_acc": 0.9,
                                                       "best_test_acc": 0.9},
                                            "flayer-ref": {"lr": 0.03, "set": [], "best_val_acc": 0.9,
                                                           "best_test_acc": 0.9}}}))
    assert main(["ablate", *common, "--seeds", "0,1", "--tuned", str(tuned)]) == 0
    assert "4 to run" in capsys.readouterr().err
    abl = tmp_path / "abl"
    for variant, lr in (("flayer", 0.07), ("flayer-ref-x1", 0.03)):
        for seed in (0, 1):
            cfg = json.loads((abl / variant / f"seed{seed}" / "config.json").read_text())
            assert cfg["train"]["lr"] == lr and cfg["seed"] == seed and cfg["data"]["partition_seed"] == 0
    assert json.loads((abl / "flayer-ref-x1/seed1/config.json").read_text())[
        "strategy_options"]["flayer-ref"]["lr_scale"] == 1.0
    md = (abl / "ablation.md").read_text()
    assert "±" in md and "| 0.07 |" in md.replace("  ", " ")
    assert main(["ablate", *common, "--seeds", "0,1", "--tuned", str(tuned)]) == 0  # resumed: nothing re-run
    assert "4 already done" in capsys.readouterr().err
    assert main(["ablate", *common, "--seeds", "0,1"]) == 2  # other settings (no tuned rates): refused
    assert "tuned differ" in capsys.readouterr().err


def test_ablate_rejects_unknown_variant(capsys):
    assert main(["ablate", "--dataset", "digits", "--variants", "flayer,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_bad_strategy_option_is_a_one_line_error(tmp_path, capsys):
    rc = main(["simulate", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--strategy", "flayer",
               "--set", "flayer.mask_floor=2.0", "--out", str(tmp_path)])
    assert rc == 2 and "mask_floor" in capsys.readouterr().err


@pytest.mark.slow  # flayer ablate itself runs in test_simulate_and_ablate_commands
def test_ablate_takes_the_runs_a_bench_already_ran(tmp_path, capsys):
    data = ["--dataset", "digits", "--clients", "3", "--rounds", "2", "--seed", "0", "--samples", "300",
            "--partition", "iid", "--lr", "0.05"]
    bench = tmp_path / "bench"
    assert main(["bench", *data, "--seeds", "0,1", "--methods", "flayer", "--jobs", "2", "--out", str(bench)]) == 0
    ablate = ["ablate", *data, "--threads", "1", "--seeds", "0,1", "--variants", "flayer,no-masks"]
    capsys.readouterr()
    assert main([*ablate, "--reuse", str(bench), "--out", str(tmp_path / "abl")]) == 0
    err = capsys.readouterr().err
    assert "2 run(s) taken" in err and "(flayer seed0, flayer seed1)" in err and "2 to run" in err
    for seed in (0, 1):  # the bench's run, copied whole
        assert (tmp_path / "abl" / "flayer" / f"seed{seed}" / "summary.json").read_bytes() == \
            (bench / "runs" / "flayer" / f"seed{seed}" / "summary.json").read_bytes()
    # and it is the run the ablation would have made itself
    assert main(["ablate", *data, "--threads", "1", "--variants", "flayer", "--out", str(tmp_path / "own")]) == 0
    own = json.loads((tmp_path / "own" / "flayer" / "seed0" / "summary.json").read_text())
    took = json.loads((bench / "runs" / "flayer" / "seed0" / "summary.json").read_text())
    assert own["acc"] == took["acc"] and own["final_personal_acc"] == took["final_personal_acc"]
    # another learning rate, or another partition (its seed): nothing is taken
    one = ["--threads", "1", "--variants", "flayer", "--reuse", str(bench)]
    capsys.readouterr()
    other_lr = [x if x != "0.05" else "0.02" for x in data]
    assert main(["ablate", *other_lr, *one, "--out", str(tmp_path / "abl-lr")]) == 0
    assert "0 run(s) taken" in capsys.readouterr().err
    other_part = [x if x != "0" else "1" for x in data]
    assert main(["ablate", *other_part, *one, "--out", str(tmp_path / "abl-part")]) == 0
    assert "0 run(s) taken" in capsys.readouterr().err
    assert main(["ablate", "--dataset", "digits", "--reuse", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no bench.json there" in capsys.readouterr().err
