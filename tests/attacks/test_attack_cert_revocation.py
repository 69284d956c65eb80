"""Revoked, rolled-back and re-keyed certificates (docs/explanation/security.md, "Device keys are certified, not
copied"; the revocation list: :mod:`protocol.certs`).

Each test runs a real Mosquitto, a victim device started from its kit (:mod:`certfed`) and the admin's real command
line (``flayer broker revoke|rekey``), which publishes the authority's signed revocation list retained. The adversary
is the coordinator holding a key it should no longer be able to use -- a revoked device's, or a re-keyed device's old
one (the reason the admin acted) -- and relaying that device's advert, signed with it, in the victim's key bundle; in
the rollback test also the broker's operator, who can publish on any topic and puts the older list it saw back on
``revocations``. The guarantee: once the list reaches the victim (no file copied), it refuses the listed certificate,
and it never goes back to an older list, not even after a restart. On the code before, a kit's copy of
``signing_keys.json`` kept believing every key it held, and ``rekey --kit`` to the kit's own path failed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from certfed import VICTIM, T, kit_federation, own_keys
from fedtestlib import Recorder

from mqtt_broker import load_credentials, mosquitto_available

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
COHORT = ("dev-a", VICTIM, "dev-c", "dev-d", "dev-e")


@pytest.fixture(scope="module")
def shard(digits):  # type: ignore[no-untyped-def]
    from flayer.partition import make_partition
    from flayer.train import client_data

    return client_data(digits, make_partition(digits.y, digits.num_classes, 2, "iid", 0).clients[0])


def _federation(tmp_path: Path, shard: Any):  # type: ignore[no-untyped-def]
    fed = kit_federation(tmp_path, list(COHORT), together=True)
    fed.start_victim(shard)
    return fed


def _said(caplog: pytest.LogCaptureFixture, *words: str) -> bool:
    return any(all(w in r.getMessage() for w in words) for r in caplog.records)


@pytest.mark.timeout(180)
def test_a_revoked_devices_still_valid_looking_certificate_is_refused(tmp_path: Path, shard: Any,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    fed = _federation(tmp_path, shard)
    try:
        caplog.set_level(logging.WARNING)
        stolen = own_keys(fed, COHORT)  # the coordinator colludes with dev-e, whose key it holds
        assert fed.victim_shares(1, COHORT, stolen)  # believed while dev-e is a device
        assert fed.admin("revoke", "dev-e") == 0
        time.sleep(1.0)  # the retained list reaches the victim
        assert not fed.victim_shares(2, COHORT, stolen), "the victim still believes a revoked device's certificate"
        assert _said(caplog, "dev-e", "is revoked by the authority's revocation list", "refuses the round")
    finally:
        fed.close()


@pytest.mark.timeout(180)
def test_an_older_revocation_list_is_refused_even_after_a_restart(tmp_path: Path, shard: Any,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    fed = _federation(tmp_path, shard)
    try:
        caplog.set_level(logging.WARNING)
        assert fed.admin("rekey", "dev-a", "--kit", str(fed.tmp / "machine-dev-a" / "dev-a.tar.gz")) == 0
        fed.renew("dev-a")  # version 1 lists dev-a's first certificate; dev-a runs with its second
        operator = Recorder(load_credentials(fed.state, "flayer-admin"), [T.revocations()])  # the broker's operator
        try:
            old = operator.wait_message(lambda m: m.topic == T.revocations(), 10)
            assert old is not None, "no revocation list was published retained"
            assert fed.admin("revoke", "dev-e") == 0  # version 2: dev-e's certificate too
            time.sleep(1.0)
            fed.restart_victim(shard)  # the victim keeps version 2 in its state folder
            assert operator.link.wait_published([operator.link.publish(T.revocations(), old.payload, retain=True)], 5)
            time.sleep(1.0)  # version 1 again, retained: what a restarted device reads first
        finally:
            operator.close()
        stolen = own_keys(fed, COHORT)  # dev-e's among them: the coordinator colludes with the revoked device
        assert not fed.victim_shares(3, COHORT, stolen), "the victim went back to an older revocation list"
        assert _said(caplog, "refused revocation list version 1", "rollback"), "the older list was not refused"
        assert _said(caplog, "dev-e", "is revoked by the authority's revocation list (version 2)", "refuses the round")
    finally:
        fed.close()


@pytest.mark.timeout(180)
def test_a_rekeyed_devices_old_key_is_refused_and_its_new_kit_restarts_in_place(
        tmp_path: Path, shard: Any, caplog: pytest.LogCaptureFixture) -> None:
    fed = _federation(tmp_path, shard)
    try:
        caplog.set_level(logging.WARNING)
        old = own_keys(fed, COHORT)  # the coordinator holds dev-d's old key: the reason it is re-keyed
        kit = fed.tmp / "machine-dev-d" / "dev-d.tar.gz"
        assert fed.admin("rekey", "dev-d", "--kit", str(kit)) == 0, "rekey --kit did not write the new kit"
        fed.renew("dev-d")  # restarted from the new kit in the old kit's folder: its certificate, serial 2
        time.sleep(1.0)
        assert fed.creds("dev-d").signer().public != old["dev-d"].public
        assert not fed.victim_shares(1, COHORT, old), "the victim believes a re-keyed device's old key"
        assert fed.victim_shares(2, COHORT, own_keys(fed, COHORT)), "the victim refuses the re-keyed device's new key"
    finally:
        fed.close()
