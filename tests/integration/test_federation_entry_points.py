"""A device runs only the model code it agreed to, against real processes: ``flayer coordinator`` with the
federation's own model (an entry point, not a built-in) and two ``flayer edge`` devices on a real Mosquitto
that can both import it. The device that did not allow the entry point refuses the plan, names the entry
point and how to allow it, and never imports the module; the device that allowed it
(``--allow-entry-point``) trains, and the round closes with its update."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from mqtt_broker import mosquitto_available

# slow (-m slow; CI runs it): three processes that each import torch, about 25 s on an idle 2-core machine.
# The default run keeps the same gate in process (tests/edge_client/test_edge_units.py: the plan's entry
# point refused, its module never imported; an allowed one built) and an allowed entry point over a real
# Mosquitto (tests/integration/test_fleet_revoke.py: the fleet's own model).
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]

ENTRY = "gatemodel:build"
MODEL = '''"""The federation's own model; each process that imports it leaves a marker named by its PID."""
import os
from pathlib import Path

from torch import nn

Path(__file__).with_name(f"imported-{os.getpid()}").touch()


def build(in_channels=1, num_classes=10, size=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * size * size, 16), nn.ReLU(), nn.Linear(16, num_classes))
'''


def test_a_device_refuses_a_plan_naming_code_it_did_not_allow(tmp_path: Path, digits: Any) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
    from faultlib import launch, proc_federation, wait_until

    models = tmp_path / "models"
    models.mkdir()
    (models / "gatemodel.py").write_text(MODEL)
    fed = proc_federation(tmp_path, digits, ["dev-ok", "dev-no"], rounds=1,
                          fed={"quorum": 1, "min_devices": 2, "over_selection": 2.0, "deadline_s": 60.0})
    with fed.fed_toml.open("a") as fh:
        fh.write(f'[model]\nname = "{ENTRY}"\nargs = {{ size = 16 }}\nin_channels = 1\nheight = 16\nwidth = 16\n'
                 f'python_path = ["{models}"]\n')
    for toml in fed.dev_tomls.values():  # both devices could import the module: only the allow list differs
        toml.write_text(f'python_path = ["{models}"]\n' + toml.read_text())
    try:
        coord = fed.start_coordinator()
        ok = launch(tmp_path, "dev-ok.1", "-v", "edge", "--config", str(fed.dev_tomls["dev-ok"]),
                    "--allow-entry-point", ENTRY)
        no = launch(tmp_path, "dev-no.1", "-v", "edge", "--config", str(fed.dev_tomls["dev-no"]))
        fed.procs.update({"dev-ok": ok, "dev-no": no})
        wait_until(lambda: no.popen.poll() is not None, 120, "the refusing device to exit", fed.logs)
        assert no.popen.returncode == 2, no.text()
        text = no.text()
        assert f"'{ENTRY}'" in text and "does not allow" in text and "nothing was imported" in text, text
        assert "allow_entry_points" in text and f"--allow-entry-point {ENTRY}" in text, text
        fed.wait_all(180, [coord, ok])
        assert not (models / f"imported-{no.pid}").exists()
        assert (models / f"imported-{ok.pid}").exists() and (models / f"imported-{coord.pid}").exists()
        m = fed.metrics()
        assert [r["round"] for r in m] == [1] and m[0]["accepted"] == 1, fed.logs()
        assert "round 1: accepted" in ok.text(), ok.text()
    finally:
        fed.stop()
