"""The empirical privacy audit beside the accountant's epsilon (docs/results/privacy-audit.md).

For each target epsilon, the noise multiplier z the accountant gives at q = 1 (the cohort is public) and
delta 1e-5; then, per adversary (readers of the published models; devices and observers, who also read the
plans and their run seed):

- the many-run audit (:func:`flayer.audit.audit_trials`): ``--trials`` runs of a 3-device federation with a
  canary device and as many without, one round each, and the epsilon lower bound at 95% confidence
  (Clopper-Pearson; the threshold chosen on 30% of the trials, certified on the rest);
- the one-run estimate (:func:`flayer.audit.one_run_estimate`, Andrew et al. 2023): one run of
  ``--rounds`` rounds with ``--canaries`` random canary devices beside the 2 that train.

``--seeded`` adds the same audits of ``flayer simulate --dp-seeded-noise`` (noise drawn from the run seed,
labelled not private) at the first target, to show what the audit finds when the noise can be replayed.

    python benchmarks/privacy_audit.py --targets 1,4,8 --trials 200 --canaries 100 --seeded
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flayer.audit import ADVERSARIES, AuditFederation, audit_trials, one_run_estimate  # noqa: E402
from flayer.engine.accountant import noise_for_target  # noqa: E402

DELTA = 1e-5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="1,4,8", help="accountant epsilons to audit (comma-separated)")
    ap.add_argument("--trials", type=int, default=200, help="runs per world (with and without the canary)")
    ap.add_argument("--canaries", type=int, default=100, help="canary devices in the one-run estimate")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the one-run estimate's federation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeded", action="store_true", help="also audit --dp-seeded-noise at the first target")
    args = ap.parse_args()
    targets = [float(t) for t in args.targets.split(",")]
    cases = [(t, False) for t in targets] + ([(targets[0], True)] if args.seeded else [])
    print(f"delta {DELTA:g}; many-run audit: {args.trials} runs per world, 1 round, 2 training devices + 1 canary, "
          f"95% confidence; one-run: {args.canaries} canaries + 2 training devices, {args.rounds} rounds\n")
    print("| noise | adversary | z | accountant eps (1 round) | audit lower bound | FPR / FNR (certified) "
          "| accountant eps (one-run) | one-run estimate | canary mean cosine x sqrt(d) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for target, seeded in cases:
        t0 = time.perf_counter()
        z1 = noise_for_target(target, DELTA, 1.0, 1)
        audit = audit_trials(AuditFederation(trainers=2, noise_multiplier=z1, delta=DELTA), args.trials, args.seed,
                             seeded_noise=seeded)
        zr = noise_for_target(target, DELTA, 1.0, args.rounds)
        one = one_run_estimate(AuditFederation(trainers=2, canaries=args.canaries, rounds=args.rounds,
                                               noise_multiplier=zr, delta=DELTA), args.seed, seeded_noise=seeded)
        label = "seeded (not private)" if seeded else "CSPRNG (shipped)"
        for adv in ADVERSARIES:
            b = audit.bounds[adv]
            print(f"| {label} | {adv} | {z1:.3f} | {audit.accountant:.3f} | {b.epsilon:.3f} | "
                  f"{b.fpr:.3f} / {b.fnr:.3f} of {b.certified_out}+{b.certified_in} | {one.accountant:.3f} | "
                  f"{one.estimate[adv]:.3f} | {one.canary_mean[adv] * one.dim ** 0.5:.3f} |", flush=True)
        print(f"<!-- {label} target {target:g}: {time.perf_counter() - t0:.0f} s; one-run z {zr:.3f}, d {one.dim}, "
              f"null check mean {one.unobserved_mean['models'] * one.dim ** 0.5:.3f} sd "
              f"{one.unobserved_std['models'] * one.dim ** 0.5:.3f} (units of 1/sqrt(d)); fitted-spread estimates "
              f"{ {a: round(v, 2) for a, v in one.estimate_fitted.items()} } -->", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
