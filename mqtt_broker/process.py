"""Run a broker as a child process, record it, and stop exactly that process.

``run.json`` in the state folder records the PID, the exact command line, the process start time
(from /proc) and the ports. Stopping or reloading goes through :func:`recorded_process`, which
signals the PID only while /proc still shows that command line and start time: a PID reused by
another program, or another user's broker, is never signalled.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the annotations are never evaluated
    from typing_extensions import Self

from mqtt_broker.config import BrokerConfig, ensure_open_files, is_loopback
from mqtt_broker.fsutil import atomic_write, find_executable, listens, port_in_use
from mqtt_broker.state import BrokerFiles

__all__ = [
    "BrokerError",
    "BrokerProcess",
    "EmbeddedBroker",
    "ManagedBroker",
    "RunRecord",
    "mosquitto_available",
    "recorded_process",
    "reload_recorded",
    "stop_recorded",
]

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    """The broker could not be started, found or stopped."""


@dataclass(frozen=True)
class RunRecord:
    pid: int
    kind: str
    argv: list[str]
    start_ticks: int
    host: str
    port: int
    tls_port: int
    started_at: float

    @classmethod
    def load(cls, path: Path) -> RunRecord | None:
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:
            raise BrokerError(f"{path}: unreadable run record ({exc}); remove it if no broker runs") from exc


_HAVE_PROC = Path("/proc/self/stat").exists()


def _ps(pid: int, column: str) -> str | None:
    """One ``ps`` column for ``pid`` (systems without /proc, e.g. macOS); None when it is gone."""
    proc = subprocess.run(["ps", "-p", str(pid), "-o", f"{column}=", "-o", "stat="], capture_output=True, text=True,
                          check=False, timeout=10)
    out = proc.stdout.strip()
    if proc.returncode != 0 or not out or out.split()[-1].startswith("Z"):
        return None
    return out.rsplit(None, 1)[0]


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (0 without /proc), or None when it is gone
    or a zombie."""
    if not _HAVE_PROC:
        return 0 if _ps(pid, "pid") is not None else None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _proc_argv(pid: int) -> list[str] | None:
    if not _HAVE_PROC:
        command = _ps(pid, "command")
        return command.split() if command is not None else None  # our arguments hold no white space
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.rstrip(b"\0").decode(errors="replace").split("\0")


def _is_ours(rec: RunRecord) -> bool:
    """Same PID, same start time (Linux) and same command line as when we started it."""
    return _proc_start_ticks(rec.pid) == rec.start_ticks and _proc_argv(rec.pid) == rec.argv


def recorded_process(state_dir: str | Path) -> RunRecord | None:
    """The broker recorded in ``state_dir`` if it is still that very process; a stale record is removed."""
    files = BrokerFiles.at(state_dir)
    rec = RunRecord.load(files.run_record)
    if rec is None:
        return None
    if _is_ours(rec):
        return rec
    log.info("removing stale run record (pid %d is gone or another program)", rec.pid)
    files.run_record.unlink(missing_ok=True)
    return None


