"""Secure rounds with a fixed share of the cohort dropping out mid-protocol: is every round unmasked, and is
its sum exact?

In process (:func:`flayer.secagg.run_round`, the consistency round included, every message through its
bytes), for each cohort size n and round: ``--dropout`` x n devices drawn at random leave the protocol, a
third each after their key advert, after their shares and after their masked input (the first two are
missing from the sum, their pairwise masks removed with their neighbours' shares; the last are in the sum
and answer no consistency or unmask request). k and t follow from the rule at the design dropout
``--design`` (what `[privacy] secure_dropout` sets). A round is "exact" when the unmasked ring sum equals
the sum of the survivors' inputs.

    python benchmarks/secagg_dropout.py --ns 100,1000 --rounds 5 --dropout 0.3 --design 0.3

Prints one line per round and a summary per n; the devices' randomness is fresh (``os.urandom``) every run.
"""

from __future__ import annotations

import argparse
import os
import secrets
import time

import numpy as np

from flayer.secagg import RingSpec, SecAggParams, run_round
from flayer.secagg.ring import encode


def one_round(n: int, round_id: int, dropout: float, design: float, length: int) -> dict[str, object]:
    ids = [f"client-{i}" for i in range(n)]
    ring = RingSpec.for_bound(8.0, n, 16)
    params = SecAggParams.for_round("bench.dropout", round_id, ids, length, ring, os.urandom(32), design)
    pick = np.random.default_rng(secrets.randbits(64))  # which devices drop: nothing secret
    leaving = [ids[i] for i in pick.choice(n, size=round(dropout * n), replace=False)]
    points = ("after_keys", "after_shares", "after_masked")
    drops = {d: points[i % 3] for i, d in enumerate(leaving)}
    vectors = {d: encode(pick.uniform(-8.0, 8.0, length), ring, pick) for d in ids  # honest: within [-R, R]
               if drops.get(d) not in ("after_keys", "after_shares")}
    t0 = time.process_time()
    out = run_round(params, vectors, drops)
    cpu = time.process_time() - t0
    exact = None
    if out.ring_sum is not None:
        want = np.zeros(length, dtype=np.uint64)
        for d in out.survivors:
            want += vectors[d].astype(np.uint64)
        exact = bool(np.array_equal(out.ring_sum.astype(np.uint64) % 2 ** ring.bits, want % 2 ** ring.bits))
    return {"n": n, "round": round_id, "k": params.degree, "t": params.threshold, "dropped": len(leaving),
            "survivors": len(out.survivors), "abandoned": out.abandoned_reason, "exact": exact, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="100,1000", help="cohort sizes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dropout", type=float, default=0.3, help="share of the cohort that leaves mid-protocol")
    ap.add_argument("--design", type=float, default=0.3, help="the design dropout k and t are chosen for")
    ap.add_argument("--length", type=int, default=1000, help="values a masked input holds")
    args = ap.parse_args()
    if not 0 <= args.dropout < 1 or not 0 <= args.design < 1:
        ap.error("--dropout and --design must be in [0, 1)")
    for n in (int(x) for x in args.ns.split(",")):
        rows = [one_round(n, r, args.dropout, args.design, args.length) for r in range(1, args.rounds + 1)]
        for row in rows:
            print(row, flush=True)
        unmasked = sum(r["abandoned"] is None for r in rows)
        exact = sum(r["exact"] is True for r in rows)
        print(f"n = {n}, k = {rows[0]['k']}, t = {rows[0]['t']}: {rows[0]['dropped']} of {n} dropped a round "
              f"({args.dropout:.0%}); {unmasked} of {len(rows)} rounds unmasked, {exact} exact; "
              f"survivors {min(r['survivors'] for r in rows)}-{max(r['survivors'] for r in rows)}; "
              f"CPU {min(r['cpu_s'] for r in rows):.1f}-{max(r['cpu_s'] for r in rows):.1f} s a round "
              f"(every party in one process)", flush=True)


if __name__ == "__main__":
    main()
