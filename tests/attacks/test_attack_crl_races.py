"""Revocation lists that lose a revoked certificate (docs/howto/devices.md, "Rotate or shut out a device";
docs/explanation/guarantees.md, TLS identity mode).

Under ``flayer broker start --tls --identity-as-username`` a revoked device is shut out by the federation CA's
revocation list. Three ways it used to lose entries, each then letting the revoked kit pass the TLS handshake with
a device's full rights:

1. two operators revoke at once (``xargs -P``, two shells): each ``revoke`` read the list, added its entry and
   wrote it back, so the last writer dropped the other's entry (5 of 8 trials lost a device);
2. the list deleted, or restored from an older backup, and the broker started again: an empty list was written;
3. a device revoked whose certificate is not on record: ``revoke`` said the certificate was on the list.

The guarantee: every revoked certificate stays on the list, a start over a list shorter than the last one written
is refused, and ``revoke`` says when it could put nothing on the list.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mqtt_broker import BrokerConfig
from mqtt_broker.crl import CrlError, crl_path, ensure_crl, revoke_serials, revoked_serials
from mqtt_broker.state import write_broker_files


def _tls_dir(tmp: Path) -> Path:
    return write_broker_files(BrokerConfig(federation="c1", tls=True, persistence=False), tmp).tls_dir


def test_parallel_revocations_keep_every_certificate_on_the_list(tmp_path: Path) -> None:
    tls = _tls_dir(tmp_path)
    serials = list(range(1000, 1016))
    start = threading.Barrier(len(serials))

    def revoke(serial: int) -> None:
        start.wait()
        revoke_serials(tls, [serial])

    threads = [threading.Thread(target=revoke, args=(s,)) for s in serials]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = sorted(set(serials) - set(revoked_serials(tls)))
    assert not missing, f"revocations run at once lost {len(missing)} certificate(s) from the list: {missing}"


def test_a_list_deleted_or_restored_shorter_is_refused_at_start(tmp_path: Path) -> None:
    tls = _tls_dir(tmp_path)
    revoke_serials(tls, [7])
    older = crl_path(tls).read_bytes()
    revoke_serials(tls, [8])
    crl_path(tls).write_bytes(older)  # a backup from before the second revocation
    with pytest.raises(CrlError, match="holds 1 revoked certificate"):
        ensure_crl(tls)
    crl_path(tls).unlink()  # the list deleted
    with pytest.raises(CrlError, match="holds 0 revoked"):
        ensure_crl(tls)
    revoke_serials(tls, [7, 8])  # the operator puts the list back: the start goes on
    assert set(revoked_serials(ensure_crl(tls).parent)) == {7, 8}


def test_revoke_says_when_no_certificate_could_be_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main
    from mqtt_broker import add_device
    from mqtt_broker.tls import client_cert_paths

    write_broker_files(BrokerConfig(federation="c1", tls=True, persistence=False, use_identity_as_username=True), tmp_path)
    add_device(tmp_path, "dev-a")
    cert, _ = client_cert_paths(tmp_path / "tls", "dev-a")
    cert.unlink()  # revoked under a release that deleted it, or lost
    assert main(["broker", "revoke", "dev-a", "--state-dir", str(tmp_path)]) == 0
    said = capsys.readouterr()
    assert "certificate on the revocation list" not in said.out, said.out
    assert "none could be put on the revocation list" in said.err
