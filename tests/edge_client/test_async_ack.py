"""Asynchronous rounds on the device: the coordinator's ack of an accepted update names the version whose
buffer took it (``Ack.version``), and the device does not train on that version again (a second update
from it would be refused ``in_buffer``: one update per device per version), even when the plan it holds
lists it; from the next version on it trains. After a refusal it trains on the newest version at once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from edge_client.client import EdgeClient
from edge_client.download import Pending
from edge_client.jobs import Jobs
from edge_client.store import StoredState, UploadRecord
from protocol import Ack, Kind, Plan, decode_message, encode_message

DIGEST = "cd" * 32


class _Store:
    def save(self, stored: Any) -> None:
        pass


class _Device(Jobs):
    def __init__(self, plan: Plan) -> None:
        self.id, self.plan, self._busy, self.store = "dev-1", plan, False, _Store()
        self.stored = StoredState(None, 1, UploadRecord(1, DIGEST, 10))
        self._pending = Pending("update", 1, DIGEST, [])
        self._early_acks: list[Ack] = []
        self.replanned: list[int] = []

    def _on_plan(self, plan: Plan) -> None:
        self.replanned.append(plan.round)

    def _set_state(self, name: str) -> None:
        pass

    def _progress(self, kind: str, **info: Any) -> None:
        pass


def _async_plan(round_: int, mode: str = "async") -> Plan:
    return Plan(round=round_, selected=("dev-1",), deadline=0.0, strategy="flayer", options={}, model={},
                model_digest="ab" * 32, model_chunks=1, model_size=1, mode=mode, max_staleness=8)


def _trains_on(stored: StoredState, plan: Plan) -> bool:
    dev = SimpleNamespace(id="dev-1", stored=stored, _budget_refuses=lambda plan: False)  # no [privacy] here
    return EdgeClient._trains_on(dev, plan)  # type: ignore[arg-type]


def test_the_ack_names_the_buffers_version_and_round_trips() -> None:
    _, ack = decode_message(encode_message(Ack(1, "dev-1", DIGEST, "accepted", "", 2), "fed", "coord"), kind=Kind.ACK)
    assert isinstance(ack, Ack) and ack.version == 2
    dev = _Device(_async_plan(2))  # trained from version 1, folded into version 2's buffer
    dev._on_ack(ack)
    assert dev.stored.extra["folded_into"] == 2 and dev._pending is None and dev.stored.upload.status == "accepted"


def test_a_device_does_not_train_on_the_version_that_took_its_update() -> None:
    stored = StoredState(None, 1, UploadRecord(1, DIGEST, 10, "accepted"), extra={"folded_into": 2})
    assert not _trains_on(stored, _async_plan(2))  # the plan still lists it: its update is in version 2
    assert _trains_on(stored, _async_plan(3))
    assert _trains_on(StoredState(None, 1, extra={"folded_into": 2}), _async_plan(2, mode="sync")) is True
    assert not _trains_on(StoredState(None, 2), _async_plan(2))  # trained on it already


def test_a_refused_update_trains_on_the_newest_version_at_once() -> None:
    dev = _Device(_async_plan(3))
    dev._on_ack(Ack(1, "dev-1", DIGEST, "late", "trained from version 1, 2 behind"))
    assert dev.replanned == [3] and dev.stored.upload.status == "late" and "folded_into" not in dev.stored.extra
