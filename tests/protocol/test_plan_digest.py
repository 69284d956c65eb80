"""The plan digest a secure round's transcript binds (protocol.plan_digest): every field but the re-published ones."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from protocol import Plan, decode_message, encode_message
from protocol.plan_digest import REPUBLISHED, SECURE_REPUBLISHED, plan_digest


def _plan() -> Plan:
    return Plan(round=3, selected=("dev-0", "dev-1", "dev-2"), deadline=100.0, strategy="fedavg",
                options={"mu": 0.01}, model={"name": "mlp", "num_classes": 10}, model_digest="a" * 64, model_chunks=2,
                model_size=2048, seed=7, train={"lr": 0.05}, privacy={"clip": 1.0},
                secure={"session": "f.3.ab", "threshold": 2, "void": ""}, close_by=90.0, issued=1.0)


# one other value per field of the plan: a field added to Plan without one here fails the test below
OTHER: dict[str, Any] = {
    "round": 4, "selected": ("dev-0", "dev-1", "dev-3"), "strategy": "fedprox", "options": {"mu": 0.02},
    "model": {"name": "mlp", "num_classes": 11}, "model_digest": "b" * 64, "model_chunks": 3, "model_size": 4096,
    "value_codec": "fp16", "compress": True, "phase": "calibrate", "seed": 8, "train": {"lr": 1e-30}, "rounds": 9,
    "max_update_bytes": 10, "mode": "async", "max_staleness": 2, "delta": {"base": "c" * 64},
    "upload_fit": {"lowest": "int8"}, "delta_chain": ("x",), "privacy": {"clip": 2.0},
    "secure": {"session": "f.3.ab", "threshold": 3, "void": ""}, "models_url": "https://models.example/m",
}


def test_every_field_not_listed_as_republished_is_bound() -> None:
    a = _plan()
    names = {f.name for f in dataclasses.fields(Plan)}
    assert names - REPUBLISHED == set(OTHER), "a plan field is neither bound (OTHER) nor listed in REPUBLISHED"
    for name, value in OTHER.items():
        assert plan_digest(dataclasses.replace(a, **{name: value})) != plan_digest(a), f"{name} is not bound"


@pytest.mark.parametrize("name", sorted(REPUBLISHED) + ["secure.void"])
def test_the_republished_fields_leave_the_digest_as_it_was(name: str) -> None:
    a = _plan()
    b = (dataclasses.replace(a, secure={**a.secure, "void": "f.1.cd f.2.ef"}) if name == "secure.void"
         else dataclasses.replace(a, **{name: getattr(a, name) + 50.0}))
    assert plan_digest(b) == plan_digest(a) and SECURE_REPUBLISHED == {"void"}


def test_the_digest_is_the_same_on_the_coordinator_and_on_the_device_that_decoded_its_plan() -> None:
    a = _plan()
    assert plan_digest(decode_message(encode_message(a, "f", "coordinator"))[1]) == plan_digest(a)  # type: ignore[arg-type]
    assert len(plan_digest(a)) == 32
