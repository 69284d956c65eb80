"""Reading the coordinator host's read-only HTTP endpoints from elsewhere (docs/explanation/guarantees.md, "Local
users on the hosts" and "Bounds on a hostile device or peer"; docs/howto/watch-fleet.md).

Two adversaries:

- A web site the operator visits (DNS rebinding): its page makes its own name ``rebind.example`` resolve to
  127.0.0.1, so the operator's browser sends the page's requests to the dashboard and the Prometheus exporter open
  on loopback, with ``Host: rebind.example:PORT``, and the page reads the answers as its own. The guarantee: both
  answer 421 and no data to a Host that is not this machine's address or name; the same request with
  ``Host: 127.0.0.1:PORT`` (the operator's own) is served.
- Another local user of the coordinator host: it lists the processes (``ps``, ``/proc/PID/cmdline``, readable by
  every user) while ``flayer dashboard`` runs with a token bound beyond loopback. The guarantee: the token is not on
  the command line (it comes from ``--token-file``), and that user cannot read the process's environment either.
"""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from cli.dashboard import start_dashboard
from coordinator.exporter import MetricsServer

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


def _get(port: int, path: str, host_header: str, token: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host_header)
        if token:
            conn.putheader("Authorization", f"Bearer {token}")
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_rebound_page_reads_neither_the_dashboard_nor_the_exporter(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    dash: Any = start_dashboard(None, metrics, "127.0.0.1", 0)
    registry = CollectorRegistry()
    Counter("flayer_secret_rounds", "a figure of the federation", registry=registry).inc(7)
    exporter = MetricsServer(registry, "127.0.0.1", 0)
    exporter.serve_in_thread()
    try:
        dport, eport = int(dash.server_address[1]), int(exporter.server_address[1])
        for port, path, needle in ((dport, "/api/snapshot", b'"devices"'), (eport, "/metrics", b"flayer_secret_rounds")):
            status, body = _get(port, path, f"rebind.example:{port}")
            assert status == 421 and needle not in body, f"port {port} {path}: {status} {body[:200]!r}"
            status, body = _get(port, path, f"127.0.0.1:{port}")  # the operator's own request
            assert status == 200 and needle in body, f"port {port} {path}: {status} {body[:200]!r}"
    finally:
        dash.close()
        dash.watch.stop()
        exporter.close()


def _cmdline_and_environ_as_nobody(pid: int) -> tuple[bytes, bool]:
    """What another local user reads of process ``pid``: its command line, and whether its environment."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    fh.read()
                env = b"1"
            except OSError:
                env = b"0"
            os.write(w, env + cmd)
        finally:
            os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    os.waitpid(child, 0)
    return out[1:], out[:1] == b"1"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
def test_another_local_user_does_not_read_the_dashboard_token(tmp_path: Path) -> None:
    token = "the-dashboard-token-" + os.urandom(8).hex()
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    os.chmod(token_file, 0o600)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "cli.main", "dashboard", "--metrics", str(metrics),
                             "--host", "0.0.0.0", "--port", "0", "--token-file", str(token_file)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""  # "dashboard: http://0.0.0.0:PORT/?token=..."
        assert line.startswith("dashboard: http://"), line
        cmdline, environ_read = _cmdline_and_environ_as_nobody(proc.pid)
        assert b"dashboard" in cmdline, cmdline  # the adversary does read the command line
        assert token.encode() not in cmdline, "the token is on the dashboard's command line"
        assert not environ_read, "another user reads the dashboard's environment"
        port = int(re.search(r"http://[^/]*:(\d+)/", line).group(1))  # type: ignore[union-attr]
        time.sleep(0.2)
        assert _get(port, "/api/snapshot", f"127.0.0.1:{port}", token)[0] == 200  # the file's token opens it
        assert _get(port, "/api/snapshot", f"127.0.0.1:{port}", "x" * 24)[0] == 401
    finally:
        proc.terminate()
        proc.wait(10)
