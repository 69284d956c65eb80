"""The command line: config files, flag overrides, validation, and a small real simulation."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from flayer.config import ConfigError, load_run_config
from protocol.metrics_schema import read_metrics


def test_config_file_and_flag_override(tmp_path):
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('[run]\nstrategy = "fedavg"\nrounds = 7\n[data]\ndataset = "digits"\nclients = 4\n'
                        '[train]\nlr = 0.1\n[strategy.fedavg]\n')
    cfg = load_run_config(cfg_file, {"run": {"rounds": 2}, "train": {"lr": None}})
    assert cfg.rounds == 2 and cfg.train.lr == 0.1 and cfg.data.clients == 4 and cfg.strategy == "fedavg"


def test_without_a_learning_rate_each_method_gets_its_tuned_default(tmp_path):
    from flayer.config import DEFAULT_LRS, STRATEGY_NAMES

    assert set(DEFAULT_LRS) == set(STRATEGY_NAMES)
    tuned = json.loads((Path(__file__).parents[2] / "docs/results/tune-fmnist/tuned.json").read_text())
    assert {m: c["lr"] for m, c in tuned["stable_choice"].items()} == DEFAULT_LRS  # the tuning's stable choices
    assert load_run_config(None, {"run": {"strategy": "flayer-ref"}}).train.lr == DEFAULT_LRS["flayer-ref"]
    assert load_run_config(None).train.lr == DEFAULT_LRS["flayer"]
    f = tmp_path / "run.toml"
    f.write_text('[run]\nstrategy = "fedavg"\n[train]\nlr = 0.03\n')
    assert load_run_config(f).train.lr == 0.03  # a rate in the file wins
    assert load_run_config(f, {"train": {"lr": 0.07}}).train.lr == 0.07  # and the flag over it


@pytest.mark.parametrize("text,match", [
    ('[train]\nlrr = 1\n', "unknown key"),
    ('[train]\nlr = "fast"\n', "expected a number"),
    ('[data]\nclients = 0\n', "clients must be >= 1"),
    ('[nope]\n', "unknown table"),
    ('[run]\nstrategy = "sgd"\n', "not one of"),
    ('[strategy.bogus]\nx = 1\n', "names no strategy"),
    ('[run\n', "not valid TOML"),
])
def test_config_errors_name_the_problem(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match) as exc:
        load_run_config(f)
    assert "bad.toml" in str(exc.value)


def test_cli_reports_user_errors_in_one_line(tmp_path, capsys):
    f = tmp_path / "bad.toml"
    f.write_text('[train]\nlr = -1\n')
    assert main(["simulate", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "lr must be > 0" in err and err.count("\n") == 1
    assert main(["simulate", "--dataset", "mnist", "--data-dir", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["simulate", "--dataset", "digits", "--set", "noequals"]) == 2
    assert "STRATEGY.KEY=VALUE" in capsys.readouterr().err


def test_partition_show_and_save(tmp_path, capsys):
    out = tmp_path / "p.npz"
    assert main(["partition", "--show", "--save", str(out), "--dataset", "digits", "--clients", "5",
                 "--partition", "pat2", "--seed", "3"]) == 0
    text = capsys.readouterr().out
    assert "partition pat2 of digits, seed 3, 5 clients" in text and out.is_file()


# ~20 s loaded; the default run keeps `flayer simulate` in process (tests/flayer/test_simulator.py,
# tests/cli/test_simulate_thin.py: its metrics by the schema), `--save-models` (tests/export/test_export_cli.py)
# and `python -m cli.main` as a process (the broker CLI, the federation's coordinator and devices)
@pytest.mark.slow
def test_simulate_fedavg_end_to_end(tmp_path):
    out = tmp_path / "sim"
    proc = subprocess.run([sys.executable, "-m", "cli.main", "simulate", "--strategy", "fedavg", "--dataset",
                           "digits", "--clients", "4", "--rounds", "3", "--partition", "iid", "--lr", "0.05",
                           "--out", str(out), "--save-models"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "round" in proc.stdout and "final-round acc" in proc.stdout
    lines = read_metrics(out / "metrics.jsonl")  # validated against the metrics schema
    assert [x["kind"] for x in lines] == ["run", "round", "round", "round", "end"]
    assert [x["round"] for x in lines[1:4]] == [1, 2, 3] and lines[4]["final_personal_acc"] > 0
    summary = json.loads((out / "summary.json").read_text())
    # iid digits with lr 0.05 learns within 3 rounds, far above the 10% chance level
    assert summary["best_acc"] > 0.5
    assert (out / "models" / "global.safetensors").is_file()
    assert len(list((out / "models").glob("client_*.safetensors"))) == 4


@pytest.mark.parametrize("argv", [
    ["models", "serve", "--port", "70000"], ["dashboard", "--port", "99999"],
    ["coordinator", "--metrics-port", "65536"], ["emulate", "--metrics-port", "x"],
])
def test_every_port_flag_is_checked_by_one_rule(argv, capsys):  # the broker's: BrokerConfig, in one line
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "port" in err and ("[0, 65535]" in err or "expected a port number" in err), err
