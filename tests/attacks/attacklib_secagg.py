"""Secure-aggregation pieces of the attack harness: a private secure federation of real edge clients, each run from
its kit, on a real broker; and the stages of an in-process round that a lying coordinator runs honestly."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from fedtestlib import FedBroker, device_toml, federation_toml, finished, start_fed_broker

from flayer.secagg import KeyAdvert, SecAggClient, SecAggServer, decode_message, keys, shamir


def private_secure_federation(tmp: Path, fb: FedBroker, devices: int, rounds: int, stage_s: float) -> Path:
    """``tmp / "federation.toml"``: ``rounds`` FLAYER rounds of digits over ``fb``, every one of ``devices`` needed
    (quorum and minimum), each round a secure one (``stage_s`` a stage) with distributed DP (local noise, every
    device's ledger counting it)."""
    fed = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                          strategy="flayer", rounds=rounds, dataset="digits", seed=0, lr=0.05, quorum=devices,
                          min_devices=devices, deadline_s=120.0)
    fed.write_text(fed.read_text() + f'[privacy]\nsecure_aggregation = true\nsecure_stage_s = {stage_s}\n'
                                     'enabled = true\nmode = "local"\nclip = 0.5\nnoise_multiplier = 1.0\n'
                                     'population = 40\n')
    return fed


def private_secure_rounds(tmp: Path, fb: FedBroker, devices: int, rounds: int, stage_s: float,
                          timeout: float) -> list[dict[str, Any]]:
    """A real coordinator over ``fb`` run to its end (within ``timeout`` seconds) on
    :func:`private_secure_federation`; the round records of its metrics, in order."""
    from coordinator.config import load_coordinator_config
    from coordinator.server import Coordinator
    from protocol.metrics_schema import read_metrics

    fed = private_secure_federation(tmp, fb, devices, rounds, stage_s)
    coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
    finished(coord, coord.start(), timeout, rounds=rounds)
    return [r for r in read_metrics(tmp / "coord/metrics.jsonl") if r["kind"] == "round"]


