"""What the coordinator's share checks cost: honest shares, and the search for clean ones when holders lie
(flayer.secagg.server).

Honest: one interpolation of t shares and the check of the m - t others against it, per secret (a round
rebuilds one secret per survivor and per dropped device). Lying holders: with m shares of which about a dozen are false and spread out (so that no window
of t consecutive shares and no random t-subset avoids them), the coordinator interpolates every t-subset it tries
(the t smallest, each window, 256 random ones) before it gives up: the worst case of one secret. Printed for the
(t, m) of a small complete graph and of 1,000 devices at dropout 0.1 and 0.22 (k = 38 and 100, every holder
answering): subsets tried and process CPU seconds.

    python benchmarks/secagg_share_search.py
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flayer.secagg import shamir
from flayer.secagg.decoding import subsets


def main() -> None:
    for t, m in ((4, 6), (20, 39), (51, 101)):
        shares = shamir.split(secrets.token_bytes(32), t, list(range(1, m + 1)))
        used = {x: shares[x] for x in range(1, t + 1)}
        start = time.process_time()
        for _ in range(5):
            shamir.combine(used, t)
            on = shamir.evaluate_many(used, list(range(t + 1, m + 1)))
            assert all(on[x] == shares[x] for x in on)
        print(f"t={t:3d} m={m:3d}: honest shares, {(time.process_time() - start) / 5 * 1e3:.1f} ms CPU a secret")
        for x in range(1, m + 1, max(1, m // 12)):
            shares[x] = (shares[x] + 1) % shamir.PRIME
        start, tried = time.process_time(), 0
        for subset in subsets(sorted(shares), t):
            tried += 1
            try:
                shamir.combine({x: shares[x] for x in subset}, t)
            except ValueError:
                pass
        print(f"t={t:3d} m={m:3d}: {tried} subsets tried, {time.process_time() - start:.2f} s CPU for one secret")


if __name__ == "__main__":
    main()
