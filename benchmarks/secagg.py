"""What secure aggregation costs: protocol bytes and CPU per cohort size, and accuracy and round time in simulation.

**Part a, protocol cost** (pure :mod:`flayer.secagg`, in process). The vector is FLAYER's public-positions
upload of PFLlib's 4-layer CNN on Fashion-MNIST (``ModelSpec("cnn", 1, 28, 28, 10)``), taken from one local
round on 20 synthetic samples (its positions do not depend on the data: they come from the round's public
seed). For each cohort n, design dropout rate (k and t by :func:`flayer.secagg.neighbour_count`, as
``[privacy] secure_dropout`` picks them) and actual dropout rate (round(rate * n) devices drawn at random,
seeded, each dropping after a step drawn uniformly over after_keys / after_shares / after_masked), one
round is run by a driver that mirrors :func:`flayer.secagg.run_round`'s stage loop -- every message through
its bytes; checked against ``run_round`` itself before any measurement -- and times each call with
``time.thread_time``: the coordinator's SecAggServer calls, each device's SecAggClient calls, and apart from
both the message codec (encode by the sender, decode by the receiver). Python's cyclic garbage collector is
off during the round (in process, one collection over all n devices' state would land in one device's
call). The unmasked sum is checked against the sum of the survivors' inputs. Beside it: the plain sparse
upload of the same values as the project's codec sends them (``protocol.update_sizer()``: fp32 values and
coded positions).

**Part b, accuracy and round time** (``flayer simulate`` in a subprocess, one torch thread): FLAYER on
Fashion-MNIST Dir(0.1), all clients selected, plain rounds at public positions (what secure rounds use) and at
its top-k positions (seed 0), ``--secure-agg``, ``--secure-agg --secure-drop 0.1``, and (seed 0) central DP with
and without ``--secure-agg``, and distributed DP in the ring (``--dp local --secure-agg``).

Every finished measurement is cached under ``--out`` (part a: ``cost/<key>.json``; part b: ``runs/<name>-<key>/``),
keyed by its settings and a digest of the code it measures, so an interrupted run resumes; the tables go to
``results.md``, every measured field to ``cost.json`` and ``simulate.json`` (part b's upload column is what the
run records: the codec's bytes in plain rounds, every protocol message sent and received in secure ones)::

    python benchmarks/secagg.py --out docs/results/secure-aggregation           # both parts
    python benchmarks/secagg.py --part a --out docs/results/secure-aggregation
    python benchmarks/secagg.py --quick                                        # smoke size, under /tmp
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def code_digest(*patterns: str, extra: str = "") -> str:
    """SHA-256 (12 hex) over the files matching ``patterns`` under the repository, and ``extra``."""
    h = hashlib.sha256(extra.encode())
    for pattern in patterns:
        for path in sorted(ROOT.glob(pattern)):
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def key_of(settings: dict[str, Any], code: str) -> str:
    return hashlib.sha256((json.dumps(settings, sort_keys=True) + code).encode()).hexdigest()[:12]


# ---- part a: protocol cost ----------------------------------------------------------------------

def fmnist_upload(length: int | None) -> tuple[Any, int, int, int]:
    """(FLAYER's public-positions Update of the Fashion-MNIST CNN, its codec bytes, the model's coordinates, the
    codec bytes of a dense fp32 update of the whole model); ``length`` cuts the update to that many values."""
    import torch

    from flayer.config import TrainConfig
    from flayer.engine import initial_global_state
    from flayer.models import ModelSpec
    from flayer.strategies import make_strategy
    from flayer.strategies.base import RoundContext
    from flayer.train import ClientData, Split
    from flayer.update import TensorDelta, Update
    from protocol import update_sizer

    torch.set_num_threads(1)
    spec = ModelSpec("cnn", in_channels=1, height=28, width=28, num_classes=10)
    strategy = make_strategy("flayer", spec, TrainConfig(device="cpu", lr=0.05), {"positions": "public"})
    g = initial_global_state(strategy, 0)
    gen = torch.Generator().manual_seed(0)

    def split(n: int) -> Split:
        return Split(torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=gen),
                     torch.randint(0, 10, (n,), generator=gen), torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))

    data, ctx = ClientData(split(20), split(10), split(10)), RoundContext(round=1, client=0, seed=0)
    update = strategy.local_round(strategy.receive(g, strategy.initial_state(), data, ctx), g,
                                  strategy.initial_state(), data, ctx).update
    if length is not None:  # the first ``length`` values in the layout's (sorted name) order
        deltas, left = {}, length
        for name in sorted(update.deltas):
            d = update.deltas[name]
            if left <= 0:
                break
            idx = np.arange(int(np.prod(d.shape))) if d.indices is None else d.indices
            take = min(left, d.values.size)
            deltas[name] = TensorDelta(d.shape, d.values.reshape(-1)[:take].copy(), idx[:take].copy())
            left -= take
        update = Update(deltas, update.num_samples, dict(update.info))
    dense = Update({n: TensorDelta(tuple(t.shape), np.full(int(t.numel()), 1e-3, dtype=np.float32), None)
                    for n, t in g.items()}, 1, {})
    numel = sum(int(t.numel()) for t in g.values())
    sizer = update_sizer()
    return update, sizer(update), numel, sizer(dense)


def drive(params: Any, vector_of: Callable[[str], np.ndarray], drops: dict[str, str], seed: bytes) -> dict[str, Any]:
    """One round as :func:`flayer.secagg.run_round` runs it, with each party's calls timed (thread CPU s)."""
    from flayer.secagg import (
        SecAggAbandoned,
        SecAggClient,
        SecAggError,
        SecAggServer,
        decode_message,
        neighbour_graph,
    )
    from flayer.secagg.local import _entropy_for

    # every party derives the round's graph once; in process they share ``params.graph``, so it is built here,
    # timed apart, and kept out of the calls' times
    t0 = time.thread_time()
    neighbour_graph(params.participants, params.degree, params.graph_seed)
    graph_s = time.thread_time() - t0
    assert params.graph

    ids = params.participants
    stats = {d: {"up": 0, "down": 0, "msgs": 0, "cpu": 0.0, "codec": 0.0} for d in ids}
    server_cpu = {"advertise": 0.0, "share": 0.0, "mask": 0.0, "unmask": 0.0, "result": 0.0}
    server_codec, refusals = [0.0], {}
    expected = np.zeros(params.length, dtype=np.uint32)

    def timed(add: Callable[[float], None], fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            add(time.thread_time() - t0)

    def carry(msg: Any, device: str, up: bool) -> Any:
        """Encode on the sender's clock, decode on the receiver's; count the bytes on the device."""
        def dev(dt: float) -> None:
            stats[device]["codec"] += dt

        def srv(dt: float) -> None:
            server_codec[0] += dt

        raw = timed(dev if up else srv, msg.to_bytes)
        stats[device]["up" if up else "down"] += len(raw)
        stats[device]["msgs"] += 1
        return timed(srv if up else dev, decode_message, raw)

    server = SecAggServer(params)
    clients = {d: SecAggClient(params, d, _entropy_for(seed, d)) for d in ids}
    alive = [d for d in ids if drops.get(d) != "before_keys"]

    def on_device(d: str) -> Callable[[float], None]:
        return lambda dt: stats[d].__setitem__("cpu", stats[d]["cpu"] + dt)

    def on_server(stage: str) -> Callable[[float], None]:
        return lambda dt: server_cpu.__setitem__(stage, server_cpu[stage] + dt)

    def step(leaving: str | None, stage: str) -> None:
        nonlocal alive, expected
        still, c, s = [], clients, server
        for d in alive:
            dev, srv = on_device(d), on_server(stage)
            try:
                if stage == "advertise":
                    timed(srv, s.receive_advert, carry(timed(dev, c[d].advertise), d, True))
                elif stage == "share":
                    bundle = carry(timed(srv, s.key_bundle, d), d, False)
                    timed(srv, s.receive_shares, carry(timed(dev, c[d].share_keys, bundle), d, True))
                elif stage == "mask":
                    shares = carry(timed(srv, s.shares_for, d), d, False)
                    x = vector_of(d)
                    timed(srv, s.receive_masked, carry(timed(dev, c[d].masked_input, shares, x), d, True))
                    expected += x
                else:
                    request = carry(timed(srv, s.unmask_request, d), d, False)
                    timed(srv, s.receive_unmask, carry(timed(dev, c[d].unmask, request), d, True))
            except SecAggError as exc:
                refusals[d] = str(exc)
                continue
            if drops.get(d) != leaving:
                still.append(d)
        alive = still

    t0 = time.perf_counter()
    reason, correct = None, None
    gc.collect()
    gc.disable()  # a collection over n devices' in-process state would land in one device's call
    try:
        step("after_keys", "advertise")
        step("after_shares", "share")
        step("after_masked", "mask")
        step(None, "unmask")
        total = timed(on_server("result"), server.result)
        correct = bool(np.array_equal(total, expected & np.uint32(params.ring.modulus - 1)))  # the ring keeps the sum mod 2^bits
    except SecAggAbandoned as exc:
        reason = exc.reason
    finally:
        gc.enable()
    wall = time.perf_counter() - t0
    done = [] if reason else [d for d in ids if d not in drops and d not in refusals]  # answered the unmask stage
    per = lambda key: [stats[d][key] for d in done]
    both = [stats[d]["up"] + stats[d]["down"] for d in done]
    return {
        "k": params.degree, "t": params.threshold, "length": params.length, "participants": len(ids),
        "survivors": len(server.survivors), "dropped_after_shares": len(server.dropped),
        "planned_drops": {p: sum(1 for v in drops.values() if v == p) for p in sorted(set(drops.values()))},
        "completing": len(done), "abandoned": reason, "sum_correct": correct, "refusals": refusals,
        "bytes_mean": statistics.fmean(both) if both else None, "bytes_max": max(both, default=None),
        "up_mean": statistics.fmean(per("up")) if done else None, "up_max": max(per("up"), default=None),
        "messages_mean": statistics.fmean(per("msgs")) if done else None,
        "messages_max": max(per("msgs"), default=None),
        "device_cpu_mean": statistics.fmean(per("cpu")) if done else None,
        "device_cpu_max": max(per("cpu"), default=None),
        "device_codec_mean": statistics.fmean(per("codec")) if done else None,
        "server_cpu": sum(server_cpu.values()), "server_cpu_by_stage": server_cpu,
        "server_codec": server_codec[0], "graph_s": graph_s, "wall_s": wall,
    }


def check_driver() -> None:
    """AssertionError unless :func:`drive` gives :func:`flayer.secagg.run_round`'s sum and per-device bytes
    (12 devices, a dropout at each step): the timed driver must be the library's round, not another."""
    from flayer.secagg import RingSpec, SecAggParams, run_round

    ids = tuple(f"client-{i}" for i in range(12))
    params = SecAggParams.for_round("check", 1, ids, 50, RingSpec.for_summands(8.0, 12), bytes(32), 0.1)
    rng = np.random.default_rng(0)
    vectors = {d: rng.integers(0, 2**32, 50, dtype=np.uint32) for d in ids}
    drops = {"client-1": "after_keys", "client-2": "after_shares", "client-3": "after_masked"}
    ours = drive(params, vectors.__getitem__, drops, b"check")
    ref = run_round(params, vectors, drops, seed=b"check", consistency=False)  # type: ignore[arg-type]
    assert ref.ring_sum is not None and ours["sum_correct"], "the driver's round did not unmask the sum"
    assert ours["survivors"] == len(ref.survivors) and ours["dropped_after_shares"] == len(ref.dropped)
    done = [d for d in ids if d not in drops]
    assert ours["bytes_mean"] == statistics.fmean(ref.bytes_per_device[d] for d in done), "bytes differ"


def planned_drops(ids: tuple[str, ...], rate: float, seed: int) -> dict[str, str]:
    """round(rate * n) devices, drawn without replacement, each dropping after a step drawn uniformly from
    after_keys / after_shares / after_masked (:data:`flayer.engine.secure.DROP_STAGES`)."""
    from flayer.engine.secure import DROP_STAGES

    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(ids), size=round(rate * len(ids)), replace=False)
    return {ids[int(i)]: DROP_STAGES[int(rng.integers(len(DROP_STAGES)))] for i in sorted(chosen)}


