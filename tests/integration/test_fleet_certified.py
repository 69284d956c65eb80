"""A private fleet that grows, re-keys and shuts a device out with no file copied between devices
(docs/tutorials/across-machines.md).

Over TLS, with local differential privacy and secure aggregation: four devices are added one after another, each
kit made after the devices before it started (so no kit knows the devices after it), and every device runs from its
own unpacked kit in its own folder (its own "machine"). After the first secure round, dev-2 is re-keyed with
``flayer broker rekey dev-2 --kit`` onto its own kit file and restarted from the new kit in the same folder: its
state (ledger, personal model) is kept, the others learn its new key from its certificate and refuse the old one
from the authority's revocation list. Later, while dev-3 takes part in an open secure round (its keys advertised),
the admin runs ``flayer broker revoke dev-3``: the broker closes its connection and refuses it, the coordinator
drops what it sends and selects it no more, and every round from then on unmasks or is abandoned with its reason
recorded; none waits for the revoked device (the round in flight closes as soon as the three others are in), the
last ones, of the three devices left, unmask, and the final epsilon line counts the rounds whose sum was revealed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import federation_toml, finished, wait_connectable

from cli.main import main as cli
from cli.privacy import epsilon_lines
from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from flayer.engine.secure import abandon_kind
from flayer.partition import make_partition
from flayer.train import client_data
from mqtt_broker import BrokerConfig, load_credentials, mosquitto_available, start_broker
from transport.credentials import Credentials, mqtt_connect_settings
from transport.kit import unpack_kit
from transport.link import probe

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
DEVICES = [f"dev-{i}" for i in range(4)]
ROUNDS = 6
REVOKE_IN = 3  # dev-3 is revoked during the first round from this one that it takes part in
DEADLINE_S = 120.0
# Rounds here take seconds (tens on a loaded machine); a round that waited for the revoked device would take its
# grace (the round in flight) or its deadline: besides the close reasons, no round from the revocation on may take
# half the deadline.
MARGIN_S = DEADLINE_S / 2


def _edge(kit_dir: Path, shard: Any) -> EdgeClient:
    creds = Credentials.load(kit_dir / "credentials.toml")
    settings = EdgeSettings(state_dir=str(kit_dir / "state"), device="cpu", heartbeat_s=2.0, ack_timeout_s=10.0,
                            threads=1)
    client = EdgeClient(settings, creds, shard)
    client.start()
    return client


def _in_protocol(coord: Coordinator, device: str, first: int) -> dict[str, Any] | None:
    """Where the open secure round stands when ``device`` takes part in it (its keys advertised), or None."""
    rnd = coord.open
    sec = rnd.secure if rnd is not None else None
    if rnd is None or sec is None or rnd.number < first or device not in rnd.selected:
        return None
    server = sec.server
    if device not in server.advertised:
        return None
    return {"round": rnd.number, "stage": sec.stage, "shared": device in server.shared,
            "masked": device in server.survivors, "accepted": sorted(rnd.accepted)}


@pytest.mark.timeout(900)
def test_devices_added_one_by_one_one_rekeyed_one_revoked_mid_round(tmp_path: Path, digits: Any, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="coordinator")
    part = make_partition(digits.y, digits.num_classes, 4, "iid", seed=0, samples=400)
    shards = [client_data(digits, c) for c in part.clients]
    state = tmp_path / "broker"
    broker = start_broker(BrokerConfig(federation="fleet", tls=True, require_certificate=True), state,
                          kind="mosquitto", timeout=30)
    edges: dict[str, EdgeClient] = {}
    kits: dict[str, Path] = {}
    closed: list[tuple[float, dict[str, Any]]] = []  # (monotonic time at the close, the round's record)
    try:
        # every device online selected (over-selection 4/3); quorum and min_devices 3, so that the three left after
        # the revocation go on; a round closes when all selected are in, or 5 s after the third
        fed = federation_toml(tmp_path / "federation.toml", state / "credentials/coordinator.toml",
                              tmp_path / "coord", strategy="fedavg", rounds=ROUNDS, dataset="digits", quorum=3,
                              min_devices=3, over_selection=1.34, grace_s=5.0, deadline_s=DEADLINE_S)
        fed.write_text(fed.read_text() + "[privacy]\nenabled = true\nmode = \"local\"\nclip = 1.0\n"
                       "noise_multiplier = 0.5\npopulation = 4\nsecure_aggregation = true\nsecure_stage_s = 20.0\n")
        for i, dev in enumerate(DEVICES):  # one by one: each kit made after the devices before it started
            machine = tmp_path / f"machine-{dev}"
            assert cli(["broker", "add-device", dev, "--state-dir", str(state), "--kit",
                        str(machine / f"{dev}.tar.gz")]) == 0
            kits[dev] = unpack_kit(machine / f"{dev}.tar.gz").parent
            assert not (kits[dev] / "signing_keys.json").exists()  # nothing but its own certificate
            wait_connectable(Credentials.load(kits[dev] / "credentials.toml"))
            edges[dev] = _edge(kits[dev], shards[i])
        coord = Coordinator(load_coordinator_config(fed), load_credentials(state, "coordinator"),
                            on_round=lambda rec: closed.append((time.monotonic(), rec)))
        thread = coord.start()

        # re-key dev-2 after the first round closed and it trained (round 1 may have opened with three devices, as
        # their statuses came in: a re-key during it would leave fewer than T = 3 signers), restart it from its new
        # kit in its folder
        deadline = time.monotonic() + 240
        while not (closed and edges["dev-2"].rounds_trained) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert closed and edges["dev-2"].rounds_trained, "no first round"
        rekey_from = len(closed) + 1  # the round open (or opening) now: the next opens as soon as one closes
        old_key = edges["dev-2"].signer.public
        assert cli(["broker", "rekey", "dev-2", "--state-dir", str(state), "--kit",
                    str(tmp_path / "machine-dev-2" / "dev-2.tar.gz")]) == 0
        edges["dev-2"].stop()
        assert unpack_kit(tmp_path / "machine-dev-2" / "dev-2.tar.gz").parent == kits["dev-2"]  # the same folder
        restarted = _edge(kits["dev-2"], shards[2])
        assert restarted.signer.public != old_key
        assert restarted.stored.done_round >= 1 or restarted.store.plan_round() >= 1  # its state was kept
        edges["dev-2"] = restarted
        # a round dev-2 was in while it was re-keyed may be abandoned: its shares carry the old key's signature and
        # its old certificate is on the revocation list the others now hold, so they refuse them (the model stays)
        rekey_rounds = set(range(rekey_from, len(closed) + 2))

        # revoke dev-3 while it takes part in an open secure round, as the admin would (docs/howto/devices.md)
        deadline = time.monotonic() + 400
        while (at := _in_protocol(coord, "dev-3", REVOKE_IN)) is None and thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert at is not None, f"dev-3 took part in no secure round from round {REVOKE_IN} on: {closed[-3:]}"
        revoked_at = time.monotonic()
        assert cli(["broker", "revoke", "dev-3", "--state-dir", str(state)]) == 0
        print(f"dev-3 revoked {time.monotonic() - revoked_at:.2f} s after its round's state was read: {at}")
        # shut out: its connection closed, and its kit refused by the TLS handshake (its certificate is on the CA's
        # list) and by its password's absence -- it cannot publish again
        ev = probe(mqtt_connect_settings(Credentials.load(kits["dev-3"] / "credentials.toml")))
        assert ev is None or not ev.ok, ev
        time.sleep(1.0)
        assert not edges["dev-3"].link.connected.is_set() or edges["dev-3"].wait(0), "dev-3 still connected"

        result = finished(coord, thread, 600, rounds=ROUNDS)
        assert result is not None
        for dev in ("dev-0", "dev-1", "dev-2"):
            assert edges[dev].error is None, (dev, edges[dev].error)

        # every round from the one dev-3 was revoked in: unmasked, or abandoned with its reason recorded; none
        # waited to its deadline for dev-3
        after = [(t, rec) for t, rec in closed if rec["round"] >= at["round"]]
        assert after[0][1]["round"] == at["round"] and len(after) == ROUNDS - at["round"] + 1, \
            [rec["round"] for _, rec in closed]
        durations = [(rec["round"], rec["wall_s"], rec["closed"], rec.get("secure_abandoned")) for _, rec in after]
        print("rounds from the revocation on (round, s, closed, abandoned):", durations)
        print("stage limits:", [(rec["round"], rec.get("secure_stage_limits")) for _, rec in after])
        print("counters:", dict(result.counters))
        before = [rec for _, rec in closed if rec["round"] < at["round"]]
        assert all(not rec["secure_abandoned"] or rec["round"] in rekey_rounds for rec in before), \
            ([(r["round"], r["secure_abandoned"]) for r in before], sorted(rekey_rounds))
        for t, rec in after:
            assert "secure_survivors" in rec, rec  # a secure round's record
            assert rec["secure_abandoned"] is None or rec["secure_abandoned"].strip(), rec
            # closed once every device that could come was in: the quorum is all three left, so a round that waited
            # for dev-3 would close at "quorum 3 + grace 5s" (the one in flight) or at its deadline (a later one)
            assert rec["secure_abandoned"] or rec["closed"].startswith("every selected device reported"), rec
            assert rec["wall_s"] < MARGIN_S, (rec["round"], rec["wall_s"], durations)
            opened = t - rec["wall_s"]
            if opened > revoked_at:  # opened after the revocation: dev-3 neither asked nor counted
                assert "dev-3" not in rec["selected"], rec
            if rec["round"] > at["round"] or not at["masked"]:
                assert "dev-3" not in (rec["secure_survivors"] if not rec["secure_abandoned"] else []), rec
        last_rounds = [rec for _, rec in after if rec["round"] > at["round"]]
        assert last_rounds and all(not rec["secure_abandoned"] and sorted(rec["secure_survivors"]) ==
                                   ["dev-0", "dev-1", "dev-2"] for rec in last_rounds), durations

        # the final epsilon line counts exactly the rounds whose sum was revealed
        records = result.history
        revealed = sum(not r["secure_abandoned"] or abandon_kind(r["secure_abandoned"]) == "sum_check"
                       for r in records)
        last = records[-1]
        assert last["dp_rounds"] == revealed, (last["dp_rounds"], [(r["round"], r["secure_abandoned"])
                                                                     for r in records])
        line = epsilon_lines(last, last["round"])
        assert (f"after {ROUNDS} rounds" if revealed == ROUNDS else f"after {revealed} rounds whose sum was revealed") \
            in line, line
        said = [r.getMessage() for r in caplog.records]
        unmasked = [m for m in said if "secure round unmasked" in m]
        assert len(unmasked) == sum(not r["secure_abandoned"] for r in records), said[-40:]
    finally:
        for edge in edges.values():
            edge.stop()
        broker.stop()
