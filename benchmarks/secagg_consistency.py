"""What the consent stage and the consistency round of a secure round add: bytes and CPU per device and on the
coordinator.

Each device whose masked input arrived signs its consent (one Ed25519 signature), the survivors sign the whole survivor set, the coordinator forwards T signatures in each unmask request, and
each device verifies them before it unmasks (docs/explanation/secure-aggregation.md). The round's other stages
are what ``benchmarks/secagg.py`` measures; this script runs ``flayer.secagg`` in process up to the masked inputs
(a short vector: the consistency round does not depend on its length) and times only the consistency round's
calls with ``time.thread_time``:

* device: ``consent`` and ``sign_survivors`` (one Ed25519 signature each) and the check ``unmask`` runs first
  (T survivor-set signatures and its neighbours' consents verified);
* coordinator: ``consent_request`` and ``receive_consent``, ``consistency_request`` for every survivor and
  ``receive_signature`` (one verification each).

Bytes per device: the ConsentRequest and Consent, the ConsistencyRequest (the whole survivor set), the
SurvivorSignature, and the signatures and consents an unmask request carries. k and t from the rule at the design dropout 0.1, no dropouts.

    python benchmarks/secagg_consistency.py              # n = 100 and 1,000
    python benchmarks/secagg_consistency.py --sizes 100
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import time

import numpy as np

from flayer.secagg import (
    LocalIdentities,
    RingSpec,
    SecAggClient,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    ServerConsistency,
)


def measure(n: int, dropout: float = 0.1, length: int = 16) -> dict[str, float]:
    ids = tuple(f"client-{i}" for i in range(n))
    params = SecAggParams.for_round("bench.1.x", 1, ids, length, RingSpec.for_summands(8.0, n), bytes(32), dropout)
    who = LocalIdentities(ids, SeededEntropy(b"i" * 32))
    server = SecAggServer(params, ServerConsistency(who.verify))
    clients = {d: SecAggClient(params, d, SeededEntropy(hashlib.sha256(d.encode()).digest()), who.for_device(d))
               for d in ids}
    for d in ids:
        server.receive_advert(clients[d].advertise())
    for d in ids:
        server.receive_shares(clients[d].share_keys(server.key_bundle(d)))
    zero = np.zeros(length, np.uint32)
    for d in ids:
        server.receive_masked(clients[d].masked_input(server.shares_for(d), zero))
    gc.disable()
    coord = dev_sign = 0.0
    sent = {}
    requests = {}
    consent_bytes = {}
    for d in ids:
        t0 = time.thread_time()
        ask = server.consent_request(d)
        coord += time.thread_time() - t0
        t0 = time.thread_time()
        given = clients[d].consent(ask)
        dev_sign += time.thread_time() - t0
        consent_bytes[d] = len(ask.to_bytes()) + len(given.to_bytes())
        t0 = time.thread_time()
        server.receive_consent(given)
        coord += time.thread_time() - t0
    for d in ids:
        t0 = time.thread_time()
        requests[d] = server.consistency_request(d)
        coord += time.thread_time() - t0
        t0 = time.thread_time()
        sig = clients[d].sign_survivors(requests[d])
        dev_sign += time.thread_time() - t0
        sent[d] = sig
        t0 = time.thread_time()
        server.receive_signature(sig)
        coord += time.thread_time() - t0
    checks, extra = [], []
    for d in ids:
        req = server.unmask_request(d)
        t0 = time.thread_time()
        clients[d]._check_consistent(req)  # what unmask runs before it reveals a share
        checks.append(time.thread_time() - t0)
        extra.append(consent_bytes[d] + len(requests[d].to_bytes()) + len(sent[d].to_bytes())
                     + len(req.to_bytes()) - len(dataclasses.replace(req, signatures=(), consents=()).to_bytes()))
        clients[d].unmask(req)
    gc.enable()
    return {"n": n, "k": params.degree, "t": params.threshold, "T": server.signatures_needed,
            "bytes_per_device": float(np.mean(extra)), "device_cpu_s": dev_sign / n + float(np.mean(checks)),
            "device_cpu_max_s": dev_sign / n + float(np.max(checks)), "coordinator_cpu_s": coord}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    args = ap.parse_args()
    print("| n | k, t | T | KB per device (sent + received) | device CPU ms: mean / max | coordinator CPU s |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        r = measure(n)
        print(f"| {r['n']:,} | {r['k']}, {r['t']} | {r['T']} | {r['bytes_per_device'] / 1000:.1f} | "
              f"{1000 * r['device_cpu_s']:.1f} / {1000 * r['device_cpu_max_s']:.1f} | {r['coordinator_cpu_s']:.3f} |")


if __name__ == "__main__":
    main()