def cost_one(out: Path, n: int, design: float, drop: float, length: int | None, seed: int) -> dict[str, Any]:
    """One protocol-cost measurement, cached in ``out/cost/<key>.json``."""
    from flayer.engine.secure import round_params
    from flayer.engine.secure_layout import flatten, layout_of
    from flayer.privacy_config import PrivacySettings
    from flayer.secagg import encode
    from flayer.strategies.base import derive_seed

    settings = {"n": n, "design_dropout": design, "dropout": drop, "length": length, "seed": seed}
    code = code_digest("flayer/secagg/*.py", "flayer/engine/secure*.py", "flayer/strategies/flayer.py",
                       "flayer/masks.py", "protocol/update_codec.py",
                       extra=inspect.getsource(drive) + inspect.getsource(fmnist_upload))
    path = out / "cost" / f"{key_of(settings, code)}.json"
    if path.exists():
        return json.loads(path.read_text())
    update, plain_bytes, numel, dense_bytes = fmnist_upload(length)
    layout = layout_of(update)
    values = flatten(update, layout)
    ids = tuple(f"client-{i}" for i in range(n))
    privacy = PrivacySettings(secure_aggregation=True, secure_dropout=design)
    params, _ = round_params(privacy, "bench", 1, ids, layout, seed)
    drops = planned_drops(ids, drop, seed)
    vector_of = lambda d: encode(values, params.ring, np.random.default_rng(derive_seed(seed, 1, d, "secagg")))
    t0 = time.perf_counter()
    row = drive(params, vector_of, drops, hashlib.sha256(f"bench:{seed}".encode()).digest())
    print(f"cost n={n} design={design} drop={drop}: k={row['k']} t={row['t']} {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    row.update(settings=settings, code=code, plain_bytes=plain_bytes, values=int(values.size),
               model_numel=numel, dense_bytes=dense_bytes, clip_range=privacy.secure_clip_range or 8.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=1) + "\n")
    return row


