"""What signing the key adverts adds to a secure round: bytes and CPU per device and on the coordinator.

Each device signs its keys toward each of its k neighbours with its long-term Ed25519 key (k signatures), the
coordinator checks the N k signatures when the adverts arrive and relays one per bundle entry, and each device
checks the k entries of its bundle before it seals a share (docs/explanation/secure-aggregation.md). This script
runs ``flayer.secagg`` in process up to the key bundles with the real devices' signers and verifiers
(:func:`protocol.signing.advert_signer` / :func:`~protocol.signing.advert_verifier` over a key registry) and times
only the signing calls with ``time.thread_time``:

* device: signing its advert (k signatures) and checking its bundle (k verifications);
* coordinator: checking every advert's signatures (N k verifications).

Bytes per device: its advert and its bundle, signed, against the same round's unsigned ones as they were laid out
before (without the signature counts: 2 B in the advert and 2 B a bundle entry). k and t from the rule at the design dropout 0.1.

    python benchmarks/secagg_signed_adverts.py              # n = 100 and 1,000
    python benchmarks/secagg_signed_adverts.py --sizes 100
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import time

import numpy as np

from flayer.secagg import (
    DeviceConsistency,
    RingSpec,
    SecAggClient,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    ServerConsistency,
)
from flayer.secagg.signed_adverts import bundle_problem, sign_advert
from protocol.signing import (
    KeyRing,
    SigningKey,
    advert_signer,
    advert_verifier,
    survivor_signer,
    survivor_verifier,
)

FED = "bench"


def _round(params: SecAggParams, signed: bool, ring: KeyRing | None, keys: dict[str, SigningKey]):
    ids = params.participants
    verify = advert_verifier(ring, FED, params.round) if signed else None
    server = SecAggServer(params, ServerConsistency(verify, verify_advert=verify) if signed else None)
    clients = {}
    for d in ids:
        cons = DeviceConsistency(survivor_signer(keys[d], FED, params.round, d),
                                 survivor_verifier(ring, FED, params.round), 0.0,
                                 advert_signer(keys[d], FED, params.round, d), verify) if signed else None
        clients[d] = SecAggClient(params, d, SeededEntropy(hashlib.sha256(d.encode()).digest()), cons)
    return server, clients


def measure(n: int, dropout: float = 0.1, length: int = 16) -> dict[str, float]:
    ids = tuple(f"client-{i}" for i in range(n))
    params = SecAggParams.for_round(f"{FED}.1.x", 1, ids, length, RingSpec.for_summands(8.0, n), bytes(32), dropout)
    keys = {d: SigningKey.generate() for d in ids}
    ring = KeyRing(FED, {d: k.public for d, k in keys.items()})
    out: dict[str, float] = {"n": n, "k": params.degree, "t": params.threshold}
    sizes = {}
    for signed in (False, True):
        server, clients = _round(params, signed, ring, keys)
        adverts = {d: clients[d].advertise() for d in ids}
        gc.disable()
        if signed:
            sign_s, coord_s = [], 0.0
            for d in ids:  # the signing part of advertise(), timed on its own
                signer = advert_signer(keys[d], FED, params.round, d)
                bare = dataclasses.replace(adverts[d], signatures=())
                t0 = time.thread_time()
                sign_advert(params, bare, signer)
                sign_s.append(time.thread_time() - t0)
            for d in ids:
                t0 = time.thread_time()
                server._signature_problem(adverts[d])  # what receive_advert checks first
                coord_s += time.thread_time() - t0
        for d in ids:
            server.receive_advert(adverts[d])
        bundles = {d: server.key_bundle(d) for d in ids}
        if signed:
            verify = advert_verifier(ring, FED, params.round)
            check_s = []
            for d in ids:
                t0 = time.thread_time()
                assert bundle_problem(params, d, bundles[d], verify) is None
                check_s.append(time.thread_time() - t0)
            out.update(device_sign_ms=1000 * float(np.mean(sign_s)), device_check_ms=1000 * float(np.mean(check_s)),
                       device_max_ms=1000 * float(np.max(np.array(sign_s) + np.array(check_s))), coordinator_s=coord_s)
        gc.enable()
        # unsigned: as laid out before signed adverts, without the signature counts (2 B an advert, 2 B an entry)
        sizes[signed] = [len(adverts[d].to_bytes()) + len(bundles[d].to_bytes())
                         - (0 if signed else 2 + 2 * len(bundles[d].adverts)) for d in ids]
    out["bytes_added"] = float(np.mean(np.array(sizes[True]) - np.array(sizes[False])))
    out["bytes_signed"] = float(np.mean(sizes[True]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    args = ap.parse_args()
    print("| n | k, t | B added per device (advert + bundle) | advert + bundle B, signed | device CPU ms: sign k / "
          "verify k / max | coordinator CPU s (N k verifications) |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        r = measure(n)
        print(f"| {r['n']:,} | {r['k']}, {r['t']} | {r['bytes_added']:,.0f} | {r['bytes_signed']:,.0f} | "
              f"{r['device_sign_ms']:.2f} / {r['device_check_ms']:.2f} / {r['device_max_ms']:.2f} | "
              f"{r['coordinator_s']:.3f} |")


if __name__ == "__main__":
    main()
