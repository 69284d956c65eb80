"""Whole emulated fleets over a real broker: ``flayer emulate`` with 10 devices runs 2 rounds; devices a
trace keeps offline are never selected; two shards on one machine form one fleet.

Each run is the real thing: a broker process, the coordinator process and worker processes, started
and stopped by the launcher (``flayer emulate`` in a child process of the test, stopped by PID)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from emutestlib import emulate, events_of, finish, read_jsonl, wait_until

from protocol.metrics_schema import read_metrics

pytestmark = pytest.mark.integration

# always on; "steady" is shaped (8 Mbit/s up) and 20x slower than this host (digits rounds take ~20 ms)
PROFILES = """
[profile.steady]
slowdown = 20.0
up_mbps = 8.0
down_mbps = 40.0
up_latency_ms = 20.0
down_latency_ms = 20.0
[mix]
jetson-orin = 0.5
steady = 0.5
"""
COMMON = ["--dataset", "digits", "--strategy", "fedavg", "--partition", "iid", "--lr", "0.05", "--timeout",
          "240"]


def test_ten_devices_run_two_rounds(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(PROFILES)
    out = tmp_path / "run"
    proc = emulate([*COMMON, "--clients", "10", "--rounds", "2", "--profiles", str(profiles), "--quorum",
                    "10",
                    "--over-selection", "1.0", "--min-devices", "10", "--federation", "fleet10", "--out",
                    str(out)],
                   tmp_path / "emulate.log")
    rc = finish(proc, 300)
    log = (tmp_path / "emulate.log").read_text()
    assert rc == 0, log[-4000:]
    assert "round 2/2: 10/10 reported" in log and "2/2 rounds in" in log and f"outputs in {out}" in log
    rows = read_jsonl(out / "rounds.jsonl")
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["selected"] == 10 and r["reported"] == 10 and r["acc"] is not None for r in rows)
    metrics = [m for m in read_metrics(out / "coordinator/metrics.jsonl") if m["kind"] == "round"]
    unified = read_metrics(out / "metrics.jsonl")  # the emulator's own, same schema
    assert [m["kind"] for m in unified] == ["run", "round", "round", "end"]
    assert all(m["source"] == "emulate" and m["reported"] == 10 and m["bytes_down"] > 0 for m in unified[1:3])
    assert [m["accepted"] for m in metrics] == [10, 10]
    model_mb = metrics[0]["model_bytes"] / 1e6
    assert all(r["mb_down"] >= 10 * model_mb and r["mb_up"] > 0 for r in rows)
    devices = read_jsonl(out / "devices.jsonl")
    assert len(devices) == 10 and all(d["trained"] == [1, 2] and d["final_acc"] is not None for d in devices)
    assert {d["profile"] for d in devices} == {"jetson-orin", "steady"}
    # the slowdown hook stretched the steady devices' rounds to 20x the CPU time they took here
    compute = [e for e in events_of(out) if e["kind"] == "compute"]
    profile = {d["device"]: d["profile"] for d in devices}
    assert len(compute) == 20
    for e in compute:
        factor = 20.0 if profile[e["device"]] == "steady" else 0.5
        assert e["waited_s"] == pytest.approx(max(0.0, factor * e["cpu_s"] - e["wall_s"]),
                                              abs=(factor + 2) * 1e-4)
    assert any(e["waited_s"] > 0 for e in compute if profile[e["device"]] == "steady")
    for name in ("accuracy.png", "bytes.png", "device_accuracy.png", "summary.json"):
        assert (out / name).stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and summary["devices"] == 10 and summary["network"] == "thread"


@pytest.mark.slow  # ~18 s; selection of online devices is unit-tested in tests/coordinator
def test_devices_marked_offline_are_never_selected(tmp_path: Path) -> None:
    ids = [f"dev-{i:03d}" for i in range(10)]
    trace = tmp_path / "trace.csv"
    rows = ["device_id,start_s,end_s"] + [f"{d},0,inf" for d in ids[:7]]
    rows += ["dev-007,1000000,1000001", "8,1000000,inf", "dev-009,12,inf"]  # 7 and 8 offline; 9 joins at 12 s
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    proc = emulate([*COMMON, "--clients", "10", "--rounds", "4", "--mix", "jetson-orin", "--trace",
                    str(trace),
                    "--quorum", "4", "--over-selection", "1.5", "--min-devices", "6", "--federation",
                    "offline",
                    "--out", str(out)], tmp_path / "emulate.log")
    rc = finish(proc, 300)
    assert rc == 0, (tmp_path / "emulate.log").read_text()[-4000:]
    coord = read_jsonl(out / "coordinator/events.jsonl")
    opens = [e for e in coord if e["kind"] == "open"]
    assert [e["round"] for e in opens] == [1, 2, 3, 4]
    events = events_of(out)
    wrap = min(e["t"] for e in events if e["kind"] == "wrap_up")
    joined = min(e["t"] for e in events if e["kind"] == "online" and e["device"] == "dev-009")
    for e in opens:
        assert not {"dev-007", "dev-008"} & set(e["selected_ids"]), e
        assert e["online"] <= 8
        if e["t"] < joined:
            assert "dev-009" not in e["selected_ids"], e
    assert not [e for e in events if e.get("device") in ("dev-007", "dev-008") and e["kind"] == "online"
                and e["t"] < wrap], "offline devices connected before the federation ended"
    devices = {d["device"]: d for d in read_jsonl(out / "devices.jsonl")}
    assert devices["dev-007"]["trained"] == devices["dev-008"]["trained"] == []
    assert devices["dev-007"]["final_acc"] is not None  # came online after the end, saved its personal model
    assert sum(len(d["trained"]) for d in devices.values()) == sum(
        r["selected"] for r in read_jsonl(out / "rounds.jsonl"))


@pytest.mark.slow  # ~21 s; the default run keeps test_ten_devices_run_two_rounds
def test_two_shards_on_one_machine_form_one_fleet(tmp_path: Path) -> None:
    args = [*COMMON, "--clients", "6", "--rounds", "2", "--mix", "jetson-orin", "--quorum", "6",
            "--over-selection",
            "1.0", "--min-devices", "6", "--workers", "1", "--federation", "sharded"]
    a, b = tmp_path / "shard0", tmp_path / "shard1"
    p0 = emulate([*args, "--shard", "0/2", "--out", str(a)], tmp_path / "shard0.log")
    p1 = None
    try:
        wait_until(lambda: (a / "fleet.json").exists() or p0.poll() is not None, 120, "shard 0's broker")
        assert p0.poll() is None, (tmp_path / "shard0.log").read_text()[-3000:]
        p1 = emulate([*args, "--shard", "1/2", "--broker-state", str(a / "broker"), "--out", str(b)],
                     tmp_path / "shard1.log")
        rc0, rc1 = finish(p0, 300), finish(p1, 120)
    finally:
        for p in (p0, p1):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(60)
    assert rc0 == 0, (tmp_path / "shard0.log").read_text()[-3000:]
    assert rc1 == 0, (tmp_path / "shard1.log").read_text()[-3000:]
    everyone = [f"dev-{i:03d}" for i in range(6)]
    opens = [e for e in read_jsonl(a / "coordinator/events.jsonl") if e["kind"] == "open"]
    assert [e["selected_ids"] for e in opens] == [everyone, everyone]  # both shards' devices, every round
    assert all(e["known"] == 6 for e in opens)  # the coordinator's registry holds the whole fleet
    assert [r["reported"] for r in read_jsonl(a / "rounds.jsonl")] == [6, 6]
    for out, mine in ((a, everyone[0::2]), (b, everyone[1::2])):
        devs = read_jsonl(out / "devices.jsonl")
        assert [d["device"] for d in devs] == mine
        assert all(d["trained"] == [1, 2] and d["final_acc"] is not None for d in devs)
    assert "round 2/2: 6 selected, 3 on this shard" in (tmp_path / "shard1.log").read_text()
