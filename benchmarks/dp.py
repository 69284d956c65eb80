"""Accuracy against epsilon: private FLAYER and FedAvg on Fashion-MNIST Dir(0.1) with a sampled population.

Per method and target epsilon, the noise multiplier z that spends the target over the planned rounds is
taken from the accountant at q = 1 (the cohort is public: ``flayer.engine.accountant.noise_for_target``, the
figure ``flayer simulate --dp-plan`` prints, rounded up to 4 decimals), at the default delta
min(1e-5, 1/(10 N)); the run is ``flayer simulate --dp central --dp-noise z --target-epsilon EPS``, its
noise from the CSPRNG. ``none`` is the run without ``[privacy]``; ``public`` is FLAYER without noise but
with the private runs' data-independent positions (``--set flayer.positions=public``), against its top-k.
``--variants`` adds the clip's cost without noise (``flayer simulate --clip-only C``, not private, no epsilon):
``clip`` sums the clipped uploads over the fixed denominator m as private rounds do, ``clip-weighted`` averages
them by sample counts. ``--server-lr`` / ``--server-momentum`` (comma lists: their grid) add the server step
(``--dp-server-lr``, ``--dp-server-momentum``) to the private and clip runs; eta is always named (default
``auto``, the shipped default), so runs made before it, which name no eta and took the plain step, keep their
folders and are tabulated as eta 1.
``--clip-split total|sqrt|equal`` passes ``--dp-clip-split`` (one bound on the upload, or one a layer; the runs
without it before 5 December 2026 ran one bound, the shipped default then), ``--clipping adaptive``
moves C with the noised clip bits (``--dp-clipping adaptive``); both only on the private runs.
``--max-participations K`` (``--min-separation B``) runs under the participation schema: z for K-fold
composition (``noise_for_target(most=K)``), the flags passed on to ``flayer simulate``.
Every run's folder is keyed by a digest of its whole command line (reused only under the same settings:
resumable), and ``--jobs`` runs go side by side, one torch thread each::

    python benchmarks/dp.py --out docs/results/privacy-fmnist
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def noise_for(eps: float, clients: int, join_ratio: float, rounds: int, seed: int,
              most: int | None = None) -> tuple[float, float, float]:
    """(z, q, delta) for ``eps`` over ``rounds`` rounds: q = 1, every participation counted in full (the
    simulator's cohort is drawn from the public seed, as the coordinator's is listed in its plans); z
    rounded up to 4 decimals, so the rounded z still spends at most ``eps``. ``most``: the participation
    schema's max_participations (a device in at most that many rounds: min(rounds, most)-fold)."""
    import math

    from flayer.engine.accountant import noise_for_target
    from flayer.privacy_config import default_delta

    delta = default_delta(clients)
    return math.ceil(noise_for_target(eps, delta, 1.0, rounds, most) * 1e4) / 1e4, 1.0, delta


def step_flags(lr: float | str, momentum: float) -> list[str]:
    """The server step's flags: eta always named ("auto", the default since 5 December 2026, or a number: the runs
    without the flag took eta 1, and their folders keep those keys), beta unless 0."""
    return ["--dp-server-lr", lr if isinstance(lr, str) else f"{lr:g}"] + ([] if momentum == 0 else
                                                                            ["--dp-server-momentum", f"{momentum:g}"])


def schema_flags(a: argparse.Namespace) -> list[str]:
    """The participation schema's flags (none without --max-participations / --min-separation)."""
    return ((["--max-participations", str(a.max_participations)] if a.max_participations else [])
            + (["--min-separation", str(a.min_separation)] if a.min_separation else []))


def clip_flags(a: argparse.Namespace) -> list[str]:
    """Per-layer clip bounds and adaptive clipping's flags (none for the shipped defaults: the runs without them keep
    their folders)."""
    return ((["--dp-clip-split", a.clip_split] if a.clip_split is not None else [])
            + (["--dp-clipping", "adaptive"] if a.clipping == "adaptive" else []))


