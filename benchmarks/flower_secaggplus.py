"""Flower's SecAgg+ on a dense model the size of FLAYER Edge's Fashion-MNIST CNN: bytes and CPU per client,
for the comparison on docs/results/secure-aggregation.md.

Runs in an environment of its own (Flower and Ray, no torch; nothing of this project is imported):

    python3 -m venv /tmp/flwr && /tmp/flwr/bin/pip install "flwr[simulation]"
    /tmp/flwr/bin/python benchmarks/flower_secaggplus.py --clients 10 --out runs/flower-secaggplus

Flower's simulation engine runs a ``ServerApp`` whose fit rounds go through ``SecAggPlusWorkflow`` and a
``ClientApp`` with ``secaggplus_mod``; the model is PFLlib's 4-layer CNN's arrays (582,026 float32 values,
conv 32x1x5x5, conv 64x32x5x5, fc 512x1024, fc 10x512 and biases) and a client's "training" adds Gaussian
noise of std 0.01 to them (the protocol's cost does not depend on the values). A mod outside
``secaggplus_mod`` records, per message a client receives, the serialised size (``message_to_proto``'s
protobuf ``ByteSize``: no transport framing) of the message in and of the reply out, and the client thread's
CPU seconds for everything inside it (the SecAgg+ stage and, in the masked-vector stage, the fit). The
global model travels inside the masked-vector stage's message (``FitIns``); it is reported apart so that
the protocol's bytes compare with the project's, whose model download is not a protocol message.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

SHAPES = [(32, 1, 5, 5), (32,), (64, 32, 5, 5), (64,), (512, 1024), (512,), (10, 512), (10,)]
STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="rounds (1: the model a client receives is the float32 start)")
    p.add_argument("--threshold", type=float, default=0.6, help="reconstruction threshold, share of the clients")
    p.add_argument("--out", default="runs/flower-secaggplus")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"messages-{args.clients}.jsonl"
    log.unlink(missing_ok=True)
    os.environ["FLOWER_SECAGG_LOG"] = str(log)  # read by the client processes (Ray workers)

    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.common.serde import message_to_proto
    from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation

    class Dense(NumPyClient):
        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            rng = np.random.default_rng()
            return [w + rng.normal(0, 0.01, w.shape).astype(np.float32) for w in parameters], 100, {}

    def size_mod(msg, ctx, call_next):  # type: ignore[no-untyped-def]
        size_in = message_to_proto(msg).ByteSize()
        t = time.thread_time()
        reply = call_next(msg, ctx)
        cpu = time.thread_time() - t
        with open(os.environ["FLOWER_SECAGG_LOG"], "a") as fh:
            fh.write(json.dumps({"node": ctx.node_id, "in": size_in, "out": message_to_proto(reply).ByteSize(),
                                 "cpu_s": cpu, "t": time.time()}) + "\n")
        return reply

    client_app = ClientApp(client_fn=lambda ctx: Dense().to_client(), mods=[size_mod, secaggplus_mod])
    start = [np.zeros(s, np.float32) for s in SHAPES]
    server_app = ServerApp()
    walls: list[float] = []

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_available_clients=args.clients,
                          min_fit_clients=args.clients, initial_parameters=ndarrays_to_parameters(start))
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=args.rounds), strategy=strategy)
        workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(
            num_shares=args.clients, reconstruction_threshold=max(2, math.ceil(args.threshold * args.clients))))
        t = time.time()
        workflow(grid, legacy)
        walls.append(time.time() - t)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    per_node: dict[int, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["t"]):
        per_node.setdefault(r["node"], []).append(r)
    model_bytes = sum(int(np.prod(s)) for s in SHAPES) * 4
    stage_rows = {s: [] for s in STAGES}
    for msgs in per_node.values():
        for i, m in enumerate(msgs):
            stage_rows[STAGES[i % 4]].append(m)
    result = {"clients": args.clients, "rounds": args.rounds, "values": model_bytes // 4, "model_bytes": model_bytes,
              "messages_per_client_round": len(rows) / args.clients / args.rounds,
              "wall_s_all_rounds": walls[0] if walls else None,
              "stages": {s: {"in_kb": float(np.mean([m["in"] for m in v])) / 1000,
                             "out_kb": float(np.mean([m["out"] for m in v])) / 1000,
                             "cpu_s": float(np.mean([m["cpu_s"] for m in v]))} for s, v in stage_rows.items() if v}}
    st = result["stages"]
    sent = sum(v["out_kb"] for v in st.values())
    received = sum(v["in_kb"] for v in st.values())
    result["per_client_round"] = {"sent_kb": sent, "received_kb": received,
                                  "received_without_model_kb": received - model_bytes / 1000,
                                  "cpu_s": sum(v["cpu_s"] for v in st.values())}
    (out / f"flower-{args.clients}.json").write_text(json.dumps(result, indent=1) + "\n")
    pc = result["per_client_round"]
    print(f"Flower SecAgg+ ({args.clients} clients, {result['values']:,} float32 values, "
          f"{result['messages_per_client_round']:.0f} messages a client a round)")
    for s, v in st.items():
        print(f"  {s:>22}: in {v['in_kb']:10.1f} KB  out {v['out_kb']:10.1f} KB  cpu {v['cpu_s']:.3f} s")
    print(f"  per client and round: sent {pc['sent_kb']:.1f} KB, received {pc['received_kb']:.1f} KB "
          f"({pc['received_without_model_kb']:.1f} KB without the {model_bytes / 1000:.1f} KB model), "
          f"sent + received without the model {pc['sent_kb'] + pc['received_without_model_kb']:.1f} KB, "
          f"client CPU {pc['cpu_s']:.3f} s; all rounds {result['wall_s_all_rounds']:.1f} s on the server")


if __name__ == "__main__":
    main()
