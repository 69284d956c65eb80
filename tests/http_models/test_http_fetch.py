"""Models over HTTP, the device's fetch against a real nginx: a cut at two thirds resumes with a range
request for the rest only, a partial file left by a reboot is completed, a body larger than the
plan's size and a file whose sha256 is not the plan's are refused, and a device whose HTTP fetch fails
(a corrupted file, a missing one) takes the broker's chunks instead, saying why."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
from cutproxy import CutProxy
from fetchlib import COORD_KEY, FetchDevice

from edge_client.fetch import HttpDone
from edge_client.http_fetch import HttpFetchError, HttpTarget, fetch_blob, part_path
from protocol import Kind, Plan, Topics, blob_digest, chunk_blob

SIZE = 300_000


def _blob(seed: int = 0, size: int = SIZE) -> bytes:
    return hashlib.shake_256(f"model-{seed}".encode()).digest(size)


def _log(server: Any) -> list[tuple[int, int, str]]:
    """(status, body bytes sent, Range header) of each request nginx logged."""
    lines = server.access_log.read_text().splitlines() if server.access_log.exists() else []
    out = []
    for line in lines:
        m = re.search(r'" (\d{3}) (\d+) (\d+) "([^"]*)"$', line)
        assert m, line
        out.append((int(m.group(1)), int(m.group(3)), m.group(4)))
    return out


def _flush(server: Any) -> None:
    """nginx writes a request's log line once the response is done; wait until the lines are there."""
    import time

    end = time.monotonic() + 5
    while time.monotonic() < end and not server.access_log.read_text().strip():
        time.sleep(0.05)
    time.sleep(0.2)


