"""The emulator's per-device report (devices.jsonl) folded from the devices' event files, as a unit: a
device whose upload was accepted is listed as having trained that round even when its ``trained`` event
never came (an instance stopped between saving its upload and reporting the round; its next instance
re-sends the stored upload), and a re-sent update's ``duplicate`` ack is not a second accepted update."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from emulator.progress import FleetProgress
from emulator.report import device_rows, profile_rows


def _rows(events: list[dict[str, object]]) -> list[dict[str, object]]:
    devices = ("dev-000", "dev-001")
    progress = FleetProgress(dict(zip(devices, ("laptop", "flaky-field"))))
    for ev in events:
        progress.feed(ev)
    spec = SimpleNamespace(devices=devices, profile_of=("laptop", "flaky-field"), mine=lambda: [0, 1])
    return device_rows(SimpleNamespace(spec=spec, progress=progress, out=Path(".")))  # type: ignore[arg-type]


def test_an_accepted_update_counts_as_trained_without_its_trained_event() -> None:
    rows = _rows([
        {"kind": "online", "device": "dev-001"},
        {"kind": "offline", "device": "dev-001"},  # stopped after saving version 3's upload, before reporting it
        {"kind": "online", "device": "dev-001"},
        {"kind": "ack", "device": "dev-001", "round": 3, "status": "accepted"},  # the stored upload, re-sent
        {"kind": "trained", "device": "dev-000", "round": 2, "profile": "laptop"},
        {"kind": "ack", "device": "dev-000", "round": 2, "status": "accepted"},
        {"kind": "trained", "device": "dev-000", "round": 4, "profile": "laptop"},
        {"kind": "ack", "device": "dev-000", "round": 4, "status": "rejected"},
    ])
    by = {r["device"]: r for r in rows}
    assert by["dev-001"]["trained"] == [3] and by["dev-001"]["accepted"] == 1
    assert by["dev-000"]["trained"] == [2, 4] and by["dev-000"]["accepted"] == 1
    prof = {p["profile"]: p for p in profile_rows(rows)}
    assert prof["flaky-field"]["trained"] == 1 and prof["flaky-field"]["accepted"] == 1


def test_a_duplicate_ack_of_a_resent_update_is_the_same_accepted_update() -> None:
    rows = _rows([
        {"kind": "trained", "device": "dev-000", "round": 1, "profile": "laptop"},
        {"kind": "ack", "device": "dev-000", "round": 1, "status": "accepted"},
        {"kind": "ack", "device": "dev-000", "round": 1, "status": "duplicate"},  # the re-send after a timeout
    ])
    dev = next(r for r in rows if r["device"] == "dev-000")
    assert dev["trained"] == [1] and dev["accepted"] == 1
