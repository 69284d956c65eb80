"""Another local user reads the state the CLI's folders hold (docs/explanation/guarantees.md, "Local users on the
hosts"; docs/explanation/security.md, "Local users").

The operator follows the tutorial under the usual umask 022, in a project folder other users may enter (a home
folder is 0755 on Debian): a real Mosquitto set up by the broker's own code, the coordinator and an edge device
over it, one round of a federation with central DP. The adversary is another local user of the same host (uid
``nobody``): it holds no credentials and only tries to read what the file modes let it read. The guarantee: it
reads none of the coordinator's state (the journal holds each device's clipped update before any noise, the
checkpoint the model), none of the device's (its pending upload, client state and personal model) and none of
the broker's (passwords, keys). As root the test forks a process that drops to ``nobody`` and really tries; as
another user it reads the file modes as ``nobody`` would meet them.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import device_toml, federation_toml, finished

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.partition import make_partition, save_partition
from flayer.train import client_data
from mqtt_broker import mosquitto_available

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
NOBODY = 65534


@pytest.fixture
def project() -> Iterator[Path]:
    """A project folder other users may enter (0755), as a home folder is, under umask 022."""
    old = os.umask(0o022)
    folder = Path(tempfile.mkdtemp(prefix="flayer-local-user-", dir="/tmp"))
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        os.umask(old)
        shutil.rmtree(folder, ignore_errors=True)


def _readable_as_nobody(paths: list[Path]) -> list[str]:
    """The paths another user (``nobody``) opens for reading: really tried as root, else from the modes."""
    if os.geteuid() == 0:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the adversary: another local user
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                got = []
                for p in paths:
                    try:
                        if p.is_dir():
                            os.listdir(p)
                        else:
                            with open(p, "rb") as fh:
                                fh.read(1)
                        got.append(str(p))
                    except OSError:
                        pass
                os.write(w, "\n".join(got).encode())
            finally:
                os._exit(0)
        os.close(w)
        out = b""
        while chunk := os.read(r, 65536):
            out += chunk
        os.close(r)
        os.waitpid(pid, 0)
        return [line for line in out.decode().splitlines() if line]

    def others_may(p: Path, bit: int) -> bool:
        return bool(p.stat().st_mode & bit)

    got = []
    for p in paths:
        folders = [q for q in p.parents if q != Path("/")]
        reach = all(others_may(q, stat.S_IXOTH) for q in folders)
        if reach and others_may(p, stat.S_IROTH):
            got.append(str(p))
    return got


def test_another_local_user_reads_no_state_of_the_tutorials_folders(project: Path, digits: Any,
                                                                   attack_fed: Any) -> None:
    fb = attack_fed(["dev-a"], view="none", at=project / ".flayer")  # another local user: no broker account
    coord_dir, dev_dir = project / "runs/federation", project / "runs/dev-a"
    fed = federation_toml(project / "federation.toml", fb.state_dir / "credentials/coordinator.toml", coord_dir,
                          strategy="fedavg", rounds=1, dataset="digits")
    with open(fed, "a") as fh:  # central DP: the journal holds the clipped updates before any noise
        fh.write("[privacy]\nenabled = true\nmode = \"central\"\nclip = 1.0\nnoise_multiplier = 1.0\n"
                 "population = 10\ndelta = 0.01\n")
    part = make_partition(digits.y, 10, 1, "iid", seed=0, samples=120)
    np_file = save_partition(part, project / "runs/part.npz")
    dev = device_toml(project / "dev-a.toml", fb.state_dir / "credentials/dev-a.toml", dataset="digits",
                      partition_file=np_file, client=0, state_dir=dev_dir)
    coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
    client = EdgeClient(load_device_config(dev).edge, fb.devices["dev-a"], client_data(digits, part.clients[0]))
    try:
        thread = coord.start()
        client.start()
        finished(coord, thread, 120, rounds=1)
        assert client.wait(60) and client.error is None
    finally:
        client.stop()
        fb.broker.stop()  # before the state is read (the harness's stop after the test is then a no-op)
    secrets = [coord_dir / "journal/round-000001.jnl", coord_dir / "checkpoint.safetensors",
               coord_dir / "metrics.jsonl", dev_dir / "upload.bin", dev_dir / "client_state.safetensors",
               dev_dir / "personal.safetensors", fb.state_dir / "passwd", fb.state_dir / "credentials/dev-a.toml"]
    missing = [str(p) for p in secrets if not p.is_file()]
    assert not missing, f"the federation did not write what the test reads: {missing}"
    every = sorted({p for root in (coord_dir, dev_dir, fb.state_dir) for p in [root, *root.rglob("*")]})
    read = _readable_as_nobody(every)
    assert _readable_as_nobody([project]) == [str(project)], "the adversary could not even enter the project folder"
    assert read == [], f"another local user reads {len(read)} state paths, e.g. {read[:6]}"
