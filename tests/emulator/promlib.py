"""A real Prometheus for the tests (Debian's ``prometheus``): started on a free loopback port with a
configuration the test writes (the project's alert rules loaded), queried over its HTTP API, stopped by PID.

The Debian package enables a system ``prometheus.service`` on :9090 where systemd runs; nothing here uses
that one or its port (docs/howto/service.md)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "flayer-alerts.yml"


def prometheus_available() -> bool:
    return shutil.which("prometheus") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """``prometheus`` scraping ``targets`` every second (job ``flayer-coordinator``, as the rules expect)."""

    def __init__(self, tmp: Path, targets: list[str], interval: str = "1s") -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "prometheus.yml"
        cfg.write_text("\n".join([
            "global:", f"  scrape_interval: {interval}", f"  evaluation_interval: {interval}",
            "rule_files:", f"  - {RULES}",
            "scrape_configs:", "  - job_name: flayer-coordinator", f"    scrape_timeout: {interval}",
            "    static_configs:", f"      - targets: {json.dumps(targets)}", ""]))
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"prometheus did not become ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/-/ready", timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query: {labels without __name__, job and instance: value}."""
        out = {}
        for r in self.api("query", query=expr)["result"]:
            labels = tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("__name__", "job", "instance")))
            out[labels] = float(r["value"][1])
        return out

    def stop(self) -> None:
        """Stop exactly the started process (SIGTERM, then SIGKILL)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
