"""Every private mechanism audited with power (docs/results/privacy-audit.md, "Every mechanism, with power").

For each mechanism of :data:`flayer.audit.mechanism.MECHANISMS` (fixed and adaptive clipping, local noise against
the models' readers and against the coordinator, asynchronous versions, secure rounds with central and with
distributed noise), through the code the drivers run (:mod:`flayer.audit.mechanism`):

- **honest** at the noise multiplier that makes the accountant's epsilon ``--target`` for the mechanism's
  adversary (one round, delta 1e-5, q = 1): the 95% lower bound must sit below the accountant's epsilon, and
  within 2x of it for the audit to say anything;
- **twin** at ``--twin-target``: the same mechanism drawing half the noise its plan names while the accountant is
  asked about the plan as named -- a mis-accounted mechanism; the bound must rise above the accountant's epsilon;
- **earlier rule** (adaptive clipping only): the plan an earlier release made (update noise from the clip bits'
  sensitivity taken as 1/2) at the setting z 1.8985, count_stddev 1: the bound rises above its claim.

**banded** (``--dp-noise-kind banded``, 9 rounds, 3 bands, a device in at most 3 rounds 3 apart) is audited over
whole runs (:mod:`flayer.audit.banded`): **honest** with the canary in rounds 0, 3, 6 at the z whose 3-fold
composition is ``--target``; **overlap** with the canary in rounds 0, 1, 2, which the min-separation forbids, at
the same z; **half-noise** at ``--twin-target``, the stream drawing half its named noise. ``--banded-trials`` runs
a world (each a 9-round run).

Every mechanism clips each layer to its own bound (``clip_split = "sqrt"``, the shipped default) but
``fixed-total`` (one bound on the whole upload). Each row states the audit's ceiling: the most its certified
trials could show with no error at all.

    python benchmarks/privacy_audit_mechanisms.py --trials 100000 --secure-trials 30000 --out runs/audit.json
    python benchmarks/privacy_audit_mechanisms.py --mechanisms banded --banded-trials 20000
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flayer.audit.banded import BANDED_MOST, banded_case, run_banded_audit  # noqa: E402
from flayer.audit.mechanism import (  # noqa: E402
    MECHANISMS,
    SECURE_DISTRIBUTED_M,
    half_sensitivity_plan,
    mechanism_case,
    run_audit,
)
from flayer.engine.accountant import noise_for_target  # noqa: E402
from flayer.engine.privacy import RoundPrivacy  # noqa: E402
from flayer.privacy_config import PrivacySettings  # noqa: E402

DELTA, M = 1e-5, 3


EARLIER_SB = 1.0  # count_stddev of the earlier-rule row (the default m / 20 at m = 20)


def earlier_rule(s: PrivacySettings) -> RoundPrivacy:
    """The plan an earlier release built under adaptive clipping at count_stddev :data:`EARLIER_SB`
    (:func:`flayer.audit.mechanism.half_sensitivity_plan`); today's settings refuse z >= sigma_b."""
    return half_sensitivity_plan(s, EARLIER_SB)


def noise_label_epsilon(z: float) -> float:
    """What a ledger that composes a plan's ``noise_multiplier`` label gives for one round at z."""
    from flayer.engine.accountant import epsilon_for

    return epsilon_for([(z, 1.0, 1)], DELTA)


def z_for(name: str, target: float) -> float:
    """The multiplier whose one round (banded: whose run, under the schema) costs ``target`` against the
    mechanism's adversary."""
    if name == "banded":
        return noise_for_target(target, DELTA, 1.0, BANDED_MOST)
    z = noise_for_target(target, DELTA, 1.0, 1)
    return z * math.sqrt(M) if MECHANISMS[name][4] == "coordinator" else z  # its share alone: z / sqrt(m)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mechanisms", default=",".join([*MECHANISMS, "banded"]))
    ap.add_argument("--target", type=float, default=8.0, help="the accountant's epsilon of the honest rows")
    ap.add_argument("--secure-target", type=float, default=4.0,
                    help="the honest rows' epsilon for the secure mechanisms (their trials cost ~8 ms each: fewer)")
    ap.add_argument("--twin-target", type=float, default=2.0, help="the accountant's epsilon of the twin rows")
    ap.add_argument("--trials", type=int, default=100_000, help="rounds per world (with and without the canary)")
    ap.add_argument("--secure-trials", type=int, default=30_000, help="rounds per world of the secure mechanisms")
    ap.add_argument("--banded-trials", type=int, default=20_000, help="runs per world of the banded rows")
    ap.add_argument("--rows", default="honest,twin,earlier rule,overlap",
                    help="which rows to run (comma-separated; banded's half-noise row is its twin)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    rows = []
    print(f"delta {DELTA}, m = {M}, one round, q = 1; 95% Clopper-Pearson bounds, threshold chosen on 30% of the "
          f"trials; honest rows at epsilon {a.target:g} ({a.secure_target:g} secure), twins (half the named noise) at {a.twin_target:g}", flush=True)
    print("| mechanism | adversary | row | z | trials / world | accountant eps | audit 95% lower bound | "
          "Gaussian-DP estimate | ceiling | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = []
    for name in a.mechanisms.split(","):
        if name == "banded":
            cases += [(name, "honest", z_for(name, a.target), 1.0, None, None),
                      (name, "overlap", z_for(name, a.target), 1.0, None, None),
                      (name, "twin", z_for(name, a.twin_target), 0.5, None, None)]
            continue
        secure = MECHANISMS[name][2]
        cases.append((name, "honest", z_for(name, a.secure_target if secure else a.target), 1.0, None, None))
        cases.append((name, "twin", z_for(name, a.twin_target), 0.5, None, None))
        if name == "adaptive":
            cases.append((name, "earlier rule", 1.8985, 1.0, None, earlier_rule))
    for name, row, z, scale, sb, rule in [c for c in cases if c[1] in a.rows.split(",")]:
        if name == "banded":
            t0 = time.perf_counter()
            res = run_banded_audit(banded_case(z, "half-noise" if row == "twin" else row), a.banded_trials)
            rows.append({**res.as_dict(), "row": row, "wall_s": time.perf_counter() - t0})
            print(f"| {res.name} | {res.adversary} | {row} | {z:.4g} | {a.banded_trials} runs | {res.claimed:.3f} | "
                  f"{res.bound.epsilon:.3f} | {res.gdp_estimate:.3f} (4-sigma lower {res.gdp_lower:.3f}) | "
                  f"{res.ceiling:.2f} | {res.seconds:.0f} |", flush=True)
            if a.out is not None:
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps(rows, indent=1))
            continue
        trials = a.secure_trials if MECHANISMS[name][2] else a.trials
        t0 = time.perf_counter()
        # the earlier rule's claim is what the earlier accountant composed: the plan's label z
        claim = noise_label_epsilon(z) if rule is not None else None
        m = SECURE_DISTRIBUTED_M if name == "secure-distributed" else M
        res = run_audit(mechanism_case(name, z, m, count_stddev=sb, noise_scale=scale, rp_of=rule), trials,
                        claimed=claim)
        d = {**res.as_dict(), "row": row, "wall_s": time.perf_counter() - t0}
        rows.append(d)
        print(f"| {name} | {res.adversary} | {row} | {z:.4g} | {trials} | {res.claimed:.3f} | {res.bound.epsilon:.3f} | "
              f"{res.gdp_estimate:.3f} | {res.ceiling:.2f} | {res.seconds:.0f} |", flush=True)
        if a.out is not None:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
