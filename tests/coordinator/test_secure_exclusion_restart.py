"""A device a secure round proved faulty stays left out after the coordinator restarts: the list is in the
checkpoint written with each round (a faulty device that waits for a restart is not selected again), and a
checkpoint's list is validated like the rest of the file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from coordinator.config import load_coordinator_config

sys.path.insert(0, str(Path(__file__).parent))
from test_async_restart_slots import DEVICES, _Offline  # noqa: E402


def _config(tmp: Path) -> Any:
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 1", "quorum = 1",
             "deadline_s = 60.0", "[run]", 'strategy = "fedavg"', "rounds = 6", "seed = 0", "[data]",
             'dataset = "digits"']
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    return load_coordinator_config(tmp / "federation.toml")


def _run_rounds(o: _Offline, rounds: int) -> None:
    start = o.coord.done_round
    for _ in range(40):
        o.online(*DEVICES)  # every device keeps reporting (the faulty one too)
        o.tick(30.0)
        if o.coord.done_round >= start + rounds:
            return
    raise AssertionError("the rounds did not close")


def test_a_faulty_device_stays_out_after_a_restart(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    first = _Offline(cfg)
    first.coord.secure_phase.excluded["dev-a"] = "sealed a share to dev-b that does not open"  # a round named it
    first.online(*DEVICES)
    _run_rounds(first, 1)
    first.close()

    again = _Offline(cfg)  # restarted from the same state folder
    assert again.coord.done_round == 1
    again.online(*DEVICES)  # the faulty device comes back online with the others
    assert "dev-a" not in again.coord.online(again.now)
    _run_rounds(again, 3)
    selected = {d for p in again.plans for d in p.selected}
    assert selected and "dev-a" not in selected, selected
    again.close()


def test_the_checkpoint_list_round_trips_and_bad_ones_are_refused(tmp_path: Path) -> None:
    state = {"w": torch.zeros(2)}
    save_checkpoint(tmp_path, Checkpoint(2, state, "ab" * 32, {"x": 1}, excluded={"dev-a": "proof"}))
    ck = load_checkpoint(tmp_path, {"x": 1})
    assert ck is not None and ck.excluded == {"dev-a": "proof"}
    save_checkpoint(tmp_path, Checkpoint(2, state, "ab" * 32, {"x": 1}))  # none named: an empty list
    ck = load_checkpoint(tmp_path, {"x": 1})
    assert ck is not None and ck.excluded == {}
    for bad in ({"": "proof"}, {"dev-a": 3}, {"d" * 300: "p"}, {"dev-a": "p" * 5000}):
        save_checkpoint(tmp_path, Checkpoint(2, state, "ab" * 32, {"x": 1}, excluded=bad))  # type: ignore[arg-type]
        with pytest.raises(CheckpointError, match="excluded"):
            load_checkpoint(tmp_path, {"x": 1})
