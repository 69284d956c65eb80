"""``--print-unit`` (cli.unit): the systemd units of the broker, the coordinator and a device, checked by the real
``systemd-analyze verify`` (Debian's systemd package; the test is skipped with the reason when it is absent)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from cli.unit import command_args, quote

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from fedtestlib import device_toml, federation_toml

needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed (Debian package systemd; make test "
                                          "installs it)")


def _unit(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _verify(tmp: Path, kind: str, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp / f"flayer-{kind}.service"
    path.write_text(text)
    return subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)


def _units(tmp: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    fed = federation_toml(tmp / "federation.toml", tmp / "creds/coordinator.toml", Path("/var/lib/flayer/coordinator"),
                          strategy="fedavg", rounds=3, dataset="digits")
    dev = device_toml(tmp / "device.toml", tmp / "creds/dev-1.toml", dataset="digits", partition_file=tmp / "p.npz",
                      client=0, state_dir=tmp / "dev state%1")
    return {
        "broker": _unit(capsys, ["broker", "start", "--state-dir", "/var/lib/flayer/broker", "--host", "0.0.0.0",
                                 "--tls", "--print-unit"]),
        "coordinator": _unit(capsys, ["-v", "coordinator", "--config", str(fed), "--metrics-port", "9464",
                                      "--print-unit", "--unit-user", "fl"]),
        "edge": _unit(capsys, ["edge", f"--config={dev}", "--print-unit"]),
    }


@needs_systemd
def test_the_three_units_pass_systemd_analyze_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for kind, text in _units(tmp_path, capsys).items():
        got = _verify(tmp_path, kind, text)
        assert got.returncode == 0 and f"flayer-{kind}.service" not in got.stdout + got.stderr, (kind, got, text)


@needs_systemd
def test_systemd_analyze_verify_refuses_a_broken_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The check can fail: a relative ExecStart is a fatal error of the unit."""
    text = _units(tmp_path, capsys)["edge"]
    broken = "\n".join("ExecStart=flayer/bin edge" if line.startswith("ExecStart=") else line
                       for line in text.splitlines())
    got = _verify(tmp_path, "edge", broken)
    assert got.returncode != 0 and "flayer/bin" in got.stdout + got.stderr, got


def test_units_restart_on_failure_as_a_dedicated_user_into_the_journal(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    units = _units(tmp_path, capsys)
    for kind, text in units.items():
        lines = set(text.splitlines())
        assert {"Restart=on-failure", "RestartPreventExitStatus=2", "SuccessExitStatus=130 143", "KillMode=mixed",
                "KillSignal=SIGTERM", "StandardOutput=journal", "StandardError=journal",
                f"SyslogIdentifier=flayer-{kind}", "WantedBy=multi-user.target",
                "Environment=PYTHONUNBUFFERED=1"} <= lines, kind
        exec_start = next(x for x in lines if x.startswith("ExecStart="))
        assert exec_start.split("=", 1)[1].startswith("/") and "--print-unit" not in exec_start, exec_start
    assert "User=flayer" in units["broker"] and "User=fl" in units["coordinator"].splitlines()
    # the broker runs in the foreground under systemd; its state folder is systemd's to create
    assert units["broker"].splitlines().count("StateDirectory=flayer/broker") == 1
    assert " --foreground" in units["broker"] and "--host 0.0.0.0 --tls" in units["broker"]
    # every listener full (2 x 5,000 with TLS) plus the broker's own 64 and the wrapper's 1,024 descriptors
    assert "LimitNOFILE=11088" in units["broker"].splitlines() and "LimitNOFILE" not in units["edge"]
    assert "StateDirectory=flayer/coordinator" in units["coordinator"]
    assert f"--config {tmp_path / 'federation.toml'} --metrics-port 9464" in units["coordinator"]
    assert "After=network-online.target flayer-broker.service" in units["coordinator"]
    # a state folder outside /var/lib: named, with the command that creates it; % escaped for systemd
    assert f"# state folder {tmp_path / 'dev state%1'}: create it" in units["edge"]
    assert f"--config={tmp_path / 'device.toml'}" in units["edge"]


def test_paths_become_absolute_and_words_are_quoted_for_systemd(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    got = command_args(["edge", "--kit", "kits/my dev.tar.gz", "--unit-user", "x", "--print-unit", "--device",
                        "cpu", "--data=data"])
    assert got == ["edge", "--kit", str(tmp_path / "kits/my dev.tar.gz"), "--device", "cpu",
                   f"--data={tmp_path / 'data'}"]
    assert quote("/srv/a b/c%d$e") == '"/srv/a b/c%%d$$e"'
    assert quote('say "hi"\\') == '"say \\"hi\\"\\\\"'
    assert quote("plain") == "plain"


def test_a_bad_unit_user_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["broker", "start", "--state-dir", str(tmp_path / "b"), "--print-unit", "--unit-user", "a b"]) == 2
    assert "--unit-user must be a user name" in capsys.readouterr().err


def test_the_foreground_broker_copies_its_log_to_stderr_by_whole_lines(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Under systemd the broker's log reaches the journal through the wrapper's stderr."""
    from cli.broker import _LogFollower

    log = tmp_path / "broker.log"
    log.write_bytes(b"before the start\n")
    follow = _LogFollower(log)
    with open(log, "ab") as fh:
        fh.write(b"1: New connection\n2: half a li")
    follow.copy()
    assert capsys.readouterr().err == "1: New connection\n"
    with open(log, "ab") as fh:
        fh.write(b"ne\n")
    follow.copy()
    assert capsys.readouterr().err == "2: half a line\n"
