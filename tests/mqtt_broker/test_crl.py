"""The federation CA's revocation list (mqtt_broker.crl): written where Mosquitto reads it, grown by revocation
and rotation, refused when another CA signed it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mqtt_broker import BrokerConfig, add_device
from mqtt_broker.crl import CrlError, crl_path, revoked_serials
from mqtt_broker.fsutil import find_executable
from mqtt_broker.kit import revoke_device
from mqtt_broker.state import BrokerFiles, write_broker_files
from mqtt_broker.tls import client_cert_paths

needs_openssl = pytest.mark.skipif(find_executable("openssl") is None, reason="openssl is not installed")


def _serial(cert: Path) -> int:
    out = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-serial"], capture_output=True, text=True,
                         check=True).stdout
    return int(out.strip().split("=", 1)[1], 16)


@needs_openssl
def test_revocation_and_rotation_put_the_old_certificate_on_the_list(tmp_path: Path) -> None:
    files = write_broker_files(BrokerConfig(federation="c1", tls=True, persistence=False), tmp_path)
    conf = files.mosquitto_conf.read_text()
    assert f"crlfile {crl_path(files.tls_dir)}" in conf and revoked_serials(files.tls_dir) == {}
    add_device(tmp_path, "dev-a")
    add_device(tmp_path, "dev-b")
    cert_a, _ = client_cert_paths(files.tls_dir, "dev-a")
    first = _serial(cert_a)
    add_device(tmp_path, "dev-a", rotate=True)
    assert set(revoked_serials(files.tls_dir)) == {first} and _serial(cert_a) != first
    second = _serial(cert_a)
    cert_b, _ = client_cert_paths(files.tls_dir, "dev-b")
    b = _serial(cert_b)
    revoke_device(tmp_path, "dev-b")
    assert set(revoked_serials(files.tls_dir)) == {first, b} and second not in revoked_serials(files.tls_dir)
    # openssl agrees: the list verifies under the CA and names the serials
    text = subprocess.run(["openssl", "crl", "-in", str(crl_path(files.tls_dir)), "-CAfile",
                           str(files.tls_dir / "ca.crt"), "-noout", "-text"], capture_output=True, text=True,
                          check=True)
    assert "verify OK" in text.stderr + text.stdout and f"{b:X}" in text.stdout.replace(":", "").upper()


@needs_openssl
def test_a_list_signed_by_another_ca_is_refused(tmp_path: Path) -> None:
    ours = write_broker_files(BrokerConfig(federation="c1", tls=True, persistence=False), tmp_path / "ours")
    other = write_broker_files(BrokerConfig(federation="c2", tls=True, persistence=False), tmp_path / "other")
    crl_path(ours.tls_dir).write_bytes(crl_path(other.tls_dir).read_bytes())
    with pytest.raises(CrlError, match="not signed by the federation's CA"):
        revoked_serials(ours.tls_dir)


@needs_openssl
def test_no_list_without_required_certificates(tmp_path: Path) -> None:
    files = write_broker_files(BrokerConfig(federation="c1", tls=True, require_certificate=False, persistence=False),
                               tmp_path)
    assert "crlfile" not in files.mosquitto_conf.read_text() and not crl_path(BrokerFiles.at(tmp_path).tls_dir).exists()
