"""Round time and exactly-once accounting: one Mosquitto against a clustered broker (Aedes nodes sharing Redis).

The same federation -- FedAvg on sklearn digits, iid shards, every device selected every round (quorum =
all), the coordinator and each device as its own ``flayer`` process -- runs once over one Mosquitto and
once over ``--nodes`` Aedes nodes (the coordinator on node 0, the devices on the others), and the two are
printed side by side: each round's wall time as the coordinator measured it (metrics.jsonl ``wall_s``),
the whole run's time, and the journal accounting of the fault suite (updates the devices saw
acknowledged, journal records, duplicates, updates folded) plus whether both runs end with the same
global model bit for bit. Uses the fault suite's helpers (tests/faults/faultlib.py)::

    python benchmarks/cluster_rounds.py --devices 5 --rounds 3 --nodes 3 --out runs/cluster-rounds
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for sub in ("", "tests/faults", "tests/integration", "tests/mqtt_broker"):
    sys.path.insert(0, str(ROOT / sub))


def _run(kind: str, tmp: Path, ds: Any, devices: list[str], rounds: int, nodes: int) -> dict[str, Any]:
    import faultlib
    from faultlib import accounting, check_accounting, proc_federation
    from fedtestlib import FedBroker, wait_connectable

    from mqtt_broker import BrokerConfig, add_device, load_credentials
    from mqtt_broker.cluster import start_cluster

    def cluster_broker(t: Path, devs: list[str], **cfg: Any) -> FedBroker:
        state = t / "broker"
        broker = start_cluster(BrokerConfig(federation=faultlib.FEDERATION, persistence=True, **cfg), state, nodes)
        for d in devs:
            add_device(state, d)
        broker.reload()
        creds = {d: load_credentials(state, d) for d in devs}
        for c in creds.values():
            wait_connectable(c)
        return FedBroker(broker, state, creds, load_credentials(state, "coordinator"))  # type: ignore[arg-type]

    original = faultlib.start_persistent_broker
    if kind == "cluster":
        faultlib.start_persistent_broker = cluster_broker  # type: ignore[assignment]
    try:
        fed = proc_federation(tmp, ds, devices, rounds=rounds)
    finally:
        faultlib.start_persistent_broker = original
    t0 = time.monotonic()
    try:
        for d in devices:
            fed.start_device(d)
        fed.start_coordinator()
        fed.wait_all(600)
        total = time.monotonic() - t0
    finally:
        fed.stop()
    acc = accounting(fed)
    check_accounting(acc, rounds)
    state = fed.final_state()
    return {
        "broker": "mosquitto" if kind == "mosquitto" else f"aedes cluster, {nodes} nodes + redis",
        "round_wall_s": [round(float(m["wall_s"]), 2) for m in fed.metrics()],
        "run_s": round(total, 1),
        "acked": len(acc.acked),
        "journaled": sum(acc.journaled.values()),
        "duplicates": sum(n - 1 for n in acc.journaled.values() if n > 1),
        "folded": acc.aggregated,
        "acked_not_journaled": len(acc.acked - set(acc.journaled)),
        "_state": state,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("runs/cluster-rounds"))
    args = ap.parse_args(argv)
    if not 1 <= args.devices <= 50 or not 1 <= args.rounds <= 50 or not 2 <= args.nodes <= 16:
        ap.error("--devices and --rounds must be 1-50, --nodes 2-16")
    from flayer.data import load_dataset
    from mqtt_broker import mosquitto_available
    from mqtt_broker.cluster import cluster_missing

    if not mosquitto_available() or cluster_missing():
        raise SystemExit(f"needs mosquitto and the cluster: {cluster_missing() or 'mosquitto missing'}")
    ds = load_dataset("digits")
    devices = [f"dev-{i}" for i in range(args.devices)]
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="cluster-rounds-") as tmp:
        for kind in ("mosquitto", "cluster"):
            results.append(_run(kind, Path(tmp) / kind, ds, devices, args.rounds, args.nodes))
    a, b = results[0].pop("_state"), results[1].pop("_state")
    import torch

    same = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    rows = [("broker", "broker"), ("round_wall_s", "round wall time (s)"), ("run_s", "whole run (s)"),
            ("acked", "updates acked to devices"), ("journaled", "journal records"), ("duplicates", "duplicates"),
            ("folded", "updates folded"), ("acked_not_journaled", "acked, not journaled")]
    print(f"{args.devices} devices, {args.rounds} rounds, FedAvg on digits, quorum = all")
    print(f"| {'':28} | {'one Mosquitto':32} | {'cluster':32} |")
    print(f"|{'-' * 30}|{'-' * 34}|{'-' * 34}|")
    for key, label in rows[1:]:
        print(f"| {label:28} | {results[0][key]!s:32} | {results[1][key]!s:32} |")
    print(f"same global model bit for bit: {same}")
    summary = {"devices": args.devices, "rounds": args.rounds, "nodes": args.nodes, "same_model": same,
               "runs": results, "command": " ".join(["python", "benchmarks/cluster_rounds.py", *(argv or sys.argv[1:])])}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