def _wait_gone(rec: RunRecord, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _is_ours(rec):
            return True
        time.sleep(0.02)
    return not _is_ours(rec)


def stop_recorded(state_dir: str | Path, timeout: float = 10.0) -> RunRecord | None:
    """Stop the recorded broker (SIGTERM, then SIGKILL after ``timeout``); None if none was running."""
    files = BrokerFiles.at(state_dir)
    rec = recorded_process(files.state_dir)
    if rec is None:
        return None
    os.kill(rec.pid, signal.SIGTERM)
    if not _wait_gone(rec, timeout):
        log.warning("broker pid %d ignored SIGTERM for %.0f s; killing it", rec.pid, timeout)
        os.kill(rec.pid, signal.SIGKILL)
        if not _wait_gone(rec, 5.0):
            raise BrokerError(f"broker pid {rec.pid} did not exit after SIGKILL")
    files.run_record.unlink(missing_ok=True)
    return rec


def reload_recorded(state_dir: str | Path) -> RunRecord | None:
    """Make the recorded broker re-read its password and ACL files (SIGHUP); None if none runs."""
    rec = recorded_process(state_dir)
    if rec is not None:
        os.kill(rec.pid, signal.SIGHUP)
    return rec


def mosquitto_available() -> bool:
    return find_executable("mosquitto") is not None


def _log_tail(path: Path, start: int, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            return fh.read().decode(errors="replace")[-limit:].strip()
    except OSError:
        return ""


class ManagedBroker:
    """A broker child process serving one state folder; use as a context manager or start()/stop().

    The child runs in its own session (Ctrl-C in a terminal does not reach it); with
    ``detach=True`` it outlives this Python process and is stopped later by :func:`stop_recorded`."""

    kind = "?"

    def __init__(self, state_dir: str | Path, detach: bool = False) -> None:
        self.files = BrokerFiles.at(state_dir)
        self.config = BrokerConfig.load(self.files.config)
        self.detach = detach
        self._proc: subprocess.Popen[bytes] | None = None
        self.record: RunRecord | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def check_limits(self, cfg: BrokerConfig) -> None:
        """What the broker needs of this process before it starts (nothing here)."""

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    @property
    def pid(self) -> int:
        if self.record is None:
            raise BrokerError("broker not started")
        return self.record.pid

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def tls_port(self) -> int:
        return self.config.tls_port

    def start(self, timeout: float = 15.0) -> Self:
        existing = recorded_process(self.files.state_dir)
        if existing is not None:
            raise BrokerError(f"a {existing.kind} broker already runs for {self.files.state_dir} "
                              f"(pid {existing.pid}, port {existing.port}); stop it first")
        cfg = self.config
        if cfg.warning:
            log.warning("%s", cfg.warning)
        for host, port in cfg.bound_ports:
            if port_in_use(host, port):
                raise BrokerError(f"port {port} on {host} is already in use; choose another port (or 0 for a free one)")
        self.check_limits(cfg)
        argv = self.argv()
        log_start = self.files.log.stat().st_size if self.files.log.exists() else 0
        with open(self.files.log, "ab") as logfh:
            os.fchmod(logfh.fileno(), 0o600)
            logfh.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {self.kind} broker\n".encode())
            logfh.flush()
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logfh, stderr=subprocess.STDOUT,
                                          cwd=self.files.state_dir, env=self.env(), start_new_session=True)
        try:
            self._wait_ready(cfg, timeout, log_start)
        except BaseException:
            self._terminate(2.0)
            raise
        ticks = _proc_start_ticks(self._proc.pid)
        self.record = RunRecord(self._proc.pid, self.kind, argv, ticks or 0, cfg.host, cfg.port, cfg.tls_port, time.time())
        atomic_write(self.files.run_record, json.dumps(asdict(self.record), indent=2) + "\n", mode=0o600)
        log.info("%s broker pid %d serving %s on %s:%d", self.kind, self._proc.pid, cfg.federation, cfg.host, cfg.port)
        return self

    def _wait_ready(self, cfg: BrokerConfig, timeout: float, log_start: int) -> None:
        """Until the started process itself listens on the plain port and the TLS port (if any). A port found
        free when the files were written can be taken by another server before the child binds it; a
        connection test alone would then greet that server (and its users), so where /proc tells who
        listens the child must hold the socket. Elsewhere: the plain listener accepts a TCP connection and
        the TLS port is bound (probed by binding, so no half-open TLS handshake lands in the broker's log)."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        pid = self._proc.pid
        while True:
            if self._proc.poll() is not None:
                raise BrokerError(f"{self.kind} exited with code {self._proc.returncode} while starting; its log "
                                  f"({self.files.log}):\n{_log_tail(self.files.log, log_start)}")
            plain_ready = not cfg.plain or listens(pid, cfg.connect_host, cfg.port, connect=True)
            if plain_ready and (not cfg.tls or listens(pid, cfg.tls_bind_host, cfg.tls_port, connect=False)):
                return
            if time.monotonic() > deadline:
                raise BrokerError(f"{self.kind} did not accept connections on {cfg.connect_host}:{cfg.port} within "
                                  f"{timeout:.0f} s; its log ({self.files.log}):\n{_log_tail(self.files.log, log_start)}")
            time.sleep(0.03)

    def is_running(self) -> bool:
        return self.record is not None and _is_ours(self.record)

    def reload(self) -> None:
        """Re-read the password and ACL files (after :func:`add_device`)."""
        if not self.is_running():
            raise BrokerError("broker not running")
        assert self.record is not None
        os.kill(self.record.pid, signal.SIGHUP)

    def _terminate(self, timeout: float) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("broker pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, timeout)
            proc.kill()
            proc.wait(5.0)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop exactly the started process (SIGTERM, then SIGKILL after ``timeout``)."""
        if self._proc is not None:
            self._terminate(timeout)
            rec = RunRecord.load(self.files.run_record)
            if rec is not None and self.record is not None and rec.pid == self.record.pid:
                self.files.run_record.unlink(missing_ok=True)
            self._proc = None
        elif self.record is not None:
            stop_recorded(self.files.state_dir, timeout)

    def __enter__(self) -> Self:
        return self.start() if self.record is None else self

    def __exit__(self, *exc: object) -> None:
        if not self.detach:
            self.stop()


class BrokerProcess(ManagedBroker):
    """Mosquitto with the generated ``mosquitto.conf``."""

    kind = "mosquitto"

    def __init__(self, state_dir: str | Path, detach: bool = False, mosquitto: str | None = None) -> None:
        super().__init__(state_dir, detach)
        self.executable = mosquitto or find_executable("mosquitto")
        if self.executable is None:
            raise BrokerError("mosquitto is not installed (Debian: apt-get install mosquitto); "
                              "use the embedded broker instead")

    def argv(self) -> list[str]:
        return [str(self.executable), "-c", str(self.files.mosquitto_conf)]

    def check_limits(self, cfg: BrokerConfig) -> None:
        ensure_open_files(cfg)  # every listener full still leaves Mosquitto descriptors of its own


class EmbeddedBroker(ManagedBroker):
    """amqtt in a child Python process (loopback only); see :mod:`mqtt_broker.embedded`."""

    kind = "embedded"

    def __init__(self, state_dir: str | Path, detach: bool = False) -> None:
        super().__init__(state_dir, detach)
        if self.config.tls:
            raise BrokerError("the embedded broker has no TLS listener; use mosquitto for TLS")
        if not is_loopback(self.config.host):
            raise BrokerError(f"the embedded broker listens on loopback only, not on {self.config.host!r}")
        try:
            import amqtt  # noqa: F401
        except ImportError as exc:
            raise BrokerError("the embedded broker needs amqtt (pip install 'flayer-edge[broker]')") from exc

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "mqtt_broker.embedded", "--state-dir", str(self.files.state_dir)]

    def env(self) -> dict[str, str]:
        # the child imports this very copy of mqtt_broker/protocol, whatever the working directory
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        return env
