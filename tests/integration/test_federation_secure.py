"""Secure rounds over a real broker (docs/explanation/secure-aggregation.md): 4 edge devices (threads of this
process) and a coordinator run FLAYER for 2 rounds with ``secure_aggregation = true``; the coordinator folds
only each round's unmasked sum, which equals the in-process simulation of the same secure rounds (the same
protocol code) up to the ring's rounding. With a fifth, mute device that advertises its keys and then
vanishes, the round goes on with the survivors; a forged protocol message is refused and counted."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import device_toml, federation_toml, finished, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.config import TrainConfig
from flayer.partition import make_partition, save_partition
from flayer.privacy_config import PrivacySettings
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.train import client_data
from mqtt_broker import mosquitto_available
from protocol.metrics_schema import read_metrics

pytestmark = pytest.mark.integration
DEVICES = [f"dev-{i}" for i in range(4)]


def _federation(tmp: Path, fb: Any, devices: int, rounds: int, stage_s: float = 20.0, value_bits: int = 16) -> Path:
    """``value_bits``: the ring's resolution (28: fine enough to compare two runs' different roundings at 1e-5)."""
    fed = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                          strategy="flayer", rounds=rounds, dataset="digits", seed=0, lr=0.05, quorum=devices,
                          min_devices=devices, deadline_s=120.0)
    fed.write_text(fed.read_text() + f"[privacy]\nsecure_aggregation = true\nsecure_stage_s = {stage_s}\n"
                                     f"secure_value_bits = {value_bits}\n")
    return fed


@pytest.mark.timeout(300)
def test_secure_rounds_over_the_broker_fold_only_the_sum_and_equal_the_simulator(tmp_path: Path, digits: Any,
                                                                                  caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="coordinator")
    sent: list[tuple[str, int, int]] = []  # (device, round, bytes) of each masked input a device reports sent
    part = make_partition(digits.y, digits.num_classes, 4, "dir0.5", seed=0, samples=400,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp_path / "digits-4.npz")
    clients = [client_data(digits, c) for c in part.clients]
    strategy = make_strategy("flayer", digits.model_spec(), TrainConfig(lr=0.05, batch_size=10, local_epochs=1), {})
    reference = simulate(strategy, clients, 2, 0, privacy=PrivacySettings(secure_aggregation=True,
                                                                          secure_value_bits=28))
    plain = simulate(strategy, clients, 2, 0).global_state
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", DEVICES)
    devices: list[EdgeClient] = []
    try:
        coord = Coordinator(load_coordinator_config(_federation(tmp_path, fb, 4, 2, value_bits=28)), fb.coordinator)
        thread = coord.start()
        for i, name in enumerate(DEVICES):
            path = device_toml(tmp_path / f"{name}.toml", fb.state_dir / f"credentials/{name}.toml", dataset="digits",
                               partition_file=pfile, client=i, state_dir=tmp_path / name)
            devices.append(EdgeClient(load_device_config(path).edge, fb.devices[name], clients[i],
                                      on_progress=lambda kind, info, name=name: sent.append(
                                          (name, info["round"], info["bytes"])) if kind == "sent" else None))
            devices[-1].start()
        result = finished(coord, thread, 240, rounds=2)
        for dev in devices:
            assert dev.wait(60) and dev.error is None and dev.rounds_trained == [1, 2], dev.error
        # each device reports the masked input it sent, its real size (not 0 bytes)
        from coordinator.journal import journal_path, read_journal

        masked = sorted(len(rec.data) for rec in read_journal(journal_path(tmp_path / "coord/journal", 2)).updates)
        assert sorted(b for _, r, b in sent if r == 2) == masked and min(masked) > 0
        assert sorted((d, r) for d, r, _ in sent) == sorted((d, r) for d in DEVICES for r in (1, 2))
        # the coordinator's log says the round unmasked, and no norm bound it cannot apply to masked inputs
        said = [rec.getMessage() for rec in caplog.records]
        assert sum("secure round unmasked: the sum of 4 masked inputs" in m for m in said) == 2, said
        assert not any("update norm bound" in m for m in said), said
        worst = max(float((result.global_state[k] - reference.global_state[k]).abs().max()) for k in reference.global_state)
        assert worst <= 1e-5, f"secure rounds over MQTT differ from the simulated secure rounds by {worst:.3g}"
        assert max(float((plain[k] - result.global_state[k]).abs().max()) for k in plain) > 1e-4  # not the plain rule
        rounds = [r for r in read_metrics(tmp_path / "coord/metrics.jsonl") if r["kind"] == "round"]
        assert [r["secure_survivors"] for r in rounds] == [DEVICES, DEVICES]
        assert all(r["secure_abandoned"] is None and r["accepted"] == 4 and r["acc"] is not None for r in rounds)
        # the journal holds masked inputs only: no record decodes as an update
        from protocol import WireError, read_update_head

        recs = read_journal(journal_path(tmp_path / "coord/journal", 2)).updates
        assert len(recs) == 4
        for rec in recs:
            with pytest.raises(WireError):
                read_update_head(rec.data)
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()


class _MuteDevice:
    """Selected, advertises its keys for round 1 (and sends one forged message), then is never heard again."""

    def __init__(self, creds: Any) -> None:
        import time

        from fedtestlib import Recorder

        from protocol import Status, Topics, encode_message

        self.creds, self.t = creds, Topics("itest")
        self.rec = Recorder(creds, [self.t.round()])
        status = encode_message(Status(0, "online", time.time()), "itest", creds.username, key=creds.signer())
        self.rec.link.wait_published([self.rec.link.publish(self.t.status(creds.username), status, retain=True)], 5)

    def advertise_then_vanish(self) -> None:
        import hashlib
        import time

        from flayer.engine.secure import secure_from_plan
        from flayer.secagg import KeyAdvert, SecAggClient
        from protocol import Envelope, Kind, Status, decode_message, encode_message
        from protocol.plan_digest import plan_digest

        msg = self.rec.wait_message(lambda m: m.topic == self.t.round() and bool(m.payload), 60)
        assert msg is not None
        plan = decode_message(msg.payload)[1]
        planned = secure_from_plan(plan.secure, plan.round, tuple(plan.selected), plan_digest=plan_digest(plan))
        assert planned is not None and self.creds.username in plan.selected
        me = self.creds.username
        advert = SecAggClient(planned.params, me).advertise()
        forged = KeyAdvert(advert.round, "dev-0", advert.c_pk, advert.s_pk)  # in another device's name
        items = []
        for body in (forged.to_bytes(), advert.to_bytes()):
            env = Envelope(Kind.SECAGG, "itest", me, plan.round, 0, 1, len(body), hashlib.sha256(body).hexdigest(),
                           body)
            items.append((self.t.secagg(me), env.encode(self.creds.signer()), False))
        assert self.rec.link.publish_all(items, 10.0)
        # gone: the offline status its connection's will carries when the broker sees the link drop
        gone = encode_message(Status(0, "offline", time.time()), "itest", me, key=self.creds.signer())
        self.rec.link.wait_published([self.rec.link.publish(self.t.status(me), gone, retain=True)], 5)

    def close(self) -> None:
        self.rec.close()


@pytest.mark.timeout(300)
def test_a_device_that_vanishes_after_its_keys_leaves_the_survivors_sum(tmp_path: Path, digits: Any) -> None:
    part = make_partition(digits.y, digits.num_classes, 4, "dir0.5", seed=0, samples=400,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp_path / "digits-4.npz")
    clients = [client_data(digits, c) for c in part.clients]
    strategy = make_strategy("flayer", digits.model_spec(), TrainConfig(lr=0.05, batch_size=10, local_epochs=1), {})
    reference = simulate(strategy, clients, 1, 0, privacy=PrivacySettings(secure_aggregation=True,
                                                                          secure_value_bits=28))
    names = [*DEVICES, "mute"]
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", names)
    devices: list[EdgeClient] = []
    mute = _MuteDevice(fb.devices["mute"])
    try:
        fed = _federation(tmp_path, fb, 5, 1, stage_s=3.0, value_bits=28)
        fed.write_text(fed.read_text().replace("quorum = 5", "quorum = 4").replace("over_selection = 1.0",
                                                                                  "over_selection = 1.25"))
        coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
        thread = coord.start()
        for i, name in enumerate(DEVICES):
            path = device_toml(tmp_path / f"{name}.toml", fb.state_dir / f"credentials/{name}.toml", dataset="digits",
                               partition_file=pfile, client=i, state_dir=tmp_path / name)
            devices.append(EdgeClient(load_device_config(path).edge, fb.devices[name], clients[i]))
            devices[-1].start()
        mute.advertise_then_vanish()
        result = finished(coord, thread, 240, rounds=1)
        worst = max(float((result.global_state[k] - reference.global_state[k]).abs().max()) for k in reference.global_state)
        assert worst <= 1e-5, f"the survivors' secure sum differs from the 4-device simulation by {worst:.3g}"
        (rec,) = [r for r in read_metrics(tmp_path / "coord/metrics.jsonl") if r["kind"] == "round"]
        assert sorted(rec["selected"]) == sorted(names) and rec["secure_survivors"] == DEVICES
        assert rec["secure_abandoned"] is None and rec["rejected"].get("secure", 0) >= 1  # the forged advert
        assert any("naming 'dev-0', sent by 'mute'" in r["detail"] for r in rec["refusals"])
    finally:
        mute.close()
        for dev in devices:
            dev.stop()
        fb.broker.stop()


@pytest.mark.timeout(300)
def test_a_restarted_coordinator_abandons_the_secure_round_and_goes_on(tmp_path: Path, digits: Any) -> None:
    import threading

    part = make_partition(digits.y, digits.num_classes, 4, "dir0.5", seed=0, samples=400,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp_path / "digits-4.npz")
    clients = [client_data(digits, c) for c in part.clients]
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", DEVICES)
    devices: list[EdgeClient] = []
    masked = threading.Event()
    try:
        cfg = load_coordinator_config(_federation(tmp_path, fb, 4, 2))
        first = Coordinator(cfg, fb.coordinator,
                            on_progress=lambda kind, info: masked.set() if kind == "accepted" else None)
        thread = first.start()
        for i, name in enumerate(DEVICES):
            path = device_toml(tmp_path / f"{name}.toml", fb.state_dir / f"credentials/{name}.toml", dataset="digits",
                               partition_file=pfile, client=i, state_dir=tmp_path / name)
            devices.append(EdgeClient(load_device_config(path).edge, fb.devices[name], clients[i]))
            devices[-1].start()
        assert masked.wait(120), "no masked input arrived"
        first.stop()  # mid-protocol: masked inputs journaled, nothing unmasked
        thread.join(30)
        assert not thread.is_alive()
        g0 = first.global_state
        second = Coordinator(cfg, fb.coordinator)
        result = finished(second, second.start(), 240, rounds=2)
        rounds = [r for r in read_metrics(tmp_path / "coord/metrics.jsonl") if r["kind"] == "round"]
        assert [r["round"] for r in rounds] == [1, 2]
        assert "never resumed" in (rounds[0]["secure_abandoned"] or "") and rounds[0]["accepted"] == 0
        assert rounds[1]["secure_abandoned"] is None and rounds[1]["secure_survivors"] == DEVICES
        assert any(float((result.global_state[k] - g0[k]).abs().max()) > 0 for k in g0)  # round 2 folded
        for dev in devices:
            assert dev.wait(60) and dev.error is None and 2 in dev.rounds_trained, dev.error
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()


@pytest.mark.timeout(300)
def test_distributed_dp_over_the_broker_draws_the_noise_on_the_devices_in_the_ring(tmp_path: Path, digits: Any) -> None:
    from coordinator.journal import journal_path, read_journal
    from flayer.engine.privacy import RoundPrivacy
    from flayer.engine.secure import secure_from_plan
    from protocol import decode_message

    part = make_partition(digits.y, digits.num_classes, 4, "dir0.5", seed=0, samples=400,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp_path / "digits-4.npz")
    clients = [client_data(digits, c) for c in part.clients]
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", DEVICES)
    devices: list[EdgeClient] = []
    try:
        fed = _federation(tmp_path, fb, 4, 1)
        fed.write_text(fed.read_text() + 'enabled = true\nmode = "local"\nclip = 0.5\nnoise_multiplier = 1.0\n'
                                         'population = 40\n')
        coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
        thread = coord.start()
        for i, name in enumerate(DEVICES):
            path = device_toml(tmp_path / f"{name}.toml", fb.state_dir / f"credentials/{name}.toml", dataset="digits",
                               partition_file=pfile, client=i, state_dir=tmp_path / name)
            devices.append(EdgeClient(load_device_config(path).edge, fb.devices[name], clients[i]))
            devices[-1].start()
        result = finished(coord, thread, 240, rounds=1)
        (rec,) = [r for r in read_metrics(tmp_path / "coord/metrics.jsonl") if r["kind"] == "round"]
        assert rec["secure_abandoned"] is None and rec["secure_survivors"] == DEVICES and rec["epsilon"] > 0
        plan = decode_message(read_journal(journal_path(tmp_path / "coord/journal", 1)).plan)[1]
        rp, planned = RoundPrivacy.from_plan(plan.privacy), secure_from_plan(plan.secure, 1, tuple(plan.selected))
        assert rp is not None and rp.ring and rp.share_std == 0 and planned is not None
        assert planned.noise_std >= rp.sum_std / planned.params.threshold ** 0.5  # t shares: the round's noise
        assert all(bool(v.isfinite().all()) for v in result.global_state.values())
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_secure_rounds_fitted_to_the_devices_uplinks_mask_the_kept_share(tmp_path: Path, digits: Any) -> None:
    """The devices report a thin uplink (``[edge] uplink_kbps``): the coordinator plans a keep fraction below 1,
    every device masks the same kept positions, and each round is unmasked (flayer.engine.secure_fit)."""
    sent: list[tuple[str, int, int]] = []
    part = make_partition(digits.y, digits.num_classes, 4, "dir0.5", seed=0, samples=400,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp_path / "digits-4.npz")
    clients = [client_data(digits, c) for c in part.clients]
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", DEVICES)
    devices: list[EdgeClient] = []
    try:
        coord = Coordinator(load_coordinator_config(_federation(tmp_path, fb, 4, 2)), fb.coordinator)
        thread = coord.start()
        for i, name in enumerate(DEVICES):
            path = device_toml(tmp_path / f"{name}.toml", fb.state_dir / f"credentials/{name}.toml", dataset="digits",
                               partition_file=pfile, client=i, state_dir=tmp_path / name, uplink_kbps=2.0 + i,
                               upload="fit")
            devices.append(EdgeClient(load_device_config(path).edge, fb.devices[name], clients[i],
                                      on_progress=lambda kind, info, name=name: sent.append(
                                          (name, info["round"], info["bytes"])) if kind == "sent" else None))
            devices[-1].start()
        finished(coord, thread, 240, rounds=2)
        for dev in devices:
            assert dev.wait(60) and dev.error is None and dev.rounds_trained == [1, 2], dev.error
        rounds = [r for r in read_metrics(tmp_path / "coord/metrics.jsonl") if r["kind"] == "round"]
        assert all(r["secure_abandoned"] is None and r["secure_survivors"] == DEVICES for r in rounds), rounds
        assert all(0.1 <= r["secure_keep"] < 1 and r["secure_budget"] > 0 for r in rounds), rounds  # fit_min_keep
        sizes = [{b for _, rr, b in sent if rr == r["round"]} for r in rounds]  # every device masks the same share
        assert all(len(s) == 1 for s in sizes), sent
        # round 1 plans on the deadline (no history): the masked input within the budget; round 2 on round 1's
        # length (the plan's close_by), shorter: less kept, fewer bytes
        first, second = sizes[0].pop(), sizes[1].pop()
        assert first <= rounds[0]["secure_budget"] + 200, (rounds[0], sent)
        assert rounds[1]["secure_keep"] < rounds[0]["secure_keep"] and second < first, (rounds, sent)
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()