def test_a_download_cut_at_two_thirds_resumes_and_fetches_only_the_rest(tmp_path: Path, nginx: Any) -> None:
    blob = _blob()
    digest = blob_digest(blob)
    (nginx.root / digest).write_bytes(blob)
    proxy = CutProxy(nginx.port, cut_after=2 * SIZE // 3)  # the response header and almost 2/3 of the body
    try:
        target = HttpTarget(f"http://127.0.0.1:{proxy.port}/", digest, SIZE)
        got, stats = fetch_blob(target, tmp_path / "dev", timeout_s=10)
        assert got == blob and proxy.cut.is_set()
        assert stats["attempts"] == 2 and stats["http_bytes"] == SIZE  # every byte came once
        assert len(proxy.conns) == 2
        held = int(bytes(proxy.conns[1].request).split(b"Range: bytes=")[1].split(b"-")[0])
        assert 0.6 * SIZE < held < 2 * SIZE // 3  # what the first response brought before the cut
        assert held < proxy.conns[0].down == 2 * SIZE // 3
        assert SIZE - held < proxy.conns[1].down < SIZE - held + 500  # the rest and one response header
    finally:
        proxy.close()
    _flush(nginx)
    requests = _log(nginx)
    assert len(requests) == 2, requests
    (s1, _, r1), (s2, body2, r2) = requests
    assert (s1, r1) == (200, "-") and (s2, body2, r2) == (206, SIZE - held, f"bytes={held}-")
    assert not part_path(tmp_path / "dev", digest).exists()  # the finished file is no longer partial


def test_a_partial_file_left_by_a_reboot_is_completed_with_one_range_request(tmp_path: Path, nginx: Any) -> None:
    blob = _blob(1)
    digest = blob_digest(blob)
    (nginx.root / digest).write_bytes(blob)
    part = part_path(tmp_path, digest)
    part.parent.mkdir(parents=True)
    part.write_bytes(blob[:100_000])
    (part.parent / f"{'0' * 64}.part").write_bytes(b"an older download")
    got, stats = fetch_blob(HttpTarget(nginx.url, digest, SIZE), tmp_path, timeout_s=10)
    assert got == blob and stats["resumed_from"] == 100_000 and stats["http_bytes"] == SIZE - 100_000
    _flush(nginx)
    assert _log(nginx) == [(206, SIZE - 100_000, "bytes=100000-")]
    assert list(part.parent.iterdir()) == []  # nor is the other blob's partial file kept


def test_a_body_larger_than_the_plan_says_and_a_wrong_digest_are_refused(tmp_path: Path, nginx: Any) -> None:
    blob = _blob(2)
    digest = blob_digest(blob)
    (nginx.root / digest).write_bytes(blob + b"more")  # the server's file is larger than the plan's size
    with pytest.raises(HttpFetchError) as err:
        fetch_blob(HttpTarget(nginx.url, digest, SIZE), tmp_path, timeout_s=10)
    assert err.value.kind == "size" and "body of 300004 bytes" in err.value.reason
    assert not part_path(tmp_path, digest).exists()
    bad = bytearray(blob)
    bad[SIZE // 2] ^= 1
    (nginx.root / digest).write_bytes(bytes(bad))
    with pytest.raises(HttpFetchError) as err:
        fetch_blob(HttpTarget(nginx.url, digest, SIZE), tmp_path, timeout_s=10)
    assert err.value.kind == "digest" and digest[:12] in err.value.reason
    assert not part_path(tmp_path, digest).exists()  # a refused file is not resumed from


@pytest.fixture
def raw_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import edge_client.fetch as fetch_mod

    monkeypatch.setattr(fetch_mod, "decode_global", lambda blob, strategy, limits: {"blob": blob})


@pytest.mark.parametrize("server_file", ["corrupted", "missing"])
def test_a_device_whose_http_fetch_fails_takes_the_brokers_chunks(tmp_path: Path, nginx: Any, raw_model: None,
                                                                  server_file: str) -> None:
    blob = _blob(3, 50_000)
    digest = blob_digest(blob)
    if server_file == "corrupted":
        (nginx.root / digest).write_bytes(blob[:-1] + bytes([blob[-1] ^ 0xFF]))
    chunks = chunk_blob(blob, Kind.MODEL_CHUNK, "fed", "coordinator", 1, 8192, key=COORD_KEY)
    plan = Plan(1, ("dev",), 0.0, "fedavg", {}, {"name": "cnn"}, digest, len(chunks), len(blob), models_url=nginx.url)
    dev = FetchDevice(tmp_path)
    dev.plan = plan
    dev._fetch(plan)
    assert dev._http is not None and dev.link.subscribed == []  # over HTTP: no chunk subscription
    done = dev.events.get(timeout=10)
    assert isinstance(done, HttpDone)
    dev._on_http_done(done)
    kind, info = dev.progress[0]
    assert kind == "http_fallback" and info["failure"] == ("digest" if server_file == "corrupted" else "http")
    assert dev._download is not None and dev.link.subscribed == [Topics("fed").model_filter(digest)]
    for payload in chunks:
        dev._on_model_chunk(digest, payload)
    assert dev._model == (digest, {"blob": blob})
    assert [k for k, _ in dev.progress] == ["http_fallback", "downloaded"] and "via" not in dev.progress[1][1]
    dev._fetch(plan)  # the same plan again: it holds the model, nothing is fetched
    assert dev._http is None and dev._download is None


def test_a_device_fetches_the_plans_model_over_http_without_subscribing_to_chunks(tmp_path: Path, nginx: Any,
                                                                                  raw_model: None) -> None:
    blob = _blob(4, 50_000)
    digest = blob_digest(blob)
    (nginx.root / digest).write_bytes(blob)
    plan = Plan(1, ("dev",), 0.0, "fedavg", {}, {"name": "cnn"}, digest, 7, len(blob), models_url=nginx.url)
    dev = FetchDevice(tmp_path)
    dev.plan = plan
    dev._fetch(plan)
    dev._on_http_done(dev.events.get(timeout=10))
    assert dev._model == (digest, {"blob": blob}) and dev.link.subscribed == []
    kind, info = dev.progress[0]
    assert kind == "downloaded" and info["via"] == "http" and info["http_bytes"] == len(blob)


def test_https_with_the_federations_ca(tmp_path: Path) -> None:
    """nginx with a certificate of the federation's CA; the device trusts that CA only (edge_client.http_fetch.tls_context)."""
    import shutil
    import ssl
    import subprocess

    from coordinator.model_server import NginxServer, find_nginx
    from edge_client.http_fetch import tls_context

    if find_nginx() is None or shutil.which("openssl") is None:
        pytest.skip("nginx or openssl is not installed")

    def ssl_cmd(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    ssl_cmd("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
            "-subj", "/CN=federation CA", "-keyout", "ca.key", "-out", "ca.crt")
    ssl_cmd("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "web.key", "-out", "web.csr")
    (tmp_path / "san.ext").write_text("subjectAltName = IP:127.0.0.1\n")
    ssl_cmd("x509", "-req", "-in", "web.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
            "-extfile", "san.ext", "-out", "web.crt")
    blob = _blob(5, 20_000)
    digest = blob_digest(blob)
    with NginxServer(tmp_path / "models", tmp_path / "nginx", tls_cert=tmp_path / "web.crt",
                     tls_key=tmp_path / "web.key") as server:
        (server.root / digest).write_bytes(blob)
        assert server.url.startswith("https://")
        got, _ = fetch_blob(HttpTarget(server.url, digest, len(blob)), tmp_path / "dev", timeout_s=10,
                            tls=tls_context(tmp_path / "ca.crt"))
        assert got == blob
        with pytest.raises(HttpFetchError) as err:  # the system's CAs do not know the federation's
            fetch_blob(HttpTarget(server.url, digest, len(blob)), tmp_path / "dev2", timeout_s=10,
                       tls=ssl.create_default_context())
        assert err.value.kind == "connect" and "CERTIFICATE_VERIFY_FAILED" in err.value.reason
