"""Code a device runs because of where its kit lies or what the kit says (docs/explanation/guarantees.md,
"Local users on the hosts"; docs/explanation/security.md, "It cannot run other code on a device").

Two adversaries, each against a real Mosquitto, a real coordinator and ``flayer edge --kit`` as its own process:

- Another local user of the device's host (uid ``nobody``). The owner keeps the kit the broker's operator made in a
  folder every user may write (a shared download folder, 1777 like ``/tmp``); the adversary drops a ``PIL.py``
  beside it. The guarantee: it is never imported (the device decodes its images with the real PIL, or refuses the
  folder before anything runs), so nothing runs as the device's user.
- Whoever hands the owner a kit from elsewhere: its ``device.toml`` names a python data source
  ``entry = "os:system"`` whose argument is a command. The guarantee: without the owner's ``--allow-kit-code`` the
  device refuses the kit at start, before anything is unpacked or imported, and the command never runs; with it,
  the owner chose to run that code (the positive control that the attack is real).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from attacklib import image_folder
from fedtestlib import ROOT, FedBroker

from coordinator.server import Coordinator
from mqtt_broker import mosquitto_available
from mqtt_broker.kit import write_kit

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
NOBODY = 65534


@pytest.fixture
def fed(attack_fed: Any) -> tuple[FedBroker, Coordinator]:
    """A real Mosquitto with dev-a and a coordinator of one round on digits, waiting for dev-a (both stopped
    after the test). The adversaries hold no broker account."""
    fb = attack_fed(["dev-a"], view="none")
    return fb, fb.coordinator_in()


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every local user may write (1777, as /tmp or a shared download folder is)."""
    folder = Path(tempfile.mkdtemp(prefix="flayer-shared-", dir="/tmp"))
    os.chmod(folder, 0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _edge(kit: Path, *flags: str, timeout: float, done: Any) -> tuple[int | None, str]:
    """``flayer edge --kit KIT FLAGS`` in the kit's folder until it exits or ``done()`` holds; (exit code, output).
    ``-P``: as the ``flayer`` script, Python itself puts no working folder on ``sys.path``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = kit.with_suffix(".log")
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "cli.main", "edge", "--kit", str(kit), *flags], cwd=kit.parent,
                                env=env, stdout=fh, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < end and not done():
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    return proc.returncode, log.read_text()


def test_a_pil_module_dropped_beside_a_kit_in_a_shared_folder_is_not_imported(
        tmp_path: Path, fed: tuple[FedBroker, Coordinator], shared: Path) -> None:
    fb, _ = fed
    kit = write_kit(fb.state_dir, "dev-a", shared / "dev-a.tar.gz")
    data = image_folder(tmp_path / "images", classes=10, per_class=3, side=16)
    marker = tmp_path / "pwned"
    # the adversary, another local user, plants its module beside the kit
    planted = shared / "PIL.py"
    planted.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nraise ImportError('x')\n")
    os.chown(planted, NOBODY, NOBODY)
    rc, out = _edge(kit, "--data", str(data), timeout=120, done=marker.exists)
    assert not marker.exists(), f"the device imported the PIL.py another user put beside its kit:\n{out[-2000:]}"
    refused = rc == 2 and "can be written by other users" in out
    trained = "trained rounds 1" in out
    assert refused or trained, f"the device neither refused the shared folder nor trained (exit {rc}):\n{out[-2000:]}"


def _rewrite(kit: Path, device_toml: str) -> None:
    """The kit's members with another device.toml (a kit from elsewhere)."""
    with tarfile.open(kit, "r:gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    members["device.toml"] = device_toml.encode()
    with tarfile.open(kit, "w:gz") as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(body), 0o600
            tar.addfile(info, io.BytesIO(body))


def test_a_kit_naming_code_is_refused_without_the_owners_consent(tmp_path: Path,
                                                                 fed: tuple[FedBroker, Coordinator]) -> None:
    fb, _ = fed
    (tmp_path / "device").mkdir()
    kit = write_kit(fb.state_dir, "dev-a", tmp_path / "device/dev-a.tar.gz")
    marker = tmp_path / "pwned"
    _rewrite(kit, f'credentials = "credentials.toml"\n[data]\nsource = "python"\nentry = "os:system"\n'
                  f'args = {{ command = "touch {marker}" }}\n[edge]\nstate_dir = "state"\ndevice = "cpu"\n'
                  f'heartbeat_s = 1.0\n')
    rc, out = _edge(kit, timeout=60, done=marker.exists)
    assert not marker.exists(), f"the kit's data entry ran a command on the device:\n{out[-2000:]}"
    assert rc == 2 and "names code this device would run: data entry 'os:system'" in out, (rc, out[-2000:])
    assert not (tmp_path / "device/dev-a").exists(), "the refused kit was unpacked"
    # the positive control: the owner allows the kit's code, and the entry really is called at the first plan
    rc, out = _edge(kit, "--allow-kit-code", timeout=120, done=marker.exists)
    assert marker.exists(), f"with --allow-kit-code the kit's entry did not run: the attack was not made:\n{out[-2000:]}"
