"""What signing every message costs: bytes per message, device and coordinator CPU per round, signed against
unsigned, side by side (in process, no broker).

One synchronous round of n devices, every message through its real bytes (``protocol.encode_message``,
``protocol.chunk_blob``, ``protocol.decode_envelope``/``decode_message``), once unsigned (no key, no trust:
what the wire did before format version 2, apart from the 64-byte field) and once signed and verified
(Ed25519, :mod:`protocol.signing`). The unsigned run's payloads carry the signature field all zero; the bytes
of the earlier format (version 1, no field) are those less 64 bytes a message:

- the coordinator publishes the plan, the model's chunks and one ack per device, and receives from each
  device two status messages, one metrics message and its update's chunks, which it reassembles
  (``protocol.Reassembler``: the whole blob's sha256 checked);
- each device receives the plan, the model's chunks (reassembled the same way) and its ack, and sends the
  rest.

This is the envelope layer only: training, decoding the update and folding it are the same either way and
left out, so the ratios are an upper bound on what signing adds to a round.

The model and the update are random blobs of the sizes of PFLlib's CNN on Fashion-MNIST as this project
sends them (docs/results/secure-aggregation.md: a dense fp32 model of 2,328,509 bytes, FLAYER's sparse
upload of 1,758,872 bytes); their content does not change what signing costs, their size does (the
signature is over every byte). Chunks fit the broker's default 1 MiB packets. CPU is ``time.process_time``
(one thread) summed over each side's calls; each setting is run ``--repeat`` times and the lowest kept::

    python benchmarks/signing.py                       # n = 100 and 1,000
    python benchmarks/signing.py --devices 10 --repeat 1 --update-bytes 20000   # smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol import (
    Ack,
    KeyRing,
    Kind,
    Metrics,
    PeerTrust,
    Plan,
    Reassembler,
    SignContext,
    SigningKey,
    Status,
    WireLimits,
    blob_digest,
    chunk_blob,
    decode_envelope,
    decode_message,
    encode_message,
)
from transport.credentials import payload_limit

FED = "bench"
LIMITS = WireLimits(max_blob_bytes=64 << 20)
COORD = "coordinator"


def one_round(n: int, signed: bool, model: bytes, update: bytes, keys: dict[str, SigningKey],
              coord_key: SigningKey, max_payload: int) -> dict[str, float]:
    """CPU seconds of the coordinator and (summed) of the devices, and bytes, for one round."""
    ck = coord_key if signed else None
    update_digest = blob_digest(update)
    dev_trust = PeerTrust(FED, coord_key.public) if signed else None
    coord_trust = KeyRing(FED, {d: k.public for d, k in keys.items()}) if signed else None
    devices = list(keys)
    cpu = {"coordinator": 0.0, "devices": 0.0}
    sent = {"messages": 0, "bytes": 0}

    def tick(side: str, t0: float) -> None:
        cpu[side] += time.process_time() - t0

    t0 = time.process_time()  # the coordinator publishes the plan and the model
    plan = Plan(1, tuple(devices), time.time() + 600, "fedavg", {}, {"name": "cnn"}, blob_digest(model),
                -(-len(model) // 1_000_000), len(model))
    plan_payload = encode_message(plan, FED, COORD, key=ck)
    model_chunks = chunk_blob(model, Kind.MODEL_CHUNK, FED, COORD, 1, max_payload, key=ck)
    tick("coordinator", t0)
    for d in devices:
        key = keys[d] if signed else None
        t0 = time.process_time()  # the device: plan and model in, status, update and metrics out
        decode_message(plan_payload, kind=Kind.PLAN, trust=dev_trust)
        model_in = Reassembler(LIMITS)
        for c in model_chunks:
            model_in.add(decode_envelope(c, LIMITS, dev_trust))
        model_in.blob()
        out = [encode_message(Status(1, s, time.time()), FED, d, key=key) for s in ("training", "uploading")]
        out += chunk_blob(update, Kind.UPDATE_CHUNK, FED, d, 1, max_payload, key=key)
        out.append(encode_message(Metrics(1, time.time(), {"train_loss": 0.5}), FED, d, key=key))
        tick("devices", t0)
        t0 = time.process_time()  # the coordinator: the device's messages in, its ack out
        update_in = Reassembler(LIMITS)
        for p in out:
            env = decode_envelope(p, LIMITS, coord_trust)
            if env.kind in (Kind.STATUS, Kind.METRICS):
                decode_message(p)  # (the JSON; the signature was checked above)
            else:
                update_in.add(env)
        assert blob_digest(update_in.blob()) == update_digest
        ack = encode_message(Ack(1, d, update_digest, "accepted"), FED, COORD, key=ck)
        tick("coordinator", t0)
        t0 = time.process_time()
        decode_message(ack, kind=Kind.ACK, trust=dev_trust)
        tick("devices", t0)
        msgs = [plan_payload, *model_chunks, *out, ack]
        sent["messages"] += len(msgs)
        sent["bytes"] += sum(len(p) for p in msgs)
    return {**cpu, **sent}


def micro(repeat: int = 500) -> dict[str, float]:
    """The primitives: one signature and one verification of a small message, hashing a megabyte."""
    import hashlib
    import zlib

    key, ctx, data, mb = SigningKey.generate(), SignContext(FED, 1, "dev-0", "bench"), b"x" * 200, os.urandom(1 << 20)

    def each(f: object, n: int) -> float:
        t0 = time.process_time()
        for _ in range(n):
            f()  # type: ignore[operator]
        return 1e3 * (time.process_time() - t0) / n

    sig = key.sign(ctx, data)
    return {"sign_ms": each(lambda: key.sign(ctx, data), repeat),
            "verify_ms": each(lambda: key.public.verify(ctx, data, sig), repeat),
            "sha256_ms_per_mb": each(lambda: hashlib.sha256(mb).digest(), repeat // 10),
            "crc32_ms_per_mb": each(lambda: zlib.crc32(mb), repeat // 10)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--model-bytes", type=int, default=2_328_509)
    ap.add_argument("--update-bytes", type=int, default=1_758_872)
    ap.add_argument("--max-packet-size", type=int, default=1 << 20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write every figure here")
    args = ap.parse_args()
    model, update = os.urandom(args.model_bytes), os.urandom(args.update_bytes)
    max_payload = payload_limit(args.max_packet_size)
    coord_key = SigningKey.generate()
    rows = []
    ops = micro()
    warm = {"dev-w": SigningKey.generate()}
    for signed in (False, True):  # caches and allocator warm before anything is timed
        one_round(1, signed, model, update, warm, coord_key, max_payload)
    for n in args.devices:
        keys = {f"dev-{i:04d}": SigningKey.generate() for i in range(n)}
        best: dict[bool, dict[str, float]] = {}
        for _ in range(args.repeat):
            for signed in (False, True):
                r = one_round(n, signed, model, update, keys, coord_key, max_payload)
                if signed not in best or r["coordinator"] + r["devices"] < sum(best[signed][k] for k in
                                                                               ("coordinator", "devices")):
                    best[signed] = r
        u, s = best[False], best[True]
        rows.append({"devices": n, "messages": s["messages"], "bytes_before": u["bytes"] - 64 * u["messages"],
                     "bytes_signed": s["bytes"],
                     "coordinator_cpu_s": [u["coordinator"], s["coordinator"]],
                     "device_cpu_ms": [1e3 * u["devices"] / n, 1e3 * s["devices"] / n]})
    print(f"Ed25519 sign {ops['sign_ms']:.3f} ms, verify {ops['verify_ms']:.3f} ms (a 200-byte message); "
          f"sha256 {ops['sha256_ms_per_mb']:.2f} ms/MB, crc32 {ops['crc32_ms_per_mb']:.2f} ms/MB")
    print(f"model {args.model_bytes:,} B, update {args.update_bytes:,} B, packets {args.max_packet_size:,} B, "
          f"best of {args.repeat}")
    print(f"{'devices':>7} {'messages':>9} {'MB before / signed':>20} {'coord CPU s (unsigned / signed / ratio)':>40} "
          f"{'device CPU ms (unsigned / signed / ratio)':>42}")
    for r in rows:
        cu, cs = r["coordinator_cpu_s"]
        du, ds = r["device_cpu_ms"]
        print(f"{r['devices']:>7,} {r['messages']:>9,} {r['bytes_before'] / 1e6:>10.3f} / {r['bytes_signed'] / 1e6:>7.3f} "
              f"{cu:>17.3f} / {cs:>7.3f} / {cs / cu:>5.2f} "
              f"{du:>20.2f} / {ds:>7.2f} / {ds / du:>5.2f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "ops": ops, "rows": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
