"""``flayer broker`` through the real command line, in subprocesses."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from broker_testlib import connect_probe, needs_mosquitto, try_connect

from mqtt_broker import stop_recorded
from transport.credentials import Credentials, mqtt_connect_settings

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def flayer(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "cli.main", "broker", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _pid(output: str) -> int:
    m = re.search(r"pid (\d+)", output)
    assert m, output
    return int(m.group(1))


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return True
        time.sleep(0.02)
    return False


def in_process(capsys, *args: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    """The same command line without a new interpreter (``flayer`` pays ~3 s importing torch)."""
    from cli.main import main

    rc = main(["broker", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_start_add_device_stop_in_subprocesses(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from mqtt_broker import mosquitto_available

    state = str(tmp_path / "state")
    kind = "--mosquitto" if mosquitto_available() else "--embedded"
    started = flayer("start", "--state-dir", state, "--port", "0", "--federation", "cli-fed", "--no-persistence", kind)
    pid = _pid(started.stdout)
    try:
        assert Path(f"/proc/{pid}").exists()
        added = flayer("add-device", "dev-1", "--state-dir", state)
        cred_path = tmp_path / "state" / "credentials" / "dev-1.toml"
        assert str(cred_path) in added.stdout and f"pid {pid}" in added.stdout  # reloaded that broker
        dev = Credentials.load(cred_path)
        assert dev.federation == "cli-fed" and dev.port > 0
        probe = connect_probe(dev)  # the new device is accepted by the running broker
        probe.close()
        rc, status, _ = in_process(capsys, "status", "--state-dir", state)
        assert rc == 0 and f"pid {pid}" in status and "dev-1" in status
        coord = Credentials.load(tmp_path / "state" / "credentials" / "coordinator.toml")
        outputs = started.stdout + started.stderr + added.stdout + added.stderr + status
        assert dev.password not in outputs and coord.password not in outputs
    finally:
        stopped = flayer("stop", "--state-dir", state)
    assert f"pid {pid}" in stopped.stdout
    assert _gone(pid), "flayer broker stop did not end the recorded process"
    assert in_process(capsys, "status", "--state-dir", state)[0] == 3
    assert try_connect(mqtt_connect_settings(dev), timeout=1)[0] is None


def test_embedded_start_add_device_stop(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    state = str(tmp_path / "state")
    rc, out, _ = in_process(capsys, "start", "--state-dir", state, "--port", "0", "--embedded")
    assert rc == 0 and "embedded broker running" in out and "NOT enforced" in out
    pid = _pid(out)
    try:
        rc, out, _ = in_process(capsys, "add-device", "dev-1", "--state-dir", state)
        assert rc == 0 and f"pid {pid}" in out
        probe = connect_probe(Credentials.load(tmp_path / "state" / "credentials" / "dev-1.toml"))
        probe.close()
        rc, _, err = in_process(capsys, "add-device", "dev-1", "--state-dir", state)
        assert rc == 2 and "already exists" in err
        assert in_process(capsys, "add-device", "dev-1", "--rotate", "--state-dir", state)[0] == 0
        rc, _, err = in_process(capsys, "start", "--state-dir", state, "--embedded")
        assert rc == 2 and "already runs" in err
    finally:
        rc, out, _ = in_process(capsys, "stop", "--state-dir", state)
    assert rc == 0 and f"pid {pid}" in out and _gone(pid)
    assert "no running broker" in in_process(capsys, "stop", "--state-dir", state)[1]


@needs_mosquitto
def test_foreground_start_stops_its_broker_on_ctrl_c(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "broker", "start", "--state-dir", state, "--port", "0",
                             "--no-persistence", "--foreground"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pid = _pid(line)
        assert "running" in line and Path(f"/proc/{pid}").exists()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "broker stopped" in out
        assert _gone(pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_recorded(state)  # whatever happened above, leave no broker behind


@pytest.mark.parametrize("args, message", [
    (["start", "--port", "70000"], "port"),
    (["start", "--host", "bad host!"], "host"),
    (["start", "--max-packet-size", "12"], "max_packet_size"),
    (["start", "--embedded", "--tls"], "TLS"),
    (["start", "--federation", "a/b"], "federation"),
    (["add-device", "dev-1"], "no broker set up here"),
    (["stop", "--timeout", "0"], "--timeout"),
])
def test_bad_flags_give_one_line_errors(tmp_path: Path, capsys, args: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    rc, _, err = in_process(capsys, *args, "--state-dir", str(tmp_path / "s"))
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s" / "run.json").exists()


def test_bad_device_ids_are_refused(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from mqtt_broker import BrokerConfig, write_broker_files

    write_broker_files(BrokerConfig(federation="f"), tmp_path)
    for bad in ("x/y", "a+b", "coordinator", "observer", "#", "x" * 65):
        rc, _, err = in_process(capsys, "add-device", bad, "--state-dir", str(tmp_path))
        assert rc == 2 and len(err.strip().splitlines()) == 1, (bad, err)
    assert sorted(p.name for p in (tmp_path / "credentials").iterdir()) == ["coordinator.toml", "flayer-admin.toml", "observer.toml"]
    assert os.stat(tmp_path / "passwd").st_mode & 0o777 == 0o600