def local_flags(a: argparse.Namespace) -> list[str]:
    """Local training's flags (none for each method's defaults, whose runs keep their folders)."""
    return ((["--lr", f"{a.local_lr:g}"] if a.local_lr is not None else [])
            + (["--batch-size", str(a.batch_size)] if a.batch_size is not None else []))


def noise_flags(a: argparse.Namespace) -> list[str]:
    """Banded correlated noise's flags (none for independent noise, whose runs keep their folders)."""
    return ["--dp-noise-kind", "banded", "--dp-bands", str(a.bands)] if a.noise_kind == "banded" else []


def command(a: argparse.Namespace, method: str, variant: str, seed: int, lr: float | str = 1.0,
            momentum: float = 0.0) -> list[str]:
    cmd = ["simulate", "--dataset", "fmnist", "--partition", "dir0.1", "--clients", str(a.clients),
           "--samples", str(a.samples), "--join-ratio", str(a.join_ratio), "--rounds", str(a.rounds),
           "--seed", str(seed), "--strategy", method, "--threads", "1"]
    if a.partition_file:  # the saved partition replaces --partition and --samples
        cmd = ["simulate", "--dataset", "fmnist", "--partition-file", str(a.partition_file), "--clients",
               str(a.clients), "--join-ratio", str(a.join_ratio), "--rounds", str(a.rounds), "--seed", str(seed),
               "--strategy", method, "--threads", "1"]
    cmd += local_flags(a)
    if variant == "public":
        return [*cmd, "--set", "flayer.positions=public"]
    if variant in ("clip", "clip-weighted"):  # measurement, not private: no noise, no epsilon
        average = "fixed" if variant == "clip" else "weighted"
        return [*cmd, "--clip-only", str(a.clip), "--clip-average", average, *step_flags(lr, momentum)]
    if variant != "none":
        z, _, _ = noise_for(float(variant), a.clients, a.join_ratio, a.rounds, seed, a.max_participations)
        cmd += ["--dp", a.dp_mode, "--dp-clip", str(a.clip), "--dp-noise", f"{z:.4f}", "--target-epsilon", variant,
                *step_flags(lr, momentum), *schema_flags(a), *noise_flags(a), *clip_flags(a)]
    return cmd


def run_one(out: Path, cmd: list[str], name: str, deadline: float | None = None) -> dict[str, Any] | None:
    """Run ``cmd`` unless its folder holds a summary (resumable); append the finished run to
    ``out/runs.jsonl`` (one line per run, keyed by the command's digest, written once). ``None``: not run,
    the ``deadline`` (a UTC timestamp) has passed."""
    key = hashlib.sha256("\0".join(cmd).encode()).hexdigest()[:12]
    folder = out / f"{name}-{key}"
    if not (folder / "summary.json").exists():
        if deadline is not None and time.time() > deadline:
            print(f"{name}: not started, past the deadline", file=sys.stderr)
            return None
        t0 = time.perf_counter()
        with open(out / f"{name}-{key}.log", "w") as fh:
            subprocess.run([sys.executable, "-m", "cli.main", *cmd, "--out", str(folder)], cwd=ROOT, check=True,
                           stdout=fh, stderr=subprocess.STDOUT)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    (folder / "command.txt").write_text("flayer " + " ".join(cmd) + "\n")
    summary = json.loads((folder / "summary.json").read_text())
    log = out / "runs.jsonl"
    done = {json.loads(line)["key"] for line in log.read_text().splitlines() if line.strip()} if log.exists() else set()
    if key not in done:
        keep = ("strategy", "seed", "clients", "rounds", "best_acc", "final_round_acc", "final_personal_acc", "acc",
                "epsilon", "delta", "diverged", "budget_stop", "wall_seconds", "cpu_seconds")
        with open(log, "a") as fh:
            fh.write(json.dumps({"key": key, "name": name, "command": "flayer " + " ".join(cmd),
                                 **{k: summary.get(k) for k in keep}}) + "\n")
    return {"cmd": cmd, **summary}


