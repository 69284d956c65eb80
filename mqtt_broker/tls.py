"""A private certificate authority for one federation, made with the ``openssl`` command.

Files under ``<state>/tls/``: ``ca.crt``/``ca.key`` (the CA), ``server.crt``/``server.key`` (the
broker; SAN: localhost, 127.0.0.1, ::1 and the advertised host) and ``clients/<name>.crt``/``.key``
(one per device or coordinator, CN = its username). Keys are EC P-256, unencrypted, mode 0600 from
the moment openssl creates them (the command runs under umask 077). Certificates are 0644.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mqtt_broker.crl import revoke_certificate
from mqtt_broker.fsutil import find_executable, private_dir

__all__ = ["TlsError", "TlsFiles", "client_cert_paths", "ensure_ca_and_server", "make_client_cert"]

log = logging.getLogger(__name__)

CA_DAYS = 3650
LEAF_DAYS = 825


class TlsError(RuntimeError):
    """openssl is missing or failed."""


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


def _openssl(args: list[str], cwd: Path) -> None:
    tool = find_executable("openssl")
    if tool is None:
        raise TlsError("the TLS listener needs the 'openssl' command (Debian: apt-get install openssl)")
    proc = subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False,
                          umask=0o077)
    if proc.returncode != 0:
        raise TlsError(f"openssl {args[0]} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")


def _new_key_and_csr(key: Path, csr: Path, cn: str, cwd: Path) -> None:
    _openssl(["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
              "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}"], cwd)
    os.chmod(key, 0o600)


def _sign(csr: Path, out: Path, ca: TlsFiles | tuple[Path, Path], extensions: str, cwd: Path) -> None:
    ca_cert, ca_key = (ca.ca_cert, ca.ca_key) if isinstance(ca, TlsFiles) else ca
    with tempfile.NamedTemporaryFile("w", dir=cwd, suffix=".ext", delete=False) as fh:
        fh.write(extensions)
        ext = Path(fh.name)
    try:
        _openssl(["x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
                  "-set_serial", f"0x{secrets.token_hex(16)}", "-days", str(LEAF_DAYS), "-sha256",
                  "-extfile", str(ext), "-out", str(out)], cwd)
    finally:
        ext.unlink(missing_ok=True)
        csr.unlink(missing_ok=True)
    os.chmod(out, 0o644)


def _san(hosts: list[str]) -> str:
    entries: list[str] = []
    for h in dict.fromkeys(["localhost", "127.0.0.1", "::1", *hosts]):
        try:
            ipaddress.ip_address(h)
            entries.append(f"IP:{h}")
        except ValueError:
            entries.append(f"DNS:{h}")
    return ",".join(entries)


def ensure_ca_and_server(tls_dir: Path, federation: str, hosts: list[str]) -> TlsFiles:
    """Create the CA and the server certificate when missing (existing ones are kept, so issued
    client certificates stay valid); the server certificate is re-issued when ``hosts`` changed."""
    private_dir(tls_dir)
    files = TlsFiles(tls_dir / "ca.crt", tls_dir / "ca.key", tls_dir / "server.crt", tls_dir / "server.key")
    if not (files.ca_cert.exists() and files.ca_key.exists()):
        _openssl(["req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                  "-keyout", str(files.ca_key), "-out", str(files.ca_cert), "-days", str(CA_DAYS), "-sha256",
                  "-subj", f"/CN=FLAYER Edge CA {federation}",
                  "-addext", "basicConstraints=critical,CA:TRUE",
                  "-addext", "keyUsage=critical,keyCertSign,cRLSign"], tls_dir)
        os.chmod(files.ca_key, 0o600)
        os.chmod(files.ca_cert, 0o644)
        files.server_cert.unlink(missing_ok=True)
        log.info("created the federation CA in %s", tls_dir)
    san = _san(hosts)
    san_record = tls_dir / "server.san"
    if not files.server_cert.exists() or not san_record.exists() or san_record.read_text() != san:
        csr = tls_dir / "server.csr"
        _new_key_and_csr(files.server_key, csr, hosts[0] if hosts else "localhost", tls_dir)
        _sign(csr, files.server_cert, files,
              f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
              "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n", tls_dir)
        san_record.write_text(san)
        log.info("issued the server certificate (%s)", san)
    return files


def client_cert_paths(tls_dir: Path, name: str) -> tuple[Path, Path]:
    return tls_dir / "clients" / f"{name}.crt", tls_dir / "clients" / f"{name}.key"


def make_client_cert(tls_dir: Path, name: str) -> tuple[Path, Path]:
    """Issue (or re-issue) the client certificate of ``name`` (CN = name); returns (cert, key). A certificate
    it replaces goes on the federation's revocation list first (:mod:`mqtt_broker.crl`): a copied old kit
    cannot connect again once the broker has reloaded."""
    ca = (tls_dir / "ca.crt", tls_dir / "ca.key")
    if not (ca[0].exists() and ca[1].exists()):
        raise TlsError(f"no CA in {tls_dir}; start the broker with TLS first")
    private_dir(tls_dir / "clients")
    cert, key = client_cert_paths(tls_dir, name)
    if revoke_certificate(tls_dir, cert):
        log.info("the previous certificate of %s is on the revocation list", name)
    csr = cert.with_suffix(".csr")
    _new_key_and_csr(key, csr, name, tls_dir)
    _sign(csr, cert, ca, "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
          "extendedKeyUsage=clientAuth\n", tls_dir)
    log.info("issued the client certificate of %s", name)
    return cert, key
