"""A secure round's bytes and CPU against plain rounds of the same values, with the ring at 32 bits and at its width.

In process, the protocol code itself (``flayer.secagg``; no broker). The vector is FLAYER's public-positions upload
of the Fashion-MNIST CNN (``benchmarks/secagg.py``'s ``fmnist_upload``: 424,570 values), every device sending the
same values. Per cohort n and repeat, four rounds:

* **plain, fp32**: each device encodes its update with the project's codec (fp32 values and coded positions); the
  coordinator decodes each upload against the model's shapes (the norm check included) and folds it
  (``flayer.aggregate.Aggregator``);
* **plain, link-fitted**: each device runs ``edge_client.linkfit.fit_upload`` with a budget that int8 meets and
  fp16 does not (the ladder's lowest codec, every value kept: the smallest plain upload of the same values) and
  encodes the choice; the coordinator as above;
* **secure, 32-bit ring** (the ring before its width followed the bound: ``RingSpec.for_summands(R, n)``, 4 bytes a
  value) and **secure, narrow ring** (``flayer.engine.secure.round_ring``: R = 8, 16 bits a value, n summands, one
  bit of margin): the round driven by ``benchmarks/secagg.py``'s ``drive`` (every message through its bytes);
* **secure, link-fitted**: the narrow ring over the round's kept share of the positions
  (``flayer.engine.secure_fit``), the keep fraction the coordinator plans for the plain link-fitted row's budget
  (``fitted_keep``: within the budget and at most ``--factor`` x the plain link fit's bytes, 1.2 by default).
  Device CPU is a device's protocol calls, its message codec and its quantisation into the ring (``encode``);
  coordinator CPU is the server's calls, its codec, and decoding and checking the sum (``sum_update``).

CPU is ``time.thread_time`` (one thread), mean over the devices of a round, then mean and range over the repeats;
bytes are per device, sent (and sent + received for secure rounds: the protocol's downlink; the model download is
the same in all four and left out). Ratios are printed side by side::

    python benchmarks/secagg_cost.py --ns 100,1000 --repeats 3
    python benchmarks/secagg_cost.py --ns 20 --repeats 1 --length 20000     # smoke size
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RANGE = 8.0  # R: secure_clip_range's default without DP or a known bound


def ladder_sizes(update: Any) -> dict[str, int]:
    """The plain upload's encoded size at each codec of the ladder."""
    from protocol import UpdateOptions
    from protocol.update_codec import UpdateHeader, encode_update

    return {c: len(encode_update(update, UpdateHeader("fed", 1, "client-0", "0" * 64), UpdateOptions(c)))
            for c in ("fp32", "fp16", "int8")}


def fit_budget(sizes: dict[str, int]) -> int:
    return (sizes["int8"] + sizes["fp16"]) // 2  # int8 fits, fp16 does not


def plain_round(update: Any, n: int, fitted: bool, shapes: dict[str, tuple[int, ...]], state: Any) -> dict[str, Any]:
    """Each of ``n`` devices encodes (or fits and encodes) the update; the coordinator decodes and folds each."""
    from edge_client.linkfit import fit_upload
    from flayer.aggregate import Aggregator
    from protocol import UpdateOptions
    from protocol.update_codec import UpdateHeader, decode_update, encode_update
    from protocol.upload_cap import UploadCap

    budget = fit_budget(ladder_sizes(update))
    sent_bytes, dev_cpu, coord = [], [], 0.0
    agg = Aggregator(state)
    gc.collect()
    gc.disable()
    try:
        for i in range(n):  # each upload is decoded and folded as it arrives (n blobs are not held at once)
            header = UpdateHeader("fed", 1, f"client-{i}", "0" * 64)
            t0 = time.thread_time()
            if fitted:
                def size_of(u: Any, c: str, h: Any = header) -> int:
                    return len(encode_update(u, h, UpdateOptions(c)))

                sent, fit = fit_upload(update, size_of, "fp32", UploadCap("int8", 0.1), budget)
                codec = fit.codec
            else:
                sent, codec = update, "fp32"
            blob = encode_update(sent, header, UpdateOptions(codec))
            dev_cpu.append(time.thread_time() - t0)
            sent_bytes.append(len(blob))
            t0 = time.thread_time()
            agg.fold(decode_update(blob, shapes=shapes).update)
            coord += time.thread_time() - t0
        t0 = time.thread_time()
        agg.result()
        coord += time.thread_time() - t0
    finally:
        gc.enable()
    assert not fitted or codec == "int8"
    return {"sent": statistics.fmean(sent_bytes), "both": statistics.fmean(sent_bytes),
            "device_cpu": statistics.fmean(dev_cpu), "coordinator_cpu": coord, "bits": 8 if fitted else 32}


