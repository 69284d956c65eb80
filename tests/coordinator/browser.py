"""A real headless browser for the dashboard tests: Debian's ``chromium``, driven over the DevTools protocol
(a websocket, websocket-client), so one page stays open while the server pushes updates into it.

``make test`` installs chromium when it is missing; where it cannot be started the tests that need it skip.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


needs_chromium = pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed (make test installs it)")


class Browser:
    """One headless chromium (its own profile folder, stopped by PID) with one page."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 900) -> None:
        import websocket  # websocket-client, in the test extra

        exe = chromium_path()
        assert exe is not None
        self.stderr = profile / "chromium.log"
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "data" / "DevToolsActivePort").unlink(missing_ok=True)  # a previous chromium's port
        with open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
                 "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile / 'data'}",
                 f"--window-size={width},{height}", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            port = self._port(profile / "data")
            pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
            page = next(p for p in pages if p.get("type") == "page")
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30)
        except BaseException:
            self.close()
            raise
        self._id = 0
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _port(self, data: Path, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # chromium writes its port to DevToolsActivePort once it listens
            f = data / "DevToolsActivePort"
            if f.is_file() and f.read_text().strip():
                return int(f.read_text().split()[0])
            m = re.search(rb"DevTools listening on ws://[^:]+:(\d+)/", self.stderr.read_bytes())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise AssertionError(f"chromium exited ({self.proc.returncode}): {self.stderr.read_text()[-2000:]}")
            time.sleep(0.1)
        raise AssertionError(f"chromium did not open its DevTools port: {self.stderr.read_text()[-2000:]}")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        my = self._id
        self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def goto(self, url: str) -> int:
        """Navigate; returns the HTTP status of the document."""
        self.call("Network.enable")
        self._id += 1
        my = self._id
        self.ws.send(json.dumps({"id": my, "method": "Page.navigate", "params": {"url": url}}))
        status, loaded = 0, False
        deadline = time.monotonic() + 30
        while not loaded and time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            if msg.get("method") == "Network.responseReceived" and msg["params"].get("type") == "Document":
                status = int(msg["params"]["response"]["status"])
            elif msg.get("method") == "Page.loadEventFired":
                loaded = True
        self.call("Network.disable")
        return status

    def js(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise AssertionError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_js(self, expression: str, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} ({expression})")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: chromium's helpers go with it
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
