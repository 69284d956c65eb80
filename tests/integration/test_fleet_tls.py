"""A real fleet, as docs/tutorials/across-machines.md runs it: Mosquitto with TLS, three devices each
started from its own startup kit in its own folder (standing in for its own machine) with its own
PNG image folder, the federation's own model (``fleetmodel.py``, not a built-in), 3 FLAYER rounds,
then every personal model exported to ONNX with parity."""

from __future__ import annotations

import json
import shutil
import stat
import tarfile
from pathlib import Path

import pytest
from fleetlib import CLASSES, MODEL_FILE, federation_toml, launch, stop_all, wait_all, write_images

from mqtt_broker import mosquitto_available
from protocol.metrics_schema import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]

# device -> (images per class, image size, resize): different class mixes, sizes and counts
DEVICES = {
    "dev-1": ({"cat": 12, "dog": 6}, 8, False),
    "dev-2": ({"dog": 10, "owl": 10}, 8, False),
    "dev-3": ({"cat": 5, "dog": 5, "owl": 8}, 12, True),  # larger images: this device sets resize = true
}


def broker(*args: str) -> None:
    from cli.main import main

    assert main(["broker", *args]) == 0


def test_three_devices_from_kits_over_tls_with_their_own_images_and_model(tmp_path: Path) -> None:
    from export.pipeline import ExportOptions, export_model
    from flayer.state import load_model
    from transport.kit import unpack_kit

    coord = tmp_path / "machine-a"
    state = coord / "broker"
    broker("start", "--state-dir", str(state), "--federation", "pets", "--tls", "--port", "0", "--tls-port", "0",
           "--mosquitto")
    procs = []
    try:
        machines = {}
        for i, (dev, (counts, size, resize)) in enumerate(DEVICES.items()):
            machine = tmp_path / f"machine-{dev}"
            machine.mkdir()
            broker("add-device", dev, "--state-dir", str(state), "--kit", str(machine / f"{dev}.tar.gz"),
                   "--allow-entry-point", "fleetmodel:build")
            kit = machine / f"{dev}.tar.gz"
            assert stat.S_IMODE(kit.stat().st_mode) == 0o600
            with tarfile.open(kit) as tar:
                names = sorted(tar.getnames())
                assert names == ["START", "authority.pub", "credentials.toml", "device.cert", "device.toml",
                                 "tls/ca.crt", "tls/client.crt", "tls/client.key"]
                creds = tar.extractfile("credentials.toml").read().decode()  # type: ignore[union-attr]
                assert str(state) not in creds and 'ca_file = "tls/ca.crt"' in creds
            shutil.copy(MODEL_FILE, machine / "fleetmodel.py")  # the federation's model, beside the kit
            write_images(machine / "my-images", counts, size, seed=i)
            if resize:  # unpack, complete device.toml, then start from the kit as the others do
                toml = unpack_kit(kit, allowed_entry_points=["fleetmodel:build"])
                toml.write_text(toml.read_text().replace("resize = false", "resize = true"))
            machines[dev] = machine
        fed = federation_toml(coord, state / "credentials/coordinator.toml")
        procs.append(launch(["coordinator", "--config", str(fed)], coord, tmp_path / "coordinator.log"))
        for dev, machine in machines.items():
            procs.append(launch(["edge", "--kit", f"{dev}.tar.gz", "--data", "./my-images",
                                 "--allow-entry-point", "fleetmodel:build"], machine,
                                tmp_path / f"{dev}.log"))
        wait_all(procs, 240)
        logs = {p: p.read_text()[-2500:] for p in tmp_path.glob("*.log")}
        assert all(p.returncode == 0 for p in procs), logs
        assert "TLS" in (tmp_path / "dev-1.log").read_text()
        rounds = [r for r in read_metrics(coord / "state/metrics.jsonl") if r["kind"] == "round"]
        assert [r["round"] for r in rounds] == [1, 2, 3]
        assert all(r["accepted"] == 3 and not r["rejected"] for r in rounds), rounds
        for dev, machine in machines.items():
            personal = machine / dev / "state/personal.safetensors"
            model, spec, meta = load_model(personal)
            assert spec.name == "fleetmodel:build" and json.loads(spec.classes) == CLASSES and meta["client"] == dev
            report = export_model(model, spec, machine / "exported", dev, ExportOptions(formats=("onnx",), repeats=1))
            assert (machine / "exported" / f"{dev}.onnx").is_file()
            assert [r.format for r in report.results] == ["onnx"] and report.results[0].ok, report.results
    finally:
        stop_all(procs)
        broker("stop", "--state-dir", str(state))
