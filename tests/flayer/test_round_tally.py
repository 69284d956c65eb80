"""A round's tally reads the same whatever order its updates arrived in: the round record of a federation over
one broker and of the same federation over a cluster (or a loaded machine) hold the same ``acc`` and
``train_loss``, to the last bit (tests/faults/test_faults_cluster.py compares them)."""

from __future__ import annotations

import math
from itertools import permutations

from flayer.engine import RoundTally

# losses whose float sum depends on the order: (0.1 + 0.2) + 0.3 != (0.3 + 0.2) + 0.1
REPORTS = [
    ("dev-0", {"test_correct": 0.1, "test_total": 1.0, "train_loss": 0.1}),
    ("dev-1", {"test_correct": 0.2, "test_total": 1.0, "train_loss": 0.2}),
    ("dev-2", {"test_correct": 0.3, "test_total": 1.0, "train_loss": 0.3}),
    ("dev-3", {"test_correct": 7.0, "test_total": 9.0, "train_loss": 0.5141146211574474}),
]


def _tally(order: tuple[tuple[str, dict[str, float]], ...]) -> RoundTally:
    t = RoundTally()
    for client, info in order:
        t.add_eval(info, client)
    return t


def test_the_order_of_arrival_does_not_change_the_round_record():
    assert (0.1 + 0.2) + 0.3 != (0.3 + 0.2) + 0.1  # the naive running sum would differ
    losses = [info["train_loss"] for _, info in REPORTS]
    want_loss = math.fsum(losses) / len(losses)
    want_acc = math.fsum(i["test_correct"] for _, i in REPORTS) / math.fsum(i["test_total"] for _, i in REPORTS)
    seen = {(t.train_loss, t.acc) for t in map(_tally, permutations(REPORTS))}
    assert seen == {(want_loss, want_acc)}
    assert _tally(tuple(REPORTS)).device_acc == {c: i["test_correct"] / i["test_total"] for c, i in REPORTS}


def test_nothing_reported_reads_none_and_bad_reports_are_left_out():
    t = RoundTally()
    assert t.acc is None and t.train_loss is None
    t.add_eval({"test_correct": 3.0, "test_total": 0.0, "train_loss": math.nan})  # no test split, no finite loss
    t.add_eval({"test_correct": 5.0, "test_total": 4.0, "train_loss": math.inf})  # more correct than tested
    assert t.acc is None and t.train_loss is None
    t.add_eval({"test_correct": 1.0, "test_total": 4.0, "train_loss": 2.0})
    assert t.acc == 0.25 and t.train_loss == 2.0