def secure_round(values: np.ndarray, layout: Any, n: int, narrow: bool, seed: int) -> dict[str, Any]:
    """One secure round of ``n`` devices over ``values`` (module docstring)."""
    from secagg import drive

    from flayer.engine.secure import PlannedSecure, round_ring, sum_update
    from flayer.secagg import RingSpec, SecAggParams, encode, neighbour_count
    from flayer.strategies.base import derive_seed

    ids = tuple(f"client-{i}" for i in range(n))
    ring = round_ring(RANGE, n, 16) if narrow else RingSpec.for_summands(RANGE, n)
    k, t = neighbour_count(n, 0.1)
    params = SecAggParams("bench", 1, ids, t, k, hashlib.sha256(b"graph").digest(), int(values.size), ring)
    quantise: dict[str, float] = {}
    expected = np.zeros(values.size, dtype=np.uint32)

    def vector_of(d: str) -> np.ndarray:
        nonlocal expected
        t0 = time.thread_time()
        out = encode(values, ring, np.random.default_rng(derive_seed(seed, 1, d, "secagg")))
        quantise[d] = time.thread_time() - t0
        expected += out
        return out

    row = drive(params, vector_of, {}, hashlib.sha256(f"cost:{seed}".encode()).digest())
    assert row["abandoned"] is None and row["sum_correct"], row["abandoned"]  # the server's sum is the inputs' sum
    planned = PlannedSecure(params, layout.digest, False, 10.0, 0.0, None, RANGE)
    t0 = time.thread_time()
    total, _, why = sum_update(expected & np.uint32(ring.modulus - 1), planned, layout, n)  # decode and check
    check = time.thread_time() - t0
    assert why is None and total is not None, why
    return {"sent": row["up_mean"], "both": row["bytes_mean"], "bits": ring.bits, "k": k, "t": t,
            "device_cpu": row["device_cpu_mean"] + row["device_codec_mean"] + statistics.fmean(quantise.values()),
            "coordinator_cpu": row["server_cpu"] + row["server_codec"] + check}


