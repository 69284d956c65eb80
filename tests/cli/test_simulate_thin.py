"""``flayer simulate``'s thin-link options: lossless ones change nothing but the byte counts, lossy ones
fold what the codec decodes, and bytes down follow who holds which model."""

from __future__ import annotations

import json

import pytest
import torch

from cli.main import main
from coordinator.publish import model_blob
from emulator.thinsim import ThinOptions, link_hooks
from flayer.config import TrainConfig
from flayer.partition import make_partition
from flayer.simulation import initial_global_state, simulate
from flayer.strategies import make_strategy
from flayer.train import client_data
from protocol.metrics_schema import read_metrics


@pytest.fixture(scope="module")
def setup(digits):  # type: ignore[no-untyped-def]
    # 900 of the 1,797 images: the byte counts and the folds need rounds, not data
    part = make_partition(digits.y, digits.num_classes, 3, "dir0.5", 0, samples=900)
    clients = [client_data(digits, c) for c in part.clients]
    strategy = make_strategy("flayer", digits.model_spec(), TrainConfig(lr=0.05, batch_size=10, local_epochs=1), {})
    return strategy, clients


def test_lossless_links_leave_the_run_unchanged_and_count_deltas(setup) -> None:  # type: ignore[no-untyped-def]
    strategy, clients = setup
    plain = simulate(strategy, clients, 3, seed=0)
    g0 = initial_global_state(strategy, 0)
    thin = simulate(strategy, clients, 3, seed=0, global_state=g0,
                    links=link_hooks(ThinOptions(delta_downloads="exact", zstd=True), g0))
    for k, v in plain.global_state.items():
        assert torch.equal(v, thin.global_state[k]), k
    model = model_blob(g0).size
    downs = [r.download_bytes for r in thin.rounds]
    assert downs[0] == 3 * model  # nothing held: every client takes the whole model
    assert all(0 < d < 3 * model for d in downs[1:]), downs  # the deltas (FLAYER changes part of the model)
    assert all(0 < r.upload_bytes for r in thin.rounds)


def test_lossy_uploads_are_smaller_and_fold_what_was_decoded(setup) -> None:  # type: ignore[no-untyped-def]
    strategy, clients = setup
    g0 = initial_global_state(strategy, 0)
    runs = {}
    for name, opts in {"fp32": ThinOptions(), "int8": ThinOptions("int8"),
                       "int8-ef": ThinOptions("int8", keep=0.3, error_feedback=True, delta_downloads="int8")}.items():
        runs[name] = simulate(strategy, clients, 2, seed=0, global_state=g0, links=link_hooks(opts, g0))
    up = {k: sum(r.upload_bytes for r in v.rounds) for k, v in runs.items()}
    assert up["int8-ef"] < up["int8"] < 0.35 * up["fp32"], up
    diff = max(float((runs["int8"].global_state[k] - runs["fp32"].global_state[k]).abs().max())
               for k in g0)
    assert diff > 0  # the quantised values were folded, not the exact ones
    assert runs["int8-ef"].rounds[-1].acc > 0.3  # still learns


def test_simulate_flags_write_bytes_down_per_round(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    assert main(["simulate", "--dataset", "digits", "--clients", "3", "--rounds", "2", "--strategy", "fedavg",
                 "--value-codec", "fp16", "--delta-downloads", "fp16", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rounds = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "round"]
    assert summary["thin"]["value_codec"] == "fp16" and summary["download_bytes_total"] == sum(
        r["bytes_down"] for r in rounds)
    assert rounds[1]["bytes_down"] < rounds[0]["bytes_down"]  # round 2: deltas
    assert main(["simulate", "--dataset", "digits", "--keep", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--keep" in capsys.readouterr().err
