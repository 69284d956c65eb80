"""The attack harness's parts (the fixtures that hand them out are in conftest.py): a federation on a real
Mosquitto with the adversary's account and view, and the small waits every attack test needs."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fedtestlib import FedBroker, Recorder, federation_toml

from mqtt_broker import BrokerConfig, Credentials, add_device, load_credentials, write_broker_files
from mqtt_broker.state import BrokerFiles
from protocol import Topics
from protocol.topics import OBSERVER_USER

log = logging.getLogger(__name__)

# What the adversary holds (its credentials) and what the broker lets it read and send:
#   "device"      a device's own account with the device ACL (its own topics; the plan, the model, its acks)
#   "wide"        a device account a mistaken ACL (a bridge, a broker defect) lets read and write fl/<fed>/#
#   "observer"    the broker's read-only observer account (flayer status, the dashboard)
#   "coordinator" the coordinator's own credentials: a coordinator acting as the adversary
#   "foreign"     a device of another federation (its own CA and password, the same name)
#   "none"        no account on the broker (a local user of a host, whoever hands over a kit or a file)
VIEWS = ("device", "wide", "observer", "coordinator", "foreign", "none")


def until(pred: Callable[[], Any], timeout: float, step: float = 0.05) -> bool:
    """Whether ``pred()`` held within ``timeout`` seconds (polled every ``step``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def brokerless_coordinator(cfg: Any, creds: Credentials, clock: Callable[[], float],
                           keys: dict[str, Any] | None = None, drop_acks: bool = True,
                           **kw: Any) -> tuple[Any, list[Any]]:
    """A real Coordinator (``cfg``, its own ``creds``) whose loop the test drives (``_tick``, ``events``) with
    no broker: the plans it would publish are recorded in the list returned beside it, models are not
    published and (``drop_acks``) acks are dropped. ``keys``: the devices' signing keys, as the broker's key
    registry holds them. For the attacks on what the coordinator does with what it receives."""
    from coordinator.server import Coordinator

    plans: list[Any] = []
    c = Coordinator(cfg, creds, clock=clock, **kw)
    setattr(c.publishing, "model", lambda round_, rnd: setattr(c.publishing, "chunks", 1))  # noqa: B010 -- no broker
    setattr(c.publishing, "publish_plan", lambda phase, rnd, cal=None: plans.append(c.publishing.plan(phase, rnd, cal)))  # noqa: B010
    setattr(c.publishing.publisher, "clear_old_models", lambda: 0)  # noqa: B010
    setattr(c.publishing.publisher, "plan", lambda plan: plans.append(plan) or 0)  # noqa: B010
    if drop_acks:
        setattr(c.inbox, "ack", lambda *a, **k: None)  # noqa: B010
    c.cfg.state_dir.mkdir(parents=True, exist_ok=True)
    c.cycle.restore()
    if keys is not None:
        c.device_keys.keys = {d: k.public for d, k in keys.items()}
    return c, plans


def open_round(c: Any, plans: list[Any], devices: list[str], now: float) -> Any:
    """Every device of ``devices`` heard online by the brokerless coordinator ``c``, then one tick: the plan of the
    round it opened."""
    from protocol import Status

    for d in devices:
        c.registry.observe(d, Status(0, "online", now), now)
    c._tick()
    assert c.open is not None
    return plans[-1]


def upload(c: Any, device: str, plan: Any, update: Any, key: Any) -> None:
    """``device``'s ``update`` for ``plan``, chunked on its own update topic and signed with its own ``key``, as the
    brokerless coordinator ``c`` receives it."""
    from protocol import Kind, Topics, UpdateHeader, chunk_blob, encode_update
    from transport.link import Received

    fed = c.creds.federation
    blob = encode_update(update, UpdateHeader(fed, plan.round, device, plan.model_digest))
    for k, chunk in enumerate(chunk_blob(blob, Kind.UPDATE_CHUNK, fed, device, plan.round, 100_000, key=key)):
        c.intake.on_message(Received(Topics(fed).update_chunk(device, plan.round, k), chunk, False))


def image_folder(folder: Path, classes: int, per_class: int, side: int) -> Path:
    """``folder`` holding ``per_class`` random ``side`` x ``side`` grey PNG images in a subfolder per class (``0``,
    ``1``, ...): an image folder as a device's ``--data`` reads it."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (folder / str(c)).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (side, side), dtype=np.uint8), "L").save(folder / str(c) / f"{i}.png")
    return folder


def widen_acl(fb: FedBroker, user: str) -> None:
    """The mistaken ACL: ``user`` may read and write every topic of the federation (applied by a reload)."""
    fed = fb.coordinator.federation
    with open(fb.state_dir / "acl", "a") as fh:
        fh.write(f"\nuser {user}\ntopic readwrite fl/{fed}/#\n")
    fb.broker.reload()
    time.sleep(0.3)  # the reload is applied asynchronously


@dataclass
class AttackFed(FedBroker):
    """A federation on a real broker: ``devices`` (honest ones and, for the device views, the adversary's own
    account), the coordinator's credentials, and the adversary (``adversary``: its credentials, ``view``: what
    they let it do). What :meth:`listen` and :meth:`coordinator_in` start is stopped after the test."""

    tmp: Path = Path()
    view: str = "device"
    adversary: Credentials | None = None
    topics: Topics = field(default_factory=lambda: Topics("itest"))
    _cleanups: list[Callable[[], Any]] = field(default_factory=list)

    @property
    def federation(self) -> str:
        return self.coordinator.federation

    @property
    def files(self) -> BrokerFiles:
        """The broker state folder's files (as broker_testlib's RunningBroker has them)."""
        return BrokerFiles.at(self.state_dir)

    @property
    def creds(self) -> dict[str, Credentials]:
        """Every account of the federation by name, the coordinator's included (as RunningBroker has them)."""
        return {**self.devices, "coordinator": self.coordinator}

    def listen(self, subscribe: list[str] | None = None, creds: Credentials | None = None,
               clean_session: bool = True) -> Recorder:
        """A connection of the adversary (or of ``creds``) subscribed to ``subscribe``, closed after the
        test."""
        creds = creds if creds is not None else self.adversary
        assert creds is not None, f"the {self.view} view has no account of its own to connect with"
        rec = Recorder(creds, subscribe, clean_session=clean_session)
        self._cleanups.append(rec.close)
        return rec

    def send(self, rec: Recorder, topic: str, payload: bytes, retain: bool = False,
             delivered: bool = False) -> None:
        """``rec`` publishes ``payload`` on ``topic``; with ``delivered`` (a reading view only), also that the
        broker delivered it back (the positive control that the attack was made)."""
        assert rec.link.wait_published([rec.link.publish(topic, payload, retain=retain)], 5)
        if delivered:
            assert rec.wait_message(lambda m: m.topic == topic and m.payload == payload, 5) is not None, \
                f"the broker did not deliver the adversary's message on {topic}: the attack was not made"

    def federation_config(self, name: str = "federation.toml", state: str = "coord", **settings: Any) -> Path:
        """A coordinator's federation.toml over this broker (``federation_toml``'s keywords; strategy fedavg,
        one round of digits unless given)."""
        kw: dict[str, Any] = {"strategy": "fedavg", "rounds": 1, "dataset": "digits", **settings}
        creds = self.state_dir / "credentials/coordinator.toml"
        return federation_toml(self.tmp / name, creds, self.tmp / state, **kw)

    def coordinator_in(self, config: Path | None = None, **settings: Any) -> Any:
        """A real Coordinator started over this broker (its config: ``config`` or :meth:`federation_config` of
        ``settings``); stopped after the test. Its thread is ``coord.thread``."""
        from coordinator.config import load_coordinator_config
        from coordinator.server import Coordinator

        cfg = load_coordinator_config(config or self.federation_config(**settings))
        coord = Coordinator(cfg, self.coordinator)
        thread = coord.start()
        coord.thread = thread  # type: ignore[attr-defined]

        def stop() -> None:
            coord.stop()
            thread.join(30)

        self._cleanups.append(stop)
        return coord

    def on_teardown(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` after the test, before the broker stops (e.g. an edge client's ``stop``)."""
        self._cleanups.append(fn)

    def close(self) -> None:
        for fn in reversed(self._cleanups):
            try:
                fn()
            except Exception:  # teardown goes on: the broker must stop whatever failed before
                log.warning("an attack harness teardown step failed", exc_info=True)
        self._cleanups.clear()
        pid = self.broker.pid
        self.broker.stop()
        stat = Path(f"/proc/{pid}/stat")  # stopped by its PID: gone, or a zombie not yet reaped
        gone = not stat.exists() or "Z" in stat.read_text().split(")")[-1][:3]
        assert gone, f"the broker (PID {pid}) still runs"


def adversary_creds(fb: FedBroker, view: str, name: str, tmp: Path) -> Credentials | None:
    """The adversary's credentials of ``view`` (VIEWS) in ``fb``'s federation; ``name`` is its account's name
    for the device views (a device of ``fb`` already) and the foreign device's."""
    if view in ("device", "wide"):
        return fb.devices[name]
    if view == "observer":
        return load_credentials(fb.state_dir, OBSERVER_USER)
    if view == "coordinator":
        return fb.coordinator
    if view == "none":
        return None
    if view == "foreign":
        tls = fb.coordinator.tls is not None  # another federation's CA where this one has TLS
        cfg = BrokerConfig(federation="other", tls=tls, persistence=False)
        other = write_broker_files(cfg, tmp / "other")
        own = add_device(other.state_dir, name)  # its own password and certificate, pointed at this broker
        return replace(own, host=fb.coordinator.host, port=fb.coordinator.port)
    raise ValueError(f"unknown adversary view {view!r} (one of {', '.join(VIEWS)})")


class ProtocolDevice:
    """A device's account driven by hand at the protocol level (an adversary that is a device of the federation):
    its own signed retained status every 2 s while ``online`` (as a device heartbeats), and secure-round messages
    signed with its own key on its own ``secagg`` topic. ``rec`` records the round plans and its ``secreq``."""

    def __init__(self, creds: Credentials, federation: str = "itest", cert: bytes = b"", away_s: float = 6.0) -> None:
        self.creds, self.t, self.me, self.cert, self.away_s = creds, Topics(federation), creds.username, cert, away_s
        self.rec = Recorder(creds, [self.t.round(), self.t.secreq(self.me)])
        self.online, self.closed = True, threading.Event()
        self.status("online")
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _heartbeat(self) -> None:
        while not self.closed.wait(2.0):
            if self.online:
                self.status("online")

    def status(self, state: str) -> None:
        from protocol import Status, encode_message

        body = encode_message(Status(0, state, time.time()), self.creds.federation, self.me, key=self.creds.signer())
        self.rec.link.wait_published([self.rec.link.publish(self.t.status(self.me), body, retain=True)], 5)

    def send(self, round_: int, body: bytes) -> None:
        from protocol import Envelope, Kind

        env = Envelope(Kind.SECAGG, self.creds.federation, self.me, round_, 0, 1, len(body),
                       hashlib.sha256(body).hexdigest(), body)
        assert self.rec.link.publish_all([(self.t.secagg(self.me), env.encode(self.creds.signer()), False)], 10.0)

    def keys_shares_then_away(self, after: int = 0, timeout: float = 120.0) -> int | None:
        """Take part in the first plan after round ``after`` that selects this device -- its key advert (with its
        certificate, if it has one) and its shares, signed with its own key -- then go offline for ``away_s`` (its
        own status: a signer that cannot come) and come back; its round (None: no such plan came)."""
        import os

        from flayer.engine.secure import secure_from_plan
        from flayer.secagg import DeviceConsistency, KeyBundle, SecAggClient, decode_message
        from protocol import decode_envelope
        from protocol import decode_message as decode_wire
        from protocol.plan_digest import plan_digest
        from protocol.signing import advert_signer, survivor_signer

        def mine(m: Any) -> bool:
            if m.topic != self.t.round() or not m.payload:
                return False
            plan = decode_wire(m.payload)[1]
            return plan.round > after and self.me in plan.selected

        msg = self.rec.wait_message(mine, timeout)
        if msg is None:
            return None
        plan = decode_wire(msg.payload)[1]
        planned = secure_from_plan(plan.secure, plan.round, tuple(plan.selected), plan_digest=plan_digest(plan))
        assert planned is not None
        fed, signer = self.creds.federation, self.creds.signer()
        cons = DeviceConsistency(survivor_signer(signer, fed, plan.round, self.me), lambda *a: True, 0.0,
                                 advert_signer(signer, fed, plan.round, self.me), lambda *a: True, self.cert)
        client = SecAggClient(planned.params, self.me, os.urandom, cons)
        self.send(plan.round, client.advertise().to_bytes())

        def bundle(m: Any) -> bool:
            if m.topic != self.t.secreq(self.me):
                return False
            env = decode_envelope(m.payload)
            return env.round == plan.round and isinstance(decode_message(env.body), KeyBundle)

        got = self.rec.wait_message(bundle, 60)
        assert got is not None, "no key bundle came"
        self.send(plan.round, client.share_keys(decode_message(decode_envelope(got.payload).body)).to_bytes())
        time.sleep(0.5)
        self.online = False
        self.status("offline")
        time.sleep(self.away_s)
        self.online = True
        self.status("online")
        return plan.round

    def close(self) -> None:
        self.closed.set()
        self.rec.close()

