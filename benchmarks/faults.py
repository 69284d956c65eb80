"""The fault-injection and security suite's figures in one table.

Runs the tests marked ``faults`` (tests/faults and the broker's security tests in tests/mqtt_broker:
real processes, a real Mosquitto) with ``FLAYER_FAULTS_LEDGER`` set, so each test records what it
injected or tried and what came of it, then prints one table: faults injected (by type), runs
completed, updates acknowledged to devices vs aggregated by the coordinator; bad inputs tried vs
rejected (by type); unauthorised attempts vs delivered. A second table lists one hostile device's
attacks on a live federation: payloads sent, runs completed, honest updates of the attacked round
lost, coordinator crashes, and the coordinator's peak RSS where it ran as its own process. Totals last.

    python benchmarks/faults.py            # the whole suite, slow tests included (~6 min on 2 cores)
    python benchmarks/faults.py --fast     # only the tests of the default pytest run
    python benchmarks/faults.py --markdown # the table as markdown (for docs/results/faults.md)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from faultledger import ENV, Row, read_rows

from cli.report import table

KIND_NAMES = {"fault": "fault", "bad_input": "bad input", "unauthorised": "unauthorised"}
ATTACK_HEADER = ["attack", "payloads sent", "runs ok", "honest updates lost", "crashes", "peak RSS MB"]


def attacks(rows: list[Row]) -> tuple[list[list[object]], str]:
    """(one table row per attack, the totals line)."""
    mine = [r for r in rows if r.kind == "attack"]
    out: list[list[object]] = [
        [r.what, r.tried, r.ok, r.honest_lost or 0, r.crashes or 0,
         "" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f}"]
        for r in mine
    ]
    return out, (f"attacks tried: {len(mine)} ({sum(r.tried for r in mine)} payloads)  honest updates lost "
                 f"{sum(r.honest_lost or 0 for r in mine)}  crashes {sum(r.crashes or 0 for r in mine)}")


def run_suite(ledger: Path, fast: bool, extra: list[str]) -> tuple[int, str, float]:
    marker = "faults and not slow" if fast else "faults"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/faults",
        "tests/mqtt_broker",
        "-m",
        marker,
        "-q",
        "-p",
        "no:cacheprovider",
        *extra,
    ]
    env = {**os.environ, ENV: str(ledger), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return proc.returncode, (lines[-1] if lines else proc.stderr[-500:]), time.monotonic() - t0


def summarise(rows: list[Row]) -> tuple[list[list[object]], list[list[object]]]:
    """(table rows grouped by kind and type, totals per kind)."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for r in rows:
        what = re.sub(r" \d+$", "s", r.what) if r.kind == "bad_input" else r.what  # "random mutation 7"
        g = groups[(r.kind, what)]
        g[0] += r.tried
        g[1] += r.ok
        g[2] += 1
        g[3] += r.acked or 0
        g[4] += r.aggregated or 0
    out: list[list[object]] = []
    totals: list[list[object]] = []
    for kind in KIND_NAMES:
        mine = [(what, g) for (k, what), g in groups.items() if k == kind]
        for what, (tried, ok, runs, acked, agg) in mine:
            if kind == "fault":
                out.append([KIND_NAMES[kind], what, tried, f"{ok}/{runs}", acked, agg, "", ""])
            elif kind == "bad_input":
                out.append([KIND_NAMES[kind], what, tried, "", "", "", ok, ""])
            else:
                out.append([KIND_NAMES[kind], what, tried, "", "", "", "", ok])
        s = [sum(g[i] for _, g in mine) for i in range(5)]
        if kind == "fault":
            totals.append(
                [
                    f"faults injected: {s[0]}",
                    f"runs completed {s[1]}/{s[2]}",
                    f"updates acknowledged {s[3]}, aggregated {s[4]}",
                ]
            )
        elif kind == "bad_input":
            totals.append([f"bad inputs tried: {s[0]}", f"rejected {s[1]}", ""])
        else:
            totals.append([f"unauthorised attempts: {s[0]}", f"delivered {s[1]}", ""])
    return out, totals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="only the tests of the default run (no slow ones)")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--ledger", type=Path, help="tabulate this ledger file instead of running the suite")
    args, extra = ap.parse_known_args()
    if args.ledger is not None:
        rows = read_rows(args.ledger)
        status = f"ledger {args.ledger}"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            ledger = Path(tmp) / "ledger.jsonl"
            ledger.touch()
            print(f"running the {'fast ' if args.fast else ''}fault and security suite ...", file=sys.stderr)
            rc, last, wall = run_suite(ledger, args.fast, extra)
            rows = read_rows(ledger)
            status = f"pytest: {last} (exit {rc}, {wall:.0f} s wall)"
    body, totals = summarise(rows)
    print(
        table(
            [
                "kind",
                "fault / input / attempt",
                "tried",
                "runs ok",
                "acked",
                "aggregated",
                "rejected",
                "delivered",
            ],
            body,
            markdown=args.markdown,
        )
    )
    attack_rows, attack_total = attacks(rows)
    if attack_rows:
        print()
        print(table(ATTACK_HEADER, attack_rows, markdown=args.markdown))
    print()
    for t in totals:
        print("  ".join(x for x in map(str, t) if x))
    print(attack_total)
    print(status)
    bad = [
        r
        for r in rows
        if (r.kind == "fault" and (not r.ok or (r.acked or 0) > (r.aggregated or 0)))
        or (r.kind == "bad_input" and r.ok != r.tried)
        or (r.kind == "unauthorised" and r.ok)
        or (r.kind == "attack" and (not r.ok or r.honest_lost or r.crashes))
    ]
    return 1 if bad or (args.ledger is None and rc != 0) else 0


if __name__ == "__main__":
    sys.exit(main())
