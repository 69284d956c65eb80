"""A secure round costs a device privacy budget only when its sum can be revealed, and ends at once when it cannot
(docs/explanation/secure-aggregation.md, "When a device books a secure round", "Liveness").

Private secure rounds (distributed DP, every device's ledger counting them) over a real Mosquitto, a real
coordinator and real edge clients. The adversary is one selected device: its own credentials, the plan, the messages
addressed to it, what it sends under its own topics.

* **A signer that cannot come.** Mallory takes part in the keys and the shares of round 1, then goes offline (its
  own retained status says so) and comes back a few seconds later, silent in round 2. Three devices are selected
  (t = 2, T = 3): once mallory is gone the round can never be unmasked. On the code before, the coordinator waited
  for the round's deadline (120 s) and then the signatures' stage, and the two honest devices booked the round when
  they sent their masked inputs -- a budget burnt by a round whose sum nobody could reveal. Now the round ends at
  once, and an honest device's ledger counts nothing for it (a device books a round at its consent, which it is never
  asked for in a round abandoned before).
* **Shares that do not authenticate.** Evil seals every neighbour random bytes, signed with its own key. It is named
  (a complaint) and left out; on the code before the round was abandoned (nobody held t shares of evil's mask key)
  while the honest devices had booked it. Now its neighbours reveal their own pair's mask seed toward it, the round
  is unmasked without it, and each honest device's ledger counts exactly the rounds whose sum held its input.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from attacklib import ProtocolDevice, until
from fedtestlib import device_toml, federation_toml, finished, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.budget import DeviceLedger
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.partition import make_partition, save_partition
from flayer.secagg import SecAggClient
from flayer.train import client_data
from mqtt_broker import mosquitto_available
from protocol.metrics_schema import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DEADLINE_S = 120.0


def _federation(tmp: Path, fb: Any, selected: int, quorum: int, rounds: int) -> Path:
    fed = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                          strategy="flayer", rounds=rounds, dataset="digits", seed=0, lr=0.05, quorum=quorum,
                          min_devices=quorum, deadline_s=DEADLINE_S)
    text = fed.read_text().replace("over_selection = 1.0", f"over_selection = {selected / quorum}")
    fed.write_text(text + '[privacy]\nsecure_aggregation = true\nsecure_stage_s = 10.0\nenabled = true\n'
                          'mode = "local"\nclip = 0.5\nnoise_multiplier = 1.0\npopulation = 40\n')
    return fed


def _devices(tmp: Path, fb: Any, digits: Any, names: list[str]) -> list[EdgeClient]:
    part = make_partition(digits.y, digits.num_classes, len(names), "dir0.5", seed=0, samples=400,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp / "digits.npz")
    out = []
    for i, name in enumerate(names):
        path = device_toml(tmp / f"{name}.toml", fb.state_dir / f"credentials/{name}.toml", dataset="digits",
                           partition_file=pfile, client=i, state_dir=tmp / name)
        out.append(EdgeClient(load_device_config(path).edge, fb.devices[name], client_data(digits, part.clients[i])))
    for dev in out:
        dev.start()
    for dev in out:
        assert dev.link.connected.wait(60)
    return out


def _booked(dev: EdgeClient) -> int:
    return DeviceLedger.from_extra(dev.stored.extra).rounds


class _GoesAway(ProtocolDevice):
    """Mallory: keys and shares in each round it is selected for (signed with its own key, as any device), then
    offline for ``away_s`` seconds (its own retained status), then online again."""

    def __init__(self, creds: Any, away_s: float = 6.0) -> None:
        super().__init__(creds, away_s=away_s)

    def one_round(self, after: int, timeout: float = 120.0) -> int | None:
        return self.keys_shares_then_away(after, timeout)


@pytest.mark.timeout(400)
def test_a_round_whose_signer_cannot_come_ends_at_once_and_books_nothing(tmp_path: Path, digits: Any) -> None:
    honest = ["dev-0", "dev-1"]
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", [*honest, "mallory"])
    devices: list[EdgeClient] = []
    mallory = _GoesAway(fb.devices["mallory"])
    try:
        devices = _devices(tmp_path, fb, digits, honest)
        time.sleep(2.0)
        coord = Coordinator(load_coordinator_config(_federation(tmp_path, fb, 3, 3, rounds=2)), fb.coordinator)
        thread = coord.start()
        first = mallory.one_round(0)
        assert first == 1
        metrics = tmp_path / "coord/metrics.jsonl"

        def closed(r: int) -> dict[str, Any] | None:
            if not metrics.exists():
                return None
            return next((x for x in read_metrics(metrics) if x["kind"] == "round" and x["round"] == r), None)

        assert until(lambda: closed(1) is not None, 60.0), \
            f"round 1 was still open 60 s after its signer went offline (its deadline: {DEADLINE_S:g} s)"
        rec = closed(1)
        assert rec is not None and rec["secure_abandoned"] is not None, rec
        assert rec["wall_s"] < DEADLINE_S / 2, rec["wall_s"]
        assert rec.get("dp_rounds") == 0, "an abandoned round was composed in the coordinator's ledger"
        # round 2 (mallory online, silent: no advert, so no device masks anything): round 1 was abandoned before any
        # consent was asked, so no honest device booked it
        assert until(lambda: closed(2) is not None, 60.0)
        assert all(d.plan is not None and d.plan.round == 2 for d in devices)
        booked = {d.id: _booked(d) for d in devices}
        assert booked == {d: 0 for d in honest}, f"a round whose sum nobody could reveal was booked: {booked}"
        coord.stop()
        thread.join(60)
    finally:
        mallory.close()
        for dev in devices:
            dev.stop()
        fb.broker.stop()


def _garbage_shares(monkeypatch: pytest.MonkeyPatch, sender: str) -> None:
    """``sender`` seals every neighbour random bytes, signed with its own key (its own share batch)."""
    from flayer.secagg.signed_adverts import device_signs
    from flayer.secagg.signed_shares import sign_share

    real = SecAggClient.share_keys

    def share_keys(self: SecAggClient, bundle: Any) -> Any:
        out = real(self, bundle)
        if self.device != sender:
            return out
        signs = device_signs(self._consistency)
        junk = []
        for s in out.shares:
            share = dataclasses.replace(s, ciphertext=os.urandom(len(s.ciphertext)), signature=b"")
            if signs is not None:
                share = sign_share(self.params, share, self._pairs[s.receiver].public, self._peers[s.receiver].c_pk,
                                   signs[0])
            junk.append(share)
        return dataclasses.replace(out, shares=tuple(junk))

    monkeypatch.setattr(SecAggClient, "share_keys", share_keys)


@pytest.mark.timeout(500)
def test_undecryptable_shares_name_their_sender_and_honest_budgets_count_only_revealed_sums(
        tmp_path: Path, digits: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    honest = [f"dev-{i}" for i in range(4)]
    names = [*honest, "evil"]
    _garbage_shares(monkeypatch, "evil")
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", names)
    devices: list[EdgeClient] = []
    try:
        devices = _devices(tmp_path, fb, digits, names)
        time.sleep(2.0)
        coord = Coordinator(load_coordinator_config(_federation(tmp_path, fb, 5, 4, rounds=2)), fb.coordinator)
        thread = coord.start()
        finished(coord, thread, 300, rounds=2)
        rounds = [r for r in read_metrics(tmp_path / "coord/metrics.jsonl") if r["kind"] == "round"]
        hit = next(r for r in rounds if "evil" in r["selected"])
        assert "does not open" in hit["secure_faulty"].get("evil", ""), hit["secure_faulty"]
        assert set(hit["secure_faulty"]) == {"evil"}
        assert hit["secure_abandoned"] is None, f"the round was lost to evil's shares: {hit['secure_abandoned']}"
        assert "evil" not in hit["secure_survivors"]
        for dev in devices:
            if dev.id == "evil":
                continue
            revealed = sum(1 for r in rounds if r["secure_abandoned"] is None and dev.id in r["secure_survivors"])
            assert _booked(dev) == revealed, (f"{dev.id} booked {_booked(dev)} rounds, {revealed} of which revealed "
                                              f"a sum holding its input")
            assert revealed >= 1
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()
