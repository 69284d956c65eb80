"""Attack tests: each guarantee the documentation states, attacked as the adversary would, with only what
the adversary holds, against real components. The federation and broker helpers are reused from their
folders (fedtestlib, broker_testlib); the harness's parts are in attacklib.py.

The harness:

- ``attack_fed(devices, adversary="mallory", view="wide", federation="itest", kind="mosquitto", at=None,
  **broker_config)`` (fixture): a real Mosquitto on a free loopback port (``kind="embedded"``: the embedded
  broker), its state folder ``tmp_path / "broker"`` (``at / "broker"``) with the accounts of ``devices`` and
  of the coordinator; the test is skipped where mosquitto is not installed. Everything it started is stopped
  after the test, the broker by its PID (checked gone). ``view`` is what the adversary holds
  (attacklib.VIEWS):

  - ``"device"``: its own device account ``adversary`` (added when not in ``devices``), the device ACL;
  - ``"wide"``: the same, with a mistaken ACL that lets it read and write ``fl/<federation>/#``;
  - ``"observer"``: the broker's read-only observer account;
  - ``"coordinator"``: the coordinator's own credentials (a coordinator acting as the adversary);
  - ``"foreign"``: ``adversary`` of another federation (its own password; its own CA where the broker
    has TLS), state under ``tmp_path / "other"``;
  - ``"none"``: no broker account (another local user of a host, whoever hands over a kit).

  It returns an ``AttackFed`` (a fedtestlib.FedBroker): ``.adversary`` (its credentials), ``.listen(topics)``
  (a recording connection as the adversary), ``.send(rec, topic, payload, retain=, delivered=True)``,
  ``.coordinator_in(**federation_toml)`` (a real Coordinator, stopped after the test; ``.thread``),
  ``.federation_config(**federation_toml)``, ``.on_teardown(fn)``, ``.topics``, and broker_testlib's
  ``.files`` and ``.creds``.
- ``digits_shard(index, clients=2)`` (tests/conftest.py): client ``index``'s iid shard of sklearn digits,
  made once per worker (nothing changes it).
- attacklib: ``until(pred, timeout)``; ``widen_acl(fed, user)`` (again after a revoke rewrote the ACL);
  ``brokerless_coordinator(cfg, creds, clock, keys)``: a real Coordinator whose loop the test drives with no
  broker, for the attacks on what the coordinator does with what it receives.

A new attack test, a wide-ACL device replaying a recorded plan to a real edge client::

    from attacklib import until

    def test_a_replayed_plan_is_refused(tmp_path, attack_fed, digits_shard):
        fed = attack_fed(["dev-a"])  # mallory, with the mistaken ACL
        mallory = fed.listen([fed.topics.round()])
        client = EdgeClient(EdgeSettings(state_dir=str(tmp_path / "a"), device="cpu"), fed.devices["dev-a"],
                            digits_shard(0))
        client.start()
        fed.on_teardown(client.stop)
        fed.send(mallory, fed.topics.round(), RECORDED_PLAN, retain=True, delivered=True)
        assert not until(lambda: client.plan is not None, 2.0), "dev-a took the replayed plan"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def attack_fed(fed_broker: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """A factory of federations with an adversary (module docstring); each is torn down after the test."""
    from attacklib import VIEWS, AttackFed, adversary_creds, widen_acl

    from protocol import Topics

    made: list[AttackFed] = []

    def make(devices: list[str] | tuple[str, ...], adversary: str = "mallory", view: str = "wide",
             federation: str = "itest", kind: str = "mosquitto", at: Path | None = None,
             **broker: Any) -> AttackFed:
        if view not in VIEWS:
            raise ValueError(f"unknown adversary view {view!r} (one of {', '.join(VIEWS)})")
        names = list(devices)
        if view in ("device", "wide") and adversary not in names:
            names.append(adversary)
        fb = fed_broker(names, kind=kind, federation=federation, at=at, **broker)
        fed = AttackFed(fb.broker, fb.state_dir, fb.devices, fb.coordinator, tmp=fb.state_dir.parent,
                        view=view, topics=Topics(federation))
        made.append(fed)
        if view == "wide":
            widen_acl(fed, adversary)
        fed.adversary = adversary_creds(fed, view, adversary, fed.tmp)
        return fed

    yield make
    for fed in reversed(made):
        fed.close()