def table(n: int, by_kind: dict[str, list[dict[str, Any]]], alone: int) -> None:
    """The cohort's rows, every ratio side by side (module docstring)."""
    print(f"\nn = {n:,}")
    print("| round | bits a value | KB sent | KB sent+received | device CPU s | coordinator CPU s "
          "| sent / plain fp32 | sent / values alone | sent / link-fitted | device CPU / plain fp32 "
          "| coordinator CPU / plain fp32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base, fitted = by_kind["plain fp32"], by_kind["plain link-fitted (int8)"]

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    for kind, rows in by_kind.items():
        def cpu(key: str, rows: list[dict[str, Any]] = rows) -> str:
            xs = [r[key] for r in rows]
            return f"{statistics.fmean(xs):.4f} ({min(xs):.4f}-{max(xs):.4f})"

        sent = mean(rows, "sent")
        print(f"| {kind} | {rows[0]['bits']} | {sent / 1000:,.1f} | {mean(rows, 'both') / 1000:,.1f} "
              f"| {cpu('device_cpu')} | {cpu('coordinator_cpu')} | {sent / mean(base, 'sent'):.3f} "
              f"| {sent / alone:.3f} | {sent / mean(fitted, 'sent'):.3f} "
              f"| {mean(rows, 'device_cpu') / mean(base, 'device_cpu'):.2f} "
              f"| {mean(rows, 'coordinator_cpu') / mean(base, 'coordinator_cpu'):.2f} |")
    old, new = by_kind["secure, 32-bit ring"], by_kind["secure, narrow ring"]
    print(f"narrow / 32-bit ring: bytes sent {mean(new, 'sent') / mean(old, 'sent'):.3f}, device CPU "
          f"{mean(new, 'device_cpu') / mean(old, 'device_cpu'):.2f}, coordinator CPU "
          f"{mean(new, 'coordinator_cpu') / mean(old, 'coordinator_cpu'):.2f}", flush=True)
    fit = by_kind.get("secure, link-fitted")
    if fit:
        print(f"secure link-fitted (keep {fit[0]['keep']:.4f} of {fit[0]['values']:,} positions) / plain link-fitted: "
              f"bytes sent {mean(fit, 'sent') / mean(fitted, 'sent'):.3f}, sent + received "
              f"{mean(fit, 'both') / mean(fitted, 'both'):.3f}; / secure narrow ring: "
              f"{mean(fit, 'sent') / mean(new, 'sent'):.3f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", default="100,1000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--length", type=int, default=None, help="cut the vector to this many values (smoke runs)")
    p.add_argument("--json", type=Path, default=None, help="write every measurement here")
    p.add_argument("--factor", type=float, default=1.2, help="secure_fit_factor of the link-fitted secure row")
    a = p.parse_args()

    from secagg import fmnist_upload

    from flayer.engine.secure_layout import flatten, layout_of

    update, _, _, _ = fmnist_upload(a.length)
    layout = layout_of(update)
    values = flatten(update, layout)
    shapes = {name: d.shape for name, d in update.deltas.items()}
    import torch

    state = {name: torch.zeros(shape) for name, shape in shapes.items()}
    kinds = ("plain fp32", "plain link-fitted (int8)", "secure, 32-bit ring", "secure, narrow ring",
             "secure, link-fitted")
    from flayer.engine.secure import round_ring
    from flayer.engine.secure_fit import fitted_keep, keep_layout, restrict
    from flayer.secagg import neighbour_count

    sizes = ladder_sizes(update)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    print(f"{values.size:,} values a device; CPU: mean over {a.repeats} repeats (min-max); bytes per device; "
          f"'values alone': {4 * values.size:,} bytes, 4 a value, no positions (the public seed fixes them)")
    for n in (int(x) for x in a.ns.split(",")):
        by_kind: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
        results[str(n)] = by_kind
        for rep in range(a.repeats):
            t0 = time.perf_counter()
            by_kind["plain fp32"].append(plain_round(update, n, False, shapes, state))
            by_kind["plain link-fitted (int8)"].append(plain_round(update, n, True, shapes, state))
            by_kind["secure, 32-bit ring"].append(secure_round(values, layout, n, False, rep))
            by_kind["secure, narrow ring"].append(secure_round(values, layout, n, True, rep))
            keep = fitted_keep(values.size, round_ring(RANGE, n, 16).bits, neighbour_count(n, 0.1)[0],
                               fit_budget(sizes), list(sizes.values()), a.factor)
            kept = keep_layout(layout, keep, 0, 1)  # the run seed and the round draw the subset
            row = secure_round(flatten(restrict(update, keep, 0, 1), kept), kept, n, True, rep)
            by_kind["secure, link-fitted"].append({**row, "keep": keep, "values": kept.n})
            print(f"n={n} repeat {rep + 1}/{a.repeats}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        table(n, by_kind, 4 * values.size)
        if a.json is not None:  # after each cohort: an interrupted run keeps what it measured
            a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
