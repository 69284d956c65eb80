"""One FedAvg round on digits over a broker FLAYER Edge did not configure (RabbitMQ's MQTT plugin, say).

The broker's users are made by hand (``--coordinator USER:PASSWORD``, ``--device USER:PASSWORD``); this
writes their credentials files, starts the coordinator in this process, waits ``--late-s`` seconds (the
round's plan and model are published retained meanwhile), then starts one edge client -- a device coming
online mid-round, which needs the retained plan and model chunks through its wildcard subscription -- and
prints what each side got within ``--timeout-s`` (docs/results/topologies.md, "Clustered broker")::

    python benchmarks/foreign_broker_federation.py --port 21883 --coordinator coordinator:PW --device dev-1:PW
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests/integration"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv: list[str] | None = None) -> int:
    from retained_probe import _user

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--coordinator", type=_user, required=True, help="USER:PASSWORD")
    ap.add_argument("--device", type=_user, required=True, help="USER:PASSWORD")
    ap.add_argument("--federation", default="foreign")
    ap.add_argument("--late-s", type=float, default=3.0)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args(argv)

    from fedtestlib import federation_toml

    from coordinator.config import load_coordinator_config
    from coordinator.server import Coordinator
    from edge_client.client import EdgeClient
    from edge_client.config import EdgeSettings
    from flayer.data import load_dataset
    from flayer.partition import make_partition
    from flayer.train import client_data
    from protocol import SigningKey
    from protocol.signing import render_key_registry
    from transport.credentials import Credentials

    out: dict[str, object] = {"broker": f"{args.host}:{args.port}"}
    with tempfile.TemporaryDirectory(prefix="foreign-broker-") as tmp:
        t = Path(tmp)
        creds = {}
        keys = {role: SigningKey.generate() for role in ("coordinator", "device")}  # what 'flayer broker' makes
        for role, (user, password) in (("coordinator", args.coordinator), ("device", args.device)):
            c = Credentials(args.federation, role, user, password, args.host, args.port, 1 << 20,
                            signing_key=keys[role].private_text(),
                            coordinator_key="" if role == "coordinator" else keys["coordinator"].public.text)
            (t / f"{user}.toml").write_text(c.to_toml())
            creds[role] = c
        path = federation_toml(t / "federation.toml", t / f"{args.coordinator[0]}.toml", t / "coord",
                               strategy="fedavg", rounds=1, dataset="digits", quorum=1, min_devices=1,
                               deadline_s=args.timeout_s)
        ds = load_dataset("digits")
        shard = client_data(ds, make_partition(ds.y, ds.num_classes, 2, "iid", 0).clients[0])
        (t / "signing_keys.json").write_text(render_key_registry(keys["coordinator"].public,
                                                                 {args.device[0]: keys["device"].public}))
        cfg = dataclasses.replace(load_coordinator_config(path), keys_file=t / "signing_keys.json")
        coord = Coordinator(cfg, creds["coordinator"])
        thread = coord.start()
        time.sleep(args.late_s)
        device = EdgeClient(EdgeSettings(state_dir=str(t / "dev"), client_index=0, device="cpu", heartbeat_s=1.0),
                            creds["device"], shard)
        t0 = time.monotonic()
        device.start()
        thread.join(args.timeout_s)
        out["coordinator_finished"] = not thread.is_alive()
        result = getattr(coord, "_thread_result", None)
        out["rounds_done"] = getattr(result, "rounds_done", None)
        out["device_rounds_trained"] = list(device.rounds_trained)
        out["device_error"] = str(device.error) if device.error else None
        out["seconds"] = round(time.monotonic() - t0, 1)
        device.stop()
        coord.stop()
        thread.join(10)
    print(json.dumps(out, indent=1))
    return 0 if out["rounds_done"] == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
