"""A federation whose devices run from kits, for the attacks on certified device keys (test_attack_cert_*.py).

A real Mosquitto (its own port, stopped by PID), devices added one after another with the CLI's functions, and one
victim: a real :class:`edge_client.client.EdgeClient` started from its unpacked kit in its own folder. The other
devices of a secure round are played in process by their owners' keys (or by the adversary's, where the test says),
and the coordinator's side is the adversary's: its own credentials, the key bundle it writes, what it publishes.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedtestlib import FedBroker, Recorder, wait_connectable

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from flayer.engine.secure import round_ring, secure_from_plan
from flayer.secagg import (
    DeviceConsistency,
    KeyAdvert,
    SecAggClient,
    SecAggServer,
    ServerConsistency,
    ShareBatch,
    decode_message,
)
from mqtt_broker import BrokerConfig, add_device, load_credentials, start_broker
from mqtt_broker.kit import write_kit
from protocol import Envelope, Kind, Plan, SigningKey, Topics, decode_envelope, encode_message
from protocol.plan_digest import plan_digest
from protocol.signing import advert_signer, survivor_signer
from transport.credentials import Credentials
from transport.kit import unpack_kit

FED = "itest"
T = Topics(FED)
VICTIM = "dev-b"
RUN_SEED = 7


def secure_terms(round_: int, cohort: int) -> dict[str, Any]:
    seed = hashlib.sha256(f"secagg-graph:{RUN_SEED}:{round_}".encode()).digest()
    return {"session": f"{FED}.{round_}.ab", "threshold": cohort, "degree": cohort - 1, "graph_seed": seed.hex(),
            "length": 8, "bits": round_ring(1.0, cohort, 16).bits, "value_bits": 16, "layout": "ab" * 32,
            "adaptive": False, "stage_s": 10.0, "noise_std": 0.0, "bound": 1.0, "value_range": 1.0,
            "corrupt_fraction": 0.0, "run_seed": RUN_SEED, "dropout": 0.1}


@dataclass
class KitFed:
    tmp: Path
    fb: FedBroker
    kits: dict[str, Path] = field(default_factory=dict)  # device -> its kit's unpacked folder
    victim: EdgeClient | None = None
    coord: Recorder | None = None

    @property
    def state(self) -> Path:
        return self.fb.state_dir

    def add(self, device: str) -> Credentials:
        """``flayer broker add-device DEV --kit``: the device, its kit unpacked on "its machine"."""
        add_device(self.state, device, exist_ok=True)
        self.fb.broker.reload()
        kit = write_kit(self.state, device, self.tmp / f"machine-{device}" / f"{device}.tar.gz")
        self.kits[device] = unpack_kit(kit).parent
        wait_connectable(self.creds(device))
        return self.creds(device)

    def creds(self, device: str) -> Credentials:
        return Credentials.load(self.kits[device] / "credentials.toml")

    def cert(self, device: str) -> bytes:
        """The certificate ``device``'s kit holds (empty: a kit without one); an honest device carries it in its
        key adverts."""
        path = self.kits[device] / "device.cert"
        return path.read_bytes() if path.exists() else b""

    def admin(self, *args: str) -> int:
        """The admin's command line on the broker's machine: ``flayer broker ARGS --state-dir STATE``."""
        from cli.main import main

        return main(["broker", *args, "--state-dir", str(self.state)])

    def renew(self, device: str) -> None:
        """The device restarted from the new kit beside the old one, in the same folder."""
        self.kits[device] = unpack_kit(self.tmp / f"machine-{device}" / f"{device}.tar.gz").parent

    def restart_victim(self, shard: Any) -> EdgeClient:
        assert self.victim is not None
        self.victim.stop()
        return self.start_victim(shard)

    def start_victim(self, shard: Any) -> EdgeClient:
        settings = EdgeSettings(state_dir=str(self.kits[VICTIM] / "state"), client_index=1, device="cpu",
                                heartbeat_s=2.0)
        self.victim = EdgeClient(settings, self.creds(VICTIM), shard)
        self.victim.start()
        if self.coord is None:
            self.coord = Recorder(self.fb.coordinator, [T.all_secagg()])
        return self.victim

    def victim_shares(self, round_: int, cohort: tuple[str, ...], keys: dict[str, SigningKey],
                      wait_s: float = 6.0, certs: dict[str, bytes] | None = None) -> bool:
        """The adversarial coordinator's round: a secure plan naming ``cohort``, the victim's advert, the others'
        adverts signed with ``keys`` (their owners' keys, or the ones the adversary holds) and carrying ``certs``
        (default: each device's kit certificate), the victim's key bundle. True when the victim answered with its
        shares (it believed every advert of its bundle)."""
        certs = certs or {}
        assert self.coord is not None
        terms = secure_terms(round_, len(cohort))
        plan = Plan(round_, cohort, time.time() + 600, "fedavg", {}, {"name": "mlp"}, "ab" * 32, 1, 100,
                    seed=RUN_SEED, secure=terms)
        planned = secure_from_plan(terms, round_, cohort, plan_digest=plan_digest(plan))  # bound to the whole plan
        assert planned is not None
        server = SecAggServer(planned.params, ServerConsistency(lambda *_: True))  # it checks nothing itself
        payload = encode_message(plan, FED, "coordinator", key=self.fb.coordinator.signer())
        assert self.coord.link.wait_published([self.coord.link.publish(T.round(), payload, retain=True)], 5)
        advert = self._from_victim(KeyAdvert, 20, round_)
        assert advert is not None, f"the victim sent no key advert for round {round_} ({self.victim and self.victim.error!r})"
        server.receive_advert(advert)
        for d in cohort:
            if d != VICTIM:
                k = keys[d]
                consistency = DeviceConsistency(survivor_signer(k, FED, round_, d), lambda *_: True, 0.0,
                                                advert_signer(k, FED, round_, d), lambda *_: True,
                                                certs[d] if d in certs else self.cert(d))
                server.receive_advert(SecAggClient(planned.params, d, consistency=consistency).advertise())
        body = server.key_bundle(VICTIM).to_bytes()
        env = Envelope(Kind.SECAGG, FED, "coordinator", round_, 0, 1, len(body), hashlib.sha256(body).hexdigest(),
                       body)
        assert self.coord.link.wait_published([self.coord.link.publish(
            T.secreq(VICTIM), env.encode(self.fb.coordinator.signer()))], 5)
        return self._from_victim(ShareBatch, wait_s, round_) is not None

    def _from_victim(self, kind: type, timeout: float, round_: int) -> Any:
        assert self.coord is not None

        def match(m: Any) -> bool:
            if m.topic != T.secagg(VICTIM):
                return False
            env = decode_envelope(m.payload)
            return env.round == round_ and isinstance(decode_message(env.body), kind)

        got = self.coord.wait_message(match, timeout)
        return None if got is None else decode_message(decode_envelope(got.payload).body)

    def close(self) -> None:
        if self.victim is not None:
            self.victim.stop()
        if self.coord is not None:
            self.coord.close()
        self.fb.broker.stop()


def kit_federation(tmp: Path, first: list[str], together: bool = False) -> KitFed:
    """A Mosquitto and ``first`` devices, each with its kit (more come with :meth:`KitFed.add`); ``together``:
    every device is added before any kit is made (each kit then knows them all, however it does)."""
    state = tmp / "broker"
    broker = start_broker(BrokerConfig(federation=FED), state, kind="mosquitto", timeout=30)
    fed = KitFed(tmp, FedBroker(broker, state, {}, load_credentials(state, "coordinator")))
    try:
        for d in first if together else ():
            add_device(state, d)
        for d in first:
            fed.add(d)
    except BaseException:
        broker.stop()
        raise
    return fed


def own_keys(fed: KitFed, devices: tuple[str, ...]) -> dict[str, SigningKey]:
    return {d: fed.creds(d).signer() for d in devices}