@contextmanager
def kit_fleet(tmp: Path, digits: Any, names: list[str], privacy: str = "", others: Sequence[str] = ()
              ) -> Iterator[tuple[FedBroker, list[Any]]]:
    """A real broker (Mosquitto where installed) with the accounts of ``names``, and a started, connected edge
    client for each, run from its kit (its certificate, the pinned authority key) on a dir0.5 shard of ``digits``
    (``privacy``: the body of each device.toml's ``[privacy]`` table); ``others``: device accounts beside them that
    run no edge client (an adversary's own device); the clients and the broker are stopped on leaving."""
    from edge_client.client import EdgeClient
    from edge_client.config import load_device_config
    from flayer.partition import make_partition, save_partition
    from flayer.train import client_data
    from mqtt_broker import mosquitto_available
    from mqtt_broker.kit import write_kit
    from transport.credentials import Credentials
    from transport.kit import unpack_kit

    fb = start_fed_broker(tmp, "mosquitto" if mosquitto_available() else "embedded", [*names, *others])
    devices: list[EdgeClient] = []
    try:
        part = make_partition(digits.y, digits.num_classes, len(names), "dir0.5", seed=0, samples=400,
                              meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
        pfile = save_partition(part, tmp / "digits.npz")
        for i, name in enumerate(names):
            kit = unpack_kit(write_kit(fb.state_dir, name, tmp / f"machine-{name}" / f"{name}.tar.gz")).parent
            path = device_toml(tmp / f"{name}.toml", kit / "credentials.toml", dataset="digits", partition_file=pfile,
                               client=i, state_dir=tmp / name)
            if privacy:
                path.write_text(path.read_text() + f"[privacy]\n{privacy}\n")
            devices.append(EdgeClient(load_device_config(path).edge, Credentials.load(kit / "credentials.toml"),
                                      client_data(digits, part.clients[i])))
        for dev in devices:
            dev.start()
        for dev in devices:
            assert dev.link.connected.wait(60)
        yield fb, devices
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()


def honest_to_masked(server: SecAggServer, clients: dict[str, SecAggClient], inputs: dict[str, np.ndarray]
                     ) -> tuple[dict[str, KeyAdvert], dict[str, np.ndarray]]:
    """The stages a lying coordinator runs honestly, through ``server``: every client's key advert, its shares, then
    its masked input of ``inputs[d]``; the adverts and the masked vectors, as the coordinator holds them."""
    adverts = {d: c.advertise() for d, c in clients.items()}
    for advert in adverts.values():
        server.receive_advert(advert)
    for d, c in clients.items():
        server.receive_shares(c.share_keys(server.key_bundle(d)))
    masked = {}
    for d, c in clients.items():
        msg = c.masked_input(server.shares_for(d), inputs[d])
        server.receive_masked(msg)
        masked[d] = msg.vector
    return adverts, masked


def spoil_shares(monkeypatch: Any, sender: str, victims: Callable[[SecAggClient], Collection[str]]) -> None:
    """``sender`` seals for each device ``victims(its client)`` names (among its neighbours of the round) what is no
    share at that device's x -- a share at its own x -- under the pair's genuine key and its own signature, as every
    sender signs what it sends (its own message: a ciphertext that does not authenticate would prove nothing of its
    sender, whoever routed it could have altered it, so its receiver would hold nothing of it and complain of
    nothing: test_attack_redteam3_complaint_keys)."""
    from flayer.secagg.client import SHARE_STAGE
    from flayer.secagg.signed_adverts import device_signs
    from flayer.secagg.signed_shares import sign_share

    real = SecAggClient.share_keys

    def share_keys(self: SecAggClient, bundle: Any) -> Any:
        out = real(self, bundle)
        if self.device != sender:
            return out
        p, chosen, spoiled = self.params, set(victims(self)) & set(self._peers), []
        for s in out.shares:
            r = s.receiver
            if r not in chosen:
                spoiled.append(s)
                continue
            key = keys.derive_aead_key(keys.agree(self._pairs[r].private, self._peers[r].c_pk), p.session, p.round,
                                       sender, r)
            x = p.x_of(sender)
            sealed = keys.seal(key, shamir.encode_share(x, 1) + shamir.encode_share(x, 2),
                               keys.associated_data(p.session, p.round, sender, r, SHARE_STAGE, p.transcript),
                               os.urandom)
            share = replace(s, ciphertext=sealed, signature=b"")
            signs = device_signs(self._consistency)
            if signs is not None:
                share = sign_share(p, share, self._pairs[r].public, self._peers[r].c_pk, signs[0])
            spoiled.append(share)
        return replace(out, shares=tuple(spoiled))

    monkeypatch.setattr(SecAggClient, "share_keys", share_keys)


def coordinator_round(names: tuple[str, ...]) -> tuple[Any, dict[str, SecAggClient], dict[str, Any]]:
    """The coordinator's protocol state of a secure round over ``names`` (coordinator.secure_round, its stage logic
    without a broker, stage limits of 5 s from t = 100), each device's client and a small update of its own."""
    from coordinator.secure_round import SecureRound
    from flayer.engine.secure import PlannedSecure, round_params
    from flayer.engine.secure_layout import layout_of
    from flayer.privacy_config import PrivacySettings
    from flayer.secagg import LocalIdentities, SeededEntropy
    from flayer.update import TensorDelta, Update

    ups = {d: Update({"w": TensorDelta((8,), np.random.default_rng(i).normal(0, 0.01, 3).astype(np.float32),
                                       np.array([1, 4, 6]))}, 10) for i, d in enumerate(names)}
    lay = layout_of(ups[names[0]])
    params, _ = round_params(PrivacySettings(secure_aggregation=True), "fed.1.x", 1, names, lay, 0)
    ids = LocalIdentities(names, SeededEntropy(bytes(32)))
    sec = SecureRound(PlannedSecure(params, lay.digest, False, 5.0), lay, stage_end=105.0, verify=ids.verify)
    return sec, {d: SecAggClient(params, d, consistency=ids.for_device(d)) for d in names}, ups


def to_shares(sec: Any, clients: dict[str, SecAggClient]) -> dict[str, Any]:
    """Every device advertises and shares; the share batches each is routed."""
    for d, c in clients.items():
        assert sec.receive(d, c.advertise().to_bytes()) is None
    bundles = {d: decode_message(b) for d, b in sec.advance(101.0)}
    for d, c in clients.items():
        assert sec.receive(d, c.share_keys(bundles[d]).to_bytes()) is None
    return {d: decode_message(b) for d, b in sec.advance(101.0)}


def send_masked(sec: Any, clients: dict[str, SecAggClient], ups: dict[str, Any], routed: dict[str, Any],
                device: str) -> str | None:
    """``device`` opens its shares, sends its complaints (before its masked input, as an edge client does), then its
    masked input; the coordinator's answer to the masked input."""
    from flayer.engine.secure import device_vector

    c = clients[device]
    masked = c.masked_input(routed[device], device_vector(ups[device], sec.layout, sec.planned.params,
                                                          np.random.default_rng(0)))
    for complaint in c.complaints():
        assert sec.receive(device, complaint.to_bytes()) is None
    return sec.masked(device, masked.to_bytes())


def unmask_all(sec: Any, clients: dict[str, SecAggClient], silent: Collection[str] = ()) -> Any:
    """The masked inputs' stage closed, every device asked consents, signs the survivor set and answers its unmask
    request (``silent``: those that answer nothing at the unmasking); the round's SecureSum."""
    asks = {d: decode_message(b) for d, b in sec.advance(103.0, masked_done=True)}
    for d, ask in asks.items():
        assert sec.receive(d, clients[d].consent(ask).to_bytes()) is None
    sets = {d: decode_message(b) for d, b in sec.advance(103.0)}
    for d, shown in sets.items():
        assert sec.receive(d, clients[d].sign_survivors(shown).to_bytes()) is None
    requests = {d: decode_message(b) for d, b in sec.advance(103.0)}
    for d, request in requests.items():
        if d not in silent:
            assert sec.receive(d, clients[d].unmask(request).to_bytes()) is None
    return sec.finish()
