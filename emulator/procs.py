"""Child processes of the launcher (coordinator, workers): started in their own session, so a
Ctrl-C in the terminal reaches only the launcher, and stopped by the launcher by PID -- exactly the
processes it started, never anything found by name.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Child", "python_env"]

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent


def python_env(threads: int = 1) -> dict[str, str]:
    """The environment of a child: this checkout importable, math libraries on ``threads`` threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    return env


class Child:
    """``python -m MODULE ARGS`` with stdout and stderr to ``log_file``."""

    def __init__(self, name: str, module: str, args: Sequence[str], log_file: Path, threads: int = 1) -> None:
        self.name = name
        self.log_file = log_file
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "ab") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL,
                                         stdout=fh,
                                         stderr=subprocess.STDOUT, env=python_env(threads), cwd=str(ROOT),
                                         start_new_session=True)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)  # our own child, not yet reaped: its PID is still ours

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing it", self.name, self.pid,
                            timeout)
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, limit: int = 2000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-limit:]
        except OSError:
            return ""
