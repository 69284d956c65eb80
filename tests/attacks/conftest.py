"""Attack tests: each guarantee the documentation states, attacked as the adversary would, with only what
the adversary holds, against real components. The federation and broker helpers are reused from their
folders (fedtestlib, broker_testlib); the harness's parts are in attacklib.py.

The harness (fixtures):

- ``attack_fed(devices, adversary="mallory", view="wide", federation="itest")``: a real Mosquitto on a free
  port with a broker state folder holding ``devices``' accounts and the coordinator's, stopped by PID after
  the test (the test is skipped where mosquitto is not installed). ``view`` is what the adversary holds
  (attacklib.VIEWS): ``"device"`` its own device account (added when not in ``devices``), ``"wide"`` the same
  with a mistaken ACL that lets it read and write ``fl/<federation>/#``, ``"observer"`` the broker's read-only
  observer, ``"coordinator"`` the coordinator's own credentials, ``"foreign"`` a device of another federation
  (its broker state folder, and CA where the broker has TLS, under ``tmp_path / "other"``),
  ``"none"`` no broker account at all (a local user of a host, whoever hands over a kit).
  It returns an ``AttackFed`` (a FedBroker): ``.adversary`` (its credentials), ``.listen(topics)`` (the
  adversary's recording connection), ``.send(rec, topic, payload, delivered=True)``, ``.coordinator_in(**toml)``
  (a real Coordinator, stopped after the test), ``.federation_config(**toml)``, ``.on_teardown(fn)``.
- ``digits_shard(index, clients=2)`` (tests/conftest.py): client ``index``'s iid shard of sklearn digits split
  across ``clients``, shared by the tests of a worker (nothing mutates it).
- ``attacklib.until(pred, timeout)``: whether a condition held in time.

A new attack test, e.g. a wide-ACL device replaying a plan to a real edge client::

    def test_replayed_plan_is_refused(attack_fed, digits_shard, tmp_path):
        fed = attack_fed(["dev-a"])                       # mallory, view "wide"
        mallory = fed.listen([fed.topics.round()])
        client = EdgeClient(EdgeSettings(state_dir=str(tmp_path / "a"), device="cpu"), fed.devices["dev-a"],
                            digits_shard(0))
        client.start(); fed.on_teardown(client.stop)
        fed.send(mallory, fed.topics.round(), recorded_plan, retain=True, delivered=True)
        assert not until(lambda: client.plan is not None, 2.0), "the replayed plan was taken"
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_TESTS = Path(__file__).resolve().parent.parent
for _sub in ("integration", "mqtt_broker"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / _sub))


@pytest.fixture
def attack_fed(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """A factory of federations with an adversary (module docstring); each is torn down after the test."""
    from attacklib import VIEWS, AttackFed, adversary_creds, widen_acl
    from fedtestlib import start_fed_broker

    from mqtt_broker import mosquitto_available
    from protocol import Topics

    made: list[AttackFed] = []

    def make(devices: list[str] | tuple[str, ...], adversary: str = "mallory", view: str = "wide",
             federation: str = "itest", kind: str = "mosquitto", **broker: Any) -> AttackFed:
        if view not in VIEWS:
            raise ValueError(f"unknown adversary view {view!r} (one of {', '.join(VIEWS)})")
        if kind == "mosquitto" and not mosquitto_available():
            pytest.skip("mosquitto is not installed")
        names = list(devices)
        if view in ("device", "wide") and adversary not in names:
            names.append(adversary)
        tmp = tmp_path if not made else tmp_path / f"fed-{len(made)}"
        fb = start_fed_broker(tmp, kind, names, federation=federation, **broker)
        fed = AttackFed(fb.broker, fb.state_dir, fb.devices, fb.coordinator, tmp=tmp, view=view,
                        topics=Topics(federation))
        made.append(fed)
        if view == "wide":
            widen_acl(fed, adversary)
        fed.adversary = adversary_creds(fed, view, adversary, tmp)
        return fed

    yield make
    for fed in reversed(made):
        fed.close()
