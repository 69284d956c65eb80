"""A coordinator that mints a device (docs/explanation/security.md, "Device keys are certified, not copied").

The adversary is the coordinator: it holds its own signing key (so the victim takes what it publishes on
``secreq/<victim>``), the authority's PUBLIC key (every kit's ``authority.pub``), and whatever the broker's ACL lets
its user publish. It wants one more colluder than t and T count: a device of its own making. It makes a key pair for
``dev-z``, writes it a certificate signed with its own key (it has no other), puts it in ``dev-z``'s advert (and
on ``cert/dev-z`` and ``cert/coordinator``, where certificates were once read: the ACL lets nobody write there),
names ``dev-z`` in a secure round's cohort and relays ``dev-z``'s advert, signed with the minted key, in the victim's
key bundle. The guarantee: the victim believes a key only through a
certificate its kit's authority key verifies, so it refuses the round (sends no shares) -- while it does take part in
a round whose devices were all added AFTER its kit was made, with no file copied to it (before this, a kit's frozen
copy of ``signing_keys.json`` refused every later device: the check that fails on the old code).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from certfed import FED, VICTIM, T, kit_federation, own_keys

from mqtt_broker import mosquitto_available
from protocol import SignContext, SigningKey

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
LATE = ("dev-c", "dev-d", "dev-e")


@pytest.fixture(scope="module")
def shard(digits):  # type: ignore[no-untyped-def]
    from flayer.partition import make_partition
    from flayer.train import client_data

    return client_data(digits, make_partition(digits.y, digits.num_classes, 2, "iid", 0).clients[0])


def _minted_cert(coordinator_key: SigningKey, device: str, key: SigningKey) -> bytes:
    """The best certificate the coordinator can make: the public format, signed with the key it holds."""
    raw = base64.urlsafe_b64decode(key.public.text.split(":", 1)[1] + "==")
    issued = int(time.time())
    sig = coordinator_key.sign(SignContext(FED, 9, device, "flayer:device-cert/v1"), raw + issued.to_bytes(8, "little"))
    return json.dumps({"v": 1, "purpose": "flayer:device-cert/v1", "federation": FED, "device": device,
                       "key": key.public.text, "serial": 9, "issued": issued,
                       "sig": base64.urlsafe_b64encode(sig).decode().rstrip("=")}, sort_keys=True).encode()


@pytest.mark.timeout(180)
def test_a_coordinator_cannot_mint_a_device_but_later_devices_need_no_copied_file(
        tmp_path: Path, shard: Any, caplog: pytest.LogCaptureFixture) -> None:
    fed = kit_federation(tmp_path, ["dev-a", VICTIM])
    try:
        fed.start_victim(shard)  # started from its kit, made when dev-a and dev-b were the federation
        for d in LATE:  # added one by one after the victim started: kits made later, nothing copied to the victim
            fed.add(d)
        cohort = ("dev-a", VICTIM, *LATE)
        caplog.set_level(logging.WARNING)
        assert fed.victim_shares(1, cohort, own_keys(fed, cohort)), \
            "the victim refused a round of devices added after its kit was made (a frozen key registry)"

        coordinator_key = fed.fb.coordinator.signer()
        minted = SigningKey.generate()
        adversary = fed.coord  # the coordinator's own connection (its user, its ACL)
        assert adversary is not None
        for topic in (f"fl/{FED}/cert/dev-z", f"fl/{FED}/cert/coordinator"):  # where certificates once were read
            adversary.link.wait_published([adversary.link.publish(
                topic, _minted_cert(coordinator_key, "dev-z", minted), retain=True)], 5)
        time.sleep(0.5)
        keys = {**own_keys(fed, cohort), "dev-z": minted}
        minted_cohort = ("dev-a", VICTIM, "dev-c", "dev-d", "dev-z")
        assert not fed.victim_shares(2, minted_cohort, keys,  # the minted certificate rides in dev-z's advert
                                     certs={"dev-z": _minted_cert(coordinator_key, "dev-z", minted)}), \
            "the victim sealed its shares for a device the coordinator minted"
        assert any("dev-z" in r.getMessage() and "refuses the round" in r.getMessage() for r in caplog.records)
        assert any("not signed by this federation's authority" in r.getMessage() for r in caplog.records), \
            "the minted certificate was not refused as such"
    finally:
        fed.close()