def cost_table(rows: list[dict[str, Any]]) -> str:
    header = ("| n | design dropout: k, t | dropout | dropped after keys/shares/masked | survivors "
              "| messages per device | KB per device sent+received: mean / max | KB sent: mean "
              "| KB sent+received beyond the masked values (4 B each) | plain sparse upload KB "
              "| expansion (sent+received / plain) | expansion (sent / plain) | coordinator CPU s "
              "| device CPU s: mean / max | graph build s (each party) | sum exact |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, pd = r["settings"], r["planned_drops"]
        drops = "/".join(str(pd.get(p, 0)) for p in ("after_keys", "after_shares", "after_masked"))
        if r["bytes_mean"] is None:
            lines.append(f"| {s['n']} | {s['design_dropout']:g}: {r['k']}, {r['t']} | {s['dropout']:g} | {drops} "
                         f"| abandoned: {r['abandoned']} |||||||||||")
            continue
        lines.append(
            f"| {s['n']:,} | {s['design_dropout']:g}: {r['k']}, {r['t']} | {s['dropout']:g} | {drops} "
            f"| {r['survivors']:,} | {r['messages_mean']:.0f} | {r['bytes_mean'] / 1e3:,.1f} / {r['bytes_max'] / 1e3:,.1f} "
            f"| {r['up_mean'] / 1e3:,.1f} | {(r['bytes_mean'] - 4 * r['length']) / 1e3:,.1f} "
            f"| {r['plain_bytes'] / 1e3:,.1f} | {r['bytes_mean'] / r['plain_bytes']:.3f} "
            f"| {r['up_mean'] / r['plain_bytes']:.3f} | {r['server_cpu']:.3f} "
            f"| {r['device_cpu_mean']:.3f} / {r['device_cpu_max']:.3f} | {r['graph_s']:.3f} "
            f"| {'yes' if r['sum_correct'] else 'no' if r['sum_correct'] is False else '-'} |")
    return "\n".join(lines) + "\n"


# ---- part b: accuracy and round time --------------------------------------------------------------

VARIANTS: dict[str, list[str]] = {
    "plain-public": ["--set", "flayer.positions=public"],
    "plain-topk": [],
    "secure": ["--secure-agg"],
    "secure-drop0.1": ["--secure-agg", "--secure-drop", "0.1"],
    "dp": ["--dp", "central", "--dp-clip", "1.0", "--dp-noise", "0.86", "--dp-delta", "1e-3"],
    "dp-secure": ["--dp", "central", "--dp-clip", "1.0", "--dp-noise", "0.86", "--dp-delta", "1e-3", "--secure-agg"],
    "dp-distributed": ["--dp", "local", "--dp-clip", "1.0", "--dp-noise", "0.86", "--dp-delta", "1e-3", "--secure-agg"],
}
LABELS = {"plain-public": "plain, public positions", "plain-topk": "plain, top-k positions",
          "secure": "secure", "secure-drop0.1": "secure, 10% dropout", "dp": "central DP (z 0.86, C 1)",
          "dp-secure": "central DP + secure", "dp-distributed": "distributed DP in the ring (local noise) + secure"}


def sim_command(a: argparse.Namespace, variant: str, seed: int) -> list[str]:
    return ["simulate", "--dataset", "fmnist", "--partition", "dir0.1", "--clients", str(a.clients),
            "--samples", str(a.samples), "--join-ratio", "1.0", "--rounds", str(a.rounds), "--seed", str(seed),
            "--strategy", "flayer", "--threads", "1", *VARIANTS[variant]]


def run_sim(out: Path, cmd: list[str], name: str, code: str) -> dict[str, Any]:
    folder = out / "runs" / f"{name}-{key_of({'cmd': cmd}, code)}"
    if not (folder / "summary.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(f"{folder}.log", "w") as fh:
            subprocess.run([sys.executable, "-m", "cli.main", *cmd, "--out", str(folder)], cwd=ROOT, check=True,
                           stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    (folder / "command.txt").write_text("flayer " + " ".join(cmd) + "\n")
    rounds = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("kind") == "round"]
    return {"cmd": cmd, "round_wall_s": [r["wall_s"] for r in rounds], **json.loads((folder / "summary.json").read_text())}


def sim_tables(rows: list[dict[str, Any]]) -> str:
    header = ("| run | seed | rounds | epsilon | best acc | final-round acc | personal acc | dropped (total) "
              "| abandoned rounds | upload KB per device per round | wall s per round |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.1f}"
        lines.append(f"| {LABELS[r['variant']]} | {r['seed']} | {len(r['acc'])}{' (diverged)' if r['diverged'] else ''} "
                     f"| {eps} | {r['best_acc']:.4f} "
                     f"| {r['final_round_acc']:.4f} | {r['final_personal_acc']:.4f} | {r['secure_dropped_total']} "
                     f"| {r['secure_abandoned_rounds']} | {r['upload_bytes_total'] / max(1, r['uploads']) / 1e3:,.1f} "
                     f"| {statistics.fmean(r['round_wall_s']):.1f} |")
    by = {(r["variant"], r["seed"]): r for r in rows}
    head = ("| against plain, public positions (same seed) | seeds | best acc: mean (min, max) "
            "| final-round acc: mean (min, max) | personal acc: mean (min, max) | wall s per round: ratio of means |")
    diff = ["", head, "|---|---|---|---|---|---|"]
    pairs = [("secure", "plain-public"), ("secure-drop0.1", "plain-public"), ("plain-topk", "plain-public"),
             ("dp-secure", "dp"), ("dp-distributed", "dp")]
    for variant, base in pairs:
        seeds = sorted(s for v, s in by if v == variant and (base, s) in by)
        if not seeds:
            continue
        cells = []
        for key in ("best_acc", "final_round_acc", "final_personal_acc"):
            d = [100 * (by[variant, s][key] - by[base, s][key]) for s in seeds]
            cells.append(f"{statistics.fmean(d):+.2f} ({min(d):+.2f}, {max(d):+.2f}) pt")
        w = statistics.fmean(statistics.fmean(by[variant, s]["round_wall_s"]) for s in seeds) / statistics.fmean(
            statistics.fmean(by[base, s]["round_wall_s"]) for s in seeds)
        name = LABELS[variant] + ("" if base == "plain-public" else f" against {LABELS[base]}")
        diff.append(f"| {name} | {','.join(map(str, seeds))} | {' | '.join(cells)} | {w:.2f} |")
    return "\n".join(lines + diff) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="default docs/results/secure-aggregation (--quick: /tmp)")
    p.add_argument("--part", choices=("a", "b", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="smoke size: n 10 and 20, 2,000 coordinates, 2 rounds")
    p.add_argument("--ns", default="10,20,100,1000", help="part a: cohort sizes (20: part b's cohort)")
    p.add_argument("--length", type=int, default=None, help="part a: cut the vector to this many coordinates")
    p.add_argument("--cases", default="0.1:0,0.1:0.1,0:0",
                   help="part a: design dropout (k, t):actual dropout pairs")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--samples", type=int, default=12000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args()
    if a.quick:
        a.ns, a.length, a.seeds, a.clients, a.samples, a.rounds = "10,20", a.length or 2000, "0", 5, 2000, 2
    out = a.out or (Path("/tmp/secagg-quick") if a.quick else ROOT / "docs/results/secure-aggregation")
    out.mkdir(parents=True, exist_ok=True)
    if a.part in ("a", "all"):
        check_driver()
        cases = [tuple(float(x) for x in c.split(":")) for c in a.cases.split(",")]
        rows = [cost_one(out, n, design, drop, a.length, 0) for n in (int(x) for x in a.ns.split(","))
                for design, drop in cases]
        (out / "cost.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(cost_table(rows))
    if a.part in ("b", "all"):
        code = code_digest("flayer/**/*.py", "cli/**/*.py", "protocol/**/*.py")
        seeds = [int(x) for x in a.seeds.split(",")]
        jobs = [(v, s) for s in seeds for v in ("plain-public", "secure", "secure-drop0.1")]
        jobs += [(v, seeds[0]) for v in ("plain-topk", "dp", "dp-secure", "dp-distributed")]
        with ThreadPoolExecutor(a.jobs) as pool:
            runs = list(pool.map(lambda j: {"variant": j[0], "seed": j[1],
                                            **run_sim(out, sim_command(a, *j), f"{j[0]}-s{j[1]}", code)}, jobs))
        order = list(VARIANTS)
        runs.sort(key=lambda r: (order.index(r["variant"]), r["seed"]))
        (out / "simulate.json").write_text(json.dumps(runs, indent=1) + "\n")
        print(sim_tables(runs))
    write_results(out)
    return 0


def write_results(out: Path) -> None:
    """``out/results.md``: the tables of whichever parts have their JSON under ``out``."""
    parts = []
    if (out / "cost.json").exists():
        parts.append("## Protocol cost per round\n\n" + cost_table(json.loads((out / "cost.json").read_text())))
    if (out / "simulate.json").exists():
        parts.append("## Accuracy and round time\n\n" + sim_tables(json.loads((out / "simulate.json").read_text())))
    (out / "results.md").write_text("# Secure aggregation: the benchmark's tables\n\n" + "\n".join(parts))


if __name__ == "__main__":
    raise SystemExit(main())
