"""Two shards of one fleet from two "hosts": network namespaces with their own addresses on this machine
(:mod:`emulator.netns`), one broker. Host 0 runs the broker (bound to its own address, 10.77.x.1) and
shard 0 (which starts the coordinator); host 1 runs shard 1, whose devices reach the broker only over the
namespaces' bridge. The coordinator sees one fleet of six, the broker's log shows each device connecting
from its own host's address, and the namespaces are gone at the end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from emutestlib import ROOT, finish, read_jsonl, wait_until

from emulator.netns import NetnsHosts, available

pytestmark = [pytest.mark.integration, pytest.mark.slow,  # ~60 s: a broker, a coordinator, two launchers
              pytest.mark.skipif(available() is not None, reason=str(available()))]

COMMON = ["--dataset", "digits", "--strategy", "fedavg", "--partition", "iid", "--lr", "0.05", "--timeout",
          "240", "--clients", "6", "--rounds", "2", "--mix", "jetson-orin", "--quorum", "6", "--over-selection",
          "1.0", "--min-devices", "6", "--workers", "1"]


def on_host(hosts: NetnsHosts, k: int, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as fh:
        return subprocess.Popen([*hosts.exec_prefix(k), sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def test_two_shards_from_two_namespaces_form_one_fleet(tmp_path: Path) -> None:
    hosts = NetnsHosts(f"fl{os.getpid() % 100000}", 2, f"10.77.{os.getpid() % 200 + 20}.0/24")
    state, a, b = tmp_path / "broker", tmp_path / "shard0", tmp_path / "shard1"
    procs: list[subprocess.Popen[bytes]] = []
    with hosts:
        broker = on_host(hosts, 0, ["broker", "start", "--state-dir", str(state), "--host", hosts.address(0),
                                    "--port", "0", "--federation", "twohosts"], tmp_path / "broker.log")
        try:
            assert broker.wait(60) == 0, (tmp_path / "broker.log").read_text()
            p0 = on_host(hosts, 0, ["emulate", *COMMON, "--shard", "0/2", "--broker-state", str(state), "--out",
                                    str(a)], tmp_path / "shard0.log")
            procs.append(p0)
            wait_until(lambda: (a / "fleet.json").exists() or p0.poll() is not None, 120, "shard 0's setup")
            assert p0.poll() is None, (tmp_path / "shard0.log").read_text()[-3000:]
            p1 = on_host(hosts, 1, ["emulate", *COMMON, "--shard", "1/2", "--broker-state", str(state), "--out",
                                    str(b)], tmp_path / "shard1.log")
            procs.append(p1)
            rc0, rc1 = finish(p0, 300), finish(p1, 120)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait(60)
            stop = on_host(hosts, 0, ["broker", "stop", "--state-dir", str(state)], tmp_path / "broker-stop.log")
            stop.wait(60)
    existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert not set(hosts.names()) & set(existing.split()), existing  # removed
    assert rc0 == 0, (tmp_path / "shard0.log").read_text()[-3000:]
    assert rc1 == 0, (tmp_path / "shard1.log").read_text()[-3000:]
    everyone = [f"dev-{i:03d}" for i in range(6)]
    opens = [e for e in read_jsonl(a / "coordinator/events.jsonl") if e["kind"] == "open"]
    assert [e["selected_ids"] for e in opens] == [everyone, everyone]  # both hosts' devices, every round
    assert all(e["known"] == 6 for e in opens)
    assert [r["reported"] for r in read_jsonl(a / "rounds.jsonl")] == [6, 6]
    for out, mine in ((a, everyone[0::2]), (b, everyone[1::2])):
        devs = read_jsonl(out / "devices.jsonl")
        assert [d["device"] for d in devs] == mine
        assert all(d["trained"] == [1, 2] and d["final_acc"] is not None for d in devs)
    # the broker saw each device come from its own host's address
    came_from = {dev: addr for addr, dev in re.findall(r"New client connected from ([\d.]+):\d+ as (dev-\d+)",
                                                       (state / "broker.log").read_text())}
    assert came_from == {d: hosts.address(0) if i % 2 == 0 else hosts.address(1) for i, d in enumerate(everyone)}, came_from
