"""Per-device epsilon of the private runs ``benchmarks/dp.py`` made: the federation's epsilon is that of a
device in every round, a device that took part in k of the rounds spent the Gaussian mechanism composed k
times. For every finished private run under ``--out`` (its ``command.txt`` and ``summary.json``) the
cohorts are re-drawn with the simulator's own selection (``flayer.engine.selection.select_clients``: the
run seed, round by round), each device's participations counted over the rounds the run's accountant
composed, and its epsilon computed at q = 1 and the run's delta (``flayer.engine.accountant.epsilon_for``,
what a device's own ledger states). Printed and written as ``OUT/TABLE.md`` / ``.json``: per method and
target, over seeds, the share of devices at each participation count and the min / median / max of
the per-device epsilon::

    python benchmarks/dp_devices.py --out docs/results/privacy-fmnist-q1-c0.1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def composed_rounds(z: float, epsilon: float, delta: float, limit: int) -> int:
    """The number of rounds at multiplier ``z`` whose composition is the run's stated ``epsilon``."""
    from flayer.engine.accountant import epsilon_for

    return min(range(limit + 1), key=lambda r: abs(epsilon_for([(z, 1.0, r)], delta) - epsilon))


def device_epsilons(cmd: list[str], summary: dict[str, Any]) -> tuple[int, list[int], list[float]]:
    """(rounds composed, participations per device, epsilon per device) of one private run."""
    from flayer.engine.accountant import epsilon_for
    from flayer.engine.selection import select_clients

    n, ratio, seed = int(_flag(cmd, "--clients") or 0), float(_flag(cmd, "--join-ratio") or 1), int(_flag(cmd, "--seed") or 0)
    z, delta = float(_flag(cmd, "--dp-noise") or 0), float(summary["delta"])
    rounds = composed_rounds(z, float(summary["epsilon"]), delta, int(_flag(cmd, "--rounds") or 0))
    counts = Counter(c for r in range(1, rounds + 1) for c in select_clients(n, ratio, seed, r))
    parts = [counts.get(i, 0) for i in range(n)]
    return rounds, parts, [epsilon_for([(z, 1.0, k)], delta) for k in parts]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="a benchmarks/dp.py output folder")
    p.add_argument("--table", default="summary/devices")
    a = p.parse_args()
    groups: dict[tuple[str, str], list[tuple[int, list[int], list[float], float]]] = {}
    for summary_path in sorted(a.out.glob("*/summary.json")):
        cmd = (summary_path.parent / "command.txt").read_text().split()[1:]
        summary = json.loads(summary_path.read_text())
        if "--dp-noise" not in cmd or not isinstance(summary.get("epsilon"), (int, float)):
            continue
        key = (str(_flag(cmd, "--strategy")), str(_flag(cmd, "--target-epsilon")))
        groups.setdefault(key, []).append((*device_epsilons(cmd, summary), float(summary["epsilon"])))
    header = ("| method | target | runs | rounds composed | federation epsilon | devices by rounds taken part in "
              "(share, all runs) | device epsilon min / median / max |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    rows = []
    for (method, target), runs in sorted(groups.items()):
        parts = [k for _, ps, _, _ in runs for k in ps]
        eps = [e for _, _, es, _ in runs for e in es]
        share = Counter(parts)
        hist = ", ".join(f"{k}: {share[k] / len(parts):.0%}" for k in sorted(share))
        rows.append({"method": method, "target": target, "runs": len(runs), "rounds": [r for r, _, _, _ in runs],
                     "federation_epsilon": [f for _, _, _, f in runs], "participations": dict(sorted(share.items())),
                     "device_epsilon": [min(eps), statistics.median(eps), max(eps)]})
        lines.append(f"| {method} | {target} | {len(runs)} | {'/'.join(str(r) for r, _, _, _ in runs)} "
                     f"| {statistics.mean(f for _, _, _, f in runs):.2f} | {hist} "
                     f"| {min(eps):.2f} / {statistics.median(eps):.2f} / {max(eps):.2f} |")
    (a.out / a.table).parent.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.table}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (a.out / f"{a.table}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
