"""Helpers for the real-fleet tests: machines as folders, generated image folders, the federation's
own model (``fleetmodel.py``, copied beside each machine's config as a user would), and the
commands of docs/tutorials/across-machines.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILE = Path(__file__).with_name("fleetmodel.py")
CLASSES = ["cat", "dog", "owl"]


def write_images(folder: Path, counts: dict[str, int], size: int, mode: str = "RGB", seed: int = 0) -> Path:
    """PNG files ``folder/<class>/<i>.png``: each class a distinct mean colour plus noise (learnable)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = 1 if mode == "L" else 3
    for c, n in counts.items():
        (folder / c).mkdir(parents=True, exist_ok=True)
        base = 40 + 80 * CLASSES.index(c) if c in CLASSES else 128
        for i in range(n):
            px = np.clip(base + rng.normal(0, 25, (size, size, channels)), 0, 255).astype(np.uint8)
            Image.fromarray(px[..., 0] if mode == "L" else px, mode).save(folder / c / f"{i}.png")
    return folder


def federation_toml(machine: Path, creds: Path, *, rounds: int = 3, devices: int = 3, size: int = 8,
                    strategy: str = "flayer", extra_model: str = "", over_selection: float = 1.0,
                    channels: int = 3, classes: list[str] | None = None) -> Path:
    """The coordinator's federation.toml naming the model by entry point, fleetmodel.py beside it."""
    classes = classes or CLASSES
    machine.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL_FILE, machine / "fleetmodel.py")
    text = f"""[federation]
credentials = "{creds}"
state_dir = "state"
quorum = {devices}
min_devices = {devices}
over_selection = {over_selection}
deadline_s = 120.0
grace_s = 0.0

[run]
strategy = "{strategy}"
rounds = {rounds}
seed = 0

[model]
name = "fleetmodel:build"
args = {{ in_channels = {channels}, num_classes = {len(classes)}, size = {size}, width = 8 }}
classes = {json.dumps(classes)}
in_channels = {channels}
height = {size}
width = {size}
python_path = ["."]
{extra_model}
[train]
lr = 0.05
batch_size = 4
local_epochs = 1
"""
    path = machine / "federation.toml"
    path.write_text(text)
    return path


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def launch(argv: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    fh = open(log, "wb")  # noqa: SIM115 -- closed with the process
    return subprocess.Popen([sys.executable, "-m", "cli.main", *argv], cwd=cwd, env=env(), stdout=fh,
                            stderr=subprocess.STDOUT)


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Until every process exits, or one fails (the others are then left to the caller), or ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return
        time.sleep(0.2)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)