def name(method: str, variant: str, seed: int, lr: float | str = "auto", momentum: float = 0.0) -> str:
    """A run's folder prefix: method, variant, seed, and the server step unless plain."""
    return f"{method}-{variant}-s{seed}" + ("" if (lr, momentum) in (("auto", 0), (1, 0))
                                           else f"-lr{lr if isinstance(lr, str) else format(lr, 'g')}-m{momentum:g}")


def step_text(lr: float | str, ran: list[float] | None) -> str:
    """eta as a table shows it: a number, or "auto (eta it resolved to)"."""
    if isinstance(lr, str):
        return f"{lr} ({ran[0]:g})" if ran else lr
    return f"{lr:g}"


def step_label(cmd: list[str], summary: dict[str, Any]) -> str:
    """A run's server step "eta/beta" from its command (no flag: eta 1, the runs before "auto")."""
    lr = _flag(cmd, "--dp-server-lr", "1") or "1"
    return f"{step_text(lr if lr == 'auto' else float(lr), summary.get('server_step'))}/" \
           f"{float(_flag(cmd, '--dp-server-momentum', '0') or 0):g}"


def _flag(cmd: list[str], name: str, default: str | None = None) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else default


def summarize(out: Path, table: str) -> list[dict[str, Any]]:
    """Every finished run under ``out`` grouped by (method, privacy, noise mode) over its seeds: mean and
    standard deviation (n - 1) of the accuracies, the epsilon spent, the rounds run and how many diverged."""
    import statistics

    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    cmds = {p: (p.parent / "command.txt").read_text().split()[1:] for p in sorted(out.glob("*/summary.json"))}
    def clip_of(c: list[str]) -> str | None:
        return _flag(c, "--dp-clip") if "--dp-clip" in c else _flag(c, "--clip-only") if "--clip-only" in c else None

    clips = {clip_of(c) for c in cmds.values()} - {None}  # C named only where runs differ in it
    for summary, cmd in cmds.items():
        s = json.loads(summary.read_text())
        variant = "public" if "flayer.positions=public" in cmd else _flag(cmd, "--target-epsilon", "none")
        if "--clip-only" in cmd:
            variant = "clip" if _flag(cmd, "--clip-average") == "fixed" else "clip-weighted"
        mode = _flag(cmd, "--dp", "-") or "-"
        mode += f" banded {_flag(cmd, '--dp-bands')}" if _flag(cmd, "--dp-noise-kind") == "banded" else ""
        mode += f", C {clip_of(cmd)}" if len(clips) > 1 and clip_of(cmd) is not None else ""
        split = _flag(cmd, "--dp-clip-split")
        mode += "" if split is None else ", one bound" if split == "total" else f" per layer ({split})"
        mode += " adaptive" if _flag(cmd, "--dp-clipping") == "adaptive" else ""
        mode += f", local lr {_flag(cmd, '--lr')}" if "--lr" in cmd else ""
        mode += f", batch {_flag(cmd, '--batch-size')}" if "--batch-size" in cmd else ""
        step = step_label(cmd, s)
        groups.setdefault((str(_flag(cmd, "--strategy")), str(variant), mode, step), []).append(s)
    order = {"none": 0, "public": 1, "clip-weighted": 2, "clip": 3, "8": 4, "4": 5, "1": 6}
    rows = []
    for (method, variant, mode, step), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9),
                                                                                       kv[0][2], kv[0][3])):
        def stat(key: str) -> tuple[float, float]:
            xs = [float(r[key]) for r in runs if r.get(key) is not None]
            return (statistics.mean(xs) if xs else float("nan")), statistics.stdev(xs) if len(xs) > 1 else 0.0

        eps = [r["epsilon"] for r in runs if isinstance(r["epsilon"], (int, float))]
        rows.append({"method": method, "variant": variant, "mode": mode, "server_step": step,
                     "seeds": sorted(r["seed"] for r in runs), "best_val_acc": stat("best_val_acc"),
                     "best_acc": stat("best_acc"), "final_round_acc": stat("final_round_acc"),
                     "final_personal_acc": stat("final_personal_acc"),
                     "epsilon": statistics.mean(eps) if eps else None,
                     "rounds": [len(r["acc"]) for r in runs], "diverged": sum(bool(r["diverged"]) for r in runs),
                     "upload_kb": statistics.mean(r["upload_bytes_total"] / max(1, r["uploads"]) / 1e3 for r in runs)})
    steps = any(r["server_step"] != "1/0" or r["best_val_acc"][0] == r["best_val_acc"][0] for r in rows)  # val: not NaN
    lines = ["| method | privacy | noise |" + (" server step eta/beta | best val acc |" if steps else "")
             + " seeds | epsilon spent (mean) | rounds run | best acc | final-round acc "
             "| personal acc | upload KB per update |", "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if steps else "")]
    for r in rows:
        priv = {"none": "none" + (" (top-k)" if r["method"] == "flayer" else ""),
                "public": "none, public positions", "clip": "clip only, fixed m (not private)",
                "clip-weighted": "clip only, weighted average (not private)"}.get(r["variant"], f"target {r['variant']}")
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        rounds = "/".join(str(x) for x in r["rounds"]) + (f" ({r['diverged']} diverged)" if r["diverged"] else "")
        acc = " | ".join(f"{m:.4f} ± {sd:.4f}" for m, sd in (r["best_acc"], r["final_round_acc"],
                                                             r["final_personal_acc"]))
        val = f" {r['server_step']} | {r['best_val_acc'][0]:.4f} ± {r['best_val_acc'][1]:.4f} |" if steps else ""
        lines.append(f"| {r['method']} | {priv} | {r['mode']} |{val} {len(r['seeds'])} | {eps} | {rounds} | {acc} "
                     f"| {r['upload_kb']:.1f} |")
    (out / table).parent.mkdir(parents=True, exist_ok=True)
    (out / f"{table}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / f"{table}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/privacy-fmnist")
    p.add_argument("--methods", default="flayer,fedavg")
    p.add_argument("--epsilons", default="none,8,4,1")
    p.add_argument("--seeds", default="0")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--join-ratio", type=float, default=0.2)
    p.add_argument("--samples", type=int, default=40000)  # Dir(0.1) over 100 clients needs >= 40 each
    p.add_argument("--partition-file", type=Path, default=None,
                   help="a saved partition (benchmarks/partition_devices.py) instead of Dir(0.1) over --samples")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--dp-mode", choices=("central", "local"), default="central",
                   help="who adds the noise: the coordinator (central) or each device its share (local)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--deadline", default=None, metavar="HH:MM",
                   help="start no new run after this UTC time today (finished runs are still tabulated)")
    p.add_argument("--table", default="results", help="the table files written, relative to --out (NAME.md, NAME.json)")
    p.add_argument("--variants", default="",
                   help="extra runs without noise, comma-separated: clip (clipped, over the fixed m), clip-weighted "
                        "(clipped, sample-weighted average); not private, no epsilon")
    p.add_argument("--server-lr", default="auto",
                   help="server step eta, comma-separated (a grid with --server-momentum); auto: the shipped default")
    p.add_argument("--server-momentum", default="0", help="server step beta, comma-separated")
    p.add_argument("--max-participations", type=int, default=None, metavar="K",
                   help="participation schema: each device in at most K rounds; z from K-fold composition")
    p.add_argument("--min-separation", type=int, default=0, metavar="B", help="participation schema: B rounds apart")
    p.add_argument("--noise-kind", choices=("independent", "banded"), default="independent",
                   help="central noise: independent draws, or banded correlated noise (--dp-noise-kind)")
    p.add_argument("--bands", type=int, default=5, help="banded noise: the strategy's bands (<= --min-separation)")
    p.add_argument("--clip-split", choices=("total", "sqrt", "equal"), default=None,
                   help="C over the whole upload, or a bound a layer (--dp-clip-split; unset: the shipped default, "
                        "sqrt since 5 December 2026, total before)")
    p.add_argument("--clipping", choices=("fixed", "adaptive"), default="fixed",
                   help="adaptive: C follows the noised clip bits from --clip on (--dp-clipping adaptive)")
    p.add_argument("--local-lr", type=float, default=None,
                   help="the devices' base learning rate (--lr; unset: each method's default)")
    p.add_argument("--batch-size", type=int, default=None, help="the devices' batch size (unset: the default, 10)")
    p.add_argument("--no-public", action="store_true", help="leave out FLAYER's public positions without noise")
    p.add_argument("--summary", action="store_true",
                   help="run nothing: tabulate every finished run under --out over its seeds (mean ± std)")
    a = p.parse_args()
    if a.summary:
        summarize(a.out, a.table)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    grid = [(lr if lr == "auto" else float(lr), float(mom)) for lr in a.server_lr.split(",")
            for mom in a.server_momentum.split(",")]
    variants = [v for v in a.epsilons.split(",") if v] + [v for v in a.variants.split(",") if v]
    jobs = [(m, v, s, lr, mom) for s in (int(x) for x in a.seeds.split(",")) for m in a.methods.split(",")
            for v in variants for lr, mom in (grid if v != "none" else [(1.0, 0.0)])]
    if "flayer" in a.methods.split(",") and not a.no_public:
        jobs += [("flayer", "public", s, 1.0, 0.0) for s in (int(x) for x in a.seeds.split(","))]
    deadline = None
    if a.deadline:
        import datetime as dt

        hh, mm = (int(x) for x in a.deadline.split(":"))
        now = dt.datetime.now(dt.timezone.utc)
        deadline = now.replace(hour=hh, minute=mm, second=0, microsecond=0).timestamp()
    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(lambda j: (j, run_one(a.out, command(a, *j), name(*j), deadline)), jobs))
    rows = []
    for (method, variant, seed, lr, mom), s in results:
        if s is None:
            continue
        z = None if variant in ("none", "public", "clip", "clip-weighted") else noise_for(float(variant), a.clients, a.join_ratio, a.rounds,
                                                                  seed, a.max_participations)[0]
        rows.append({"method": method, "variant": variant, "seed": seed, "z": z, "server_lr": lr,
                     "server_step_ran": s.get("server_step"),
                     "server_momentum": mom, "best_val_acc": s.get("best_val_acc"), "epsilon": s["epsilon"],
                     "delta": s["delta"], "rounds_run": len(s["acc"]), "best_acc": s["best_acc"],
                     "final_round_acc": s["final_round_acc"], "final_personal_acc": s["final_personal_acc"],
                     "upload_bytes_per_upload": s["upload_bytes_total"] / max(1, s["uploads"]),
                     "wall_s": s["wall_seconds"], "diverged": s["diverged"], "command": "flayer " + " ".join(s["cmd"])})
    (a.out / a.table).parent.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.table}.json").write_text(json.dumps(rows, indent=1) + "\n")
    header = ("| method | privacy | z | server step eta/beta | epsilon spent | rounds | best val acc | best acc "
              "| final-round acc | personal acc | upload KB per update | wall s |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        none = "none (top-k)" if r["method"] == "flayer" else "none"
        priv = {"none": none, "public": "none, public positions", "clip": "clip only, fixed m (not private)",
                "clip-weighted": "clip only, weighted (not private)"}.get(r["variant"],
                                                                          f"target {r['variant']} ({a.dp_mode})")
        bv = "-" if r["best_val_acc"] is None else f"{r['best_val_acc']:.4f}"
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}" if isinstance(r["epsilon"], float) else r["epsilon"]
        lines.append(f"| {r['method']} | {priv} | {'-' if r['z'] is None else format(r['z'], '.3f')} "
                     f"| {step_text(r['server_lr'], r['server_step_ran'])}/{r['server_momentum']:g} | {eps} "
                     f"| {r['rounds_run']}{' (diverged)' if r['diverged'] else ''} | {bv} | {r['best_acc']:.4f} | {r['final_round_acc']:.4f} "
                     f"| {r['final_personal_acc']:.4f} | {r['upload_bytes_per_upload'] / 1e3:.1f} | {r['wall_s']:.0f} |")
    (a.out / f"{a.table}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
