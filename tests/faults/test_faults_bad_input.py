"""Bad input against a live coordinator (the real server loop on a real Mosquitto), published by
authorised devices with their real credentials: random and mutated payloads, truncated chunks and
chunk sets, wrong checksums and digests, NaN and Inf, huge norms, wrong shapes, senders and base
models, updates for past and future rounds, from an unselected device, replays, and a flood of
unfinished blobs. For each: the coordinator keeps running, rejects it with a logged reason and a
named counter (metrics.jsonl), and the next round's global model is bit-identical to the one the
honest updates alone give."""

from __future__ import annotations

import logging
import math
import struct
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from campaign import SELECTED, Campaign, T, digest, fold, live_coordinator, mutate
from craft import (
    Device,
    chunks,
    honest_update,
    patch,
    read_field,
    sign,
    sparse_update,
    with_bad_value,
)
from faultlib import FEDERATION, wait_until
from fedtestlib import FedBroker

from coordinator.publish import model_blob
from flayer.engine import initial_global_state
from mqtt_broker import mosquitto_available
from protocol import UpdateHeader

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]
NAN, POS_INF, NEG_INF = (
    struct.pack("<f", float("nan")),
    struct.pack("<f", float("inf")),
    struct.pack("<f", -math.inf),
)


def test_bad_inputs_are_rejected_counted_logged_and_leave_the_model_unaffected(
    tmp_path: Path, live_fed: FedBroker, caplog: pytest.LogCaptureFixture, faults_ledger: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator")
    # every bad input of the campaign comes from one device in one round: no cut-off (max_malformed),
    # so each reaches the check it targets (the cut-off has its own test, test_faults_hostile.py)
    coord = live_coordinator(tmp_path, live_fed, rounds=2, norm_bound=5.0, max_update_bytes=600_000,
                             max_malformed=1_000_000)
    thread = coord.start()
    a, b, c = (Device(live_fed.devices[d], T) for d in SELECTED)
    x = Device(live_fed.devices["dev-x"], T, online=False)  # authorised, never online: never selected
    shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
    camp = Campaign(coord, thread, faults_ledger)
    rng = np.random.default_rng(7)
    try:
        plan1 = a.plan(1)
        assert sorted(plan1.selected) == SELECTED
        h = {d.id: UpdateHeader(FEDERATION, 1, d.id, plan1.model_digest) for d in (a, b, c, x)}
        honest = {d: honest_update(shapes, hd, seed=i) for i, (d, hd) in enumerate(h.items())}
        parts_a = chunks(honest["dev-a"], "dev-a", 1)
        assert len(parts_a) == 4

        def variant(seed: int, **kw: Any) -> bytes:
            return honest_update(shapes, h["dev-a"], seed=100 + seed, **kw)

        # ---- chunk level: the envelope, its checksum, the blob digest, the chunk set
        camp.case(
            "random bytes",
            lambda: a.send_chunks(
                [rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes() for _ in range(9)]
                + [b""],
                1,
            ),
            {"bad_chunk": 10},
        )
        camp.case(
            "garbage status, metrics and topic",
            lambda: a.publish(
                [
                    (T.status("dev-a"), b"\x00garbage"),
                    (T.metrics("dev-a"), b"FLEW" + bytes(90)),
                    (T.metrics("dev-a"), rng.bytes(200)),
                    (f"{T.prefix}/update/dev-a/x/0", parts_a[0]),
                    (f"{T.prefix}/update/dev-a/1/-1", parts_a[0]),
                ]
            ),
            {"bad_message": 5},
        )
        camp.case(
            "truncated chunks",
            lambda: a.send_chunks([parts_a[1][:-10], parts_a[2][:30]], 1, [1, 2]),
            {"bad_chunk": 2},
        )
        camp.case(
            "bit flips in chunk bodies",
            lambda: a.send_chunks([sign(p[:500] + bytes([p[500] ^ 4]) + p[501:]) for p in parts_a[:3]], 1),
            {"bad_chunk": 3},
        )
        camp.case(
            "wrong chunk checksum",
            lambda: a.send_chunks([patch(parts_a[3], "crc", read_field(parts_a[3], "crc") ^ 1)], 1, [3]),
            {"bad_chunk": 1},
        )
        v1 = variant(1)
        camp.case(
            "wrong blob digest (4 chunks)",
            lambda: a.send_chunks(chunks(v1, "dev-a", 1, digest="ab" * 32), 1),
            {"bad_chunk": 1},
        )
        camp.case(
            "wrong blob digest (1 chunk)",
            lambda: a.send_chunks(chunks(v1, "dev-a", 1, size=1 << 20, digest="cd" * 32), 1),
            {"bad_chunk": 1},
        )
        camp.case(
            "truncated chunk set (3 of 4)",
            lambda: a.send_chunks(chunks(variant(2), "dev-a", 1)[:3], 1),
            {},
            later=1,
        )
        # a chunk that contradicts the device's own blob (count field) -- then the honest chunks come
        camp.case(
            "chunk contradicting the blob's other chunks",
            lambda: a.send_chunks([patch(parts_a[0], "count", 5)], 1),
            {},
            later=1,
        )
        for i in range(20):
            vp = chunks(variant(10 + i), "dev-a", 1)
            k = int(rng.integers(0, 4))
            camp.mutations(f"random mutation {i}", partial(a.send_chunks, [mutate(rng, vp[k])], 1, [k]), 1)
        camp.sync(a)
        # ---- blob level: decodes, but is not an acceptable update
        fc = ("fc.bias", (10,))
        for what, bits in (("NaN value", NAN), ("+Inf value", POS_INF), ("-Inf value", NEG_INF)):
            blob = with_bad_value(h["dev-a"], *fc, bits)
            camp.case(what, partial(a.send, blob, 1), {"malformed": 1})  # the decoder refuses them
            ack = a.ack(digest(blob))
            assert ack.status == "rejected" and "NaN or Inf" in ack.reason
        huge = variant(3, scale=10.0)
        camp.case("huge norm (norm_bound 5, reject)", lambda: a.send(huge, 1), {"norm": 1})
        assert a.ack(digest(huge)).status == "rejected"
        camp.case(
            "wrong tensor shape",
            lambda: a.send(sparse_update(h["dev-a"], "fc.bias", (11,), [0.1]), 1),
            {"malformed": 1},
        )
        camp.case(
            "unknown tensor",
            lambda: a.send(sparse_update(h["dev-a"], "evil.weight", (4,), [0.1]), 1),
            {"malformed": 1},
        )
        camp.case(
            "round inside the blob differs",
            lambda: a.send(
                sparse_update(UpdateHeader(FEDERATION, 7, "dev-a", plan1.model_digest), *fc, [0.1]), 1
            ),
            {"malformed": 1},
        )
        camp.case(
            "another device's name inside the blob",
            lambda: a.send(
                sparse_update(UpdateHeader(FEDERATION, 1, "dev-b", plan1.model_digest), *fc, [0.1]), 1
            ),
            {"wrong_sender": 1},
        )
        camp.case(
            "deltas against another model",
            lambda: a.send(sparse_update(UpdateHeader(FEDERATION, 1, "dev-a", "ee" * 32), *fc, [0.1]), 1),
            {"wrong_model": 1},
        )
        big = rng.bytes(700_000)
        camp.case(
            "oversize (700 kB > max_update_bytes)",
            lambda: a.send_chunks(chunks(big, "dev-a", 1)[:1], 1),
            {"oversize": 1},
        )
        # ---- who and when: future round, unselected device
        future = honest_update(shapes, UpdateHeader(FEDERATION, 2, "dev-a", plan1.model_digest), seed=40)
        camp.case("update for a future round", lambda: a.send(future, 2), {"future_round": 1})
        assert a.ack(digest(future)).status == "rejected"
        camp.case("update from an unselected device", lambda: x.send(honest["dev-x"], 1), {"not_selected": 1})
        assert x.ack(digest(honest["dev-x"])).status == "not_selected"
        # ---- the honest updates, in a known order, and replays of an accepted one
        assert a.ack(a.send(honest["dev-a"], 1)).status == "accepted"
        camp.case(
            "replays of an accepted update",
            lambda: [a.send(honest["dev-a"], 1) for _ in range(2)],
            {"duplicate": 2},
        )
        assert b.ack(b.send(honest["dev-b"], 1)).status == "accepted"
        assert c.ack(c.send(honest["dev-c"], 1)).status == "accepted"

        plan2 = a.plan(2)
        g0 = initial_global_state(coord.strategy, 0)
        g1 = fold(coord, g0, [honest[d] for d in SELECTED])
        assert plan2.model_digest == model_blob(g1).digest, "round 1's bad inputs changed the model"
        round1 = camp.check_round(
            wait_until(lambda: coord.history[:1], 10, "round 1's metrics")[0]["rejected"]
        )

        # ---- round 2: the past (a replay of round 1, a late update), the future, noise; then honest
        h2 = {d.id: UpdateHeader(FEDERATION, 2, d.id, plan2.model_digest) for d in (a, b, c)}
        camp.case(
            "replay of last round's accepted update", lambda: a.send(honest["dev-a"], 1), {"duplicate": 1}
        )
        camp.case("update for a past round", lambda: x.send(honest["dev-x"], 1), {"late": 1})
        assert x.ack(digest(honest["dev-x"])).status == "late"
        camp.case(
            "update for a round past the last",
            lambda: a.send(
                honest_update(shapes, UpdateHeader(FEDERATION, 3, "dev-a", plan2.model_digest), seed=41), 3
            ),
            {"future_round": 1},
        )
        camp.case(
            "random bytes (round 2)",
            lambda: b.send_chunks([rng.bytes(64) for _ in range(5)], 2),
            {"bad_chunk": 5},
        )
        honest2 = {d: honest_update(shapes, hd, seed=50 + i) for i, (d, hd) in enumerate(h2.items())}
        for dev in (a, b, c):
            assert dev.ack(dev.send(honest2[dev.id], 2)).status == "accepted"
        thread.join(60)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished
        g2 = fold(coord, g1, [honest2[d] for d in SELECTED])
        assert all(torch.equal(result.global_state[k], g2[k]) for k in g2), (
            "round 2's bad inputs changed the model"
        )

        # every rejection: a counter in metrics.jsonl (per round and cumulative) and a logged reason
        lines = result.history
        total = round1 + camp.check_round(lines[1]["rejected"])
        assert {k: v for k, v in result.counters.items() if v} == dict(total)
        assert sum(total.values()) == camp.tried
        logged = [r for r in caplog.records if r.name == "coordinator.inbox" and r.levelno == logging.WARNING]
        assert len(logged) == camp.tried
        assert Counter(r.getMessage().split(":")[0] for r in logged) == total
        assert [r["accepted"] for r in lines] == [3, 3]
        camp.record()
    finally:
        for d in (a, b, c, x):
            d.close()
        coord.stop()
