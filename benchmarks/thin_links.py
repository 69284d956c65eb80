"""Thin links: FLAYER's final accuracy against the bytes each client sends and receives.

Runs ``flayer simulate`` (Fashion-MNIST, Dir(0.1), FLAYER) once per (upload setting, delta downloads
on/off, seed) and tabulates the mean over seeds of the personal models' final accuracy and of the MB
per client up and down. Upload settings: fp32 (today's default), fp16, int8, and int8 with a smaller
top-k share (``--keep``, default 0.25 of FLAYER's masked coordinates) and error feedback; delta
downloads use the matching codec (fp32: exact, fp16: fp16, int8: int8). Bytes are the update and
model / delta blobs (the MQTT chunk framing, ~0.1%, is not counted).

It also writes what one round costs on each of the emulator's built-in link profiles: seconds to
send one update and to receive the model (or its delta) at the profile's rate, from the measured
mean bytes per upload and per download (transfer time only: latency and the local round excluded).

Resumable: each run lives in ``OUT/runs/<setting>-<delta>-s<seed>/`` and one that finished is not run
again when its ``bench-settings.json`` records the same ``flayer simulate`` arguments
(:func:`simulate_args`: every setting that changes the result -- clients, samples, rounds, seed,
learning rate, top-k share, codecs -- with the learning rate always named, so a changed default is a new
run); a run made with other settings is run again in its place. Writes ``OUT/results.json``,
``OUT/results.md`` (the table), ``OUT/links.md`` (the per-link costs) and ``OUT/thin_links.png`` (accuracy against MB up and MB down per client).

    python benchmarks/thin_links.py [--seeds 0,1,2] [--rounds 30] [--samples 12000] [--clients 20]
        [--keep 0.25] [--lr LR] [--out docs/results/thin-links]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout: its packages first

SETTINGS = {  # name -> (simulate flags, delta-download mode paired with the upload codec)
    "fp32": ([], "exact"),
    "fp16": (["--value-codec", "fp16"], "fp16"),
    "int8": (["--value-codec", "int8"], "int8"),
    "int8-topk-ef": (["--value-codec", "int8", "--keep", "{keep}", "--error-feedback"], "int8"),
}


def run_name(setting: str, delta: bool, seed: int) -> str:
    return f"{setting}-{'delta' if delta else 'full'}-s{seed}"


SETTINGS_FILE = "bench-settings.json"  # in each run folder: the simulate arguments it was made with


def simulate_args(setting: str, delta: bool, seed: int, args: argparse.Namespace) -> list[str]:
    """The ``flayer simulate`` arguments of one run, ``--out`` and ``--data-dir`` left out: every setting
    that changes its result, the reuse key (module docstring)."""
    from flayer.config import DEFAULT_LRS

    flags, mode = SETTINGS[setting]
    lr = args.lr if args.lr is not None else DEFAULT_LRS["flayer"]
    return ["simulate", "--strategy", "flayer", "--dataset", "fmnist", "--partition", "dir0.1",
            "--clients", str(args.clients), "--samples", str(args.samples), "--rounds", str(args.rounds),
            "--seed", str(seed), "--threads", "1", "--lr", repr(float(lr)),
            *[f.format(keep=args.keep) for f in flags], "--delta-downloads", mode if delta else "off"]


def finished(folder: Path, wanted: list[str]) -> dict[str, Any] | None:
    """The summary of the run in ``folder`` when it finished, did not diverge and was made with the
    arguments ``wanted`` (its settings file says so); else None (run it)."""
    try:
        s = json.loads((folder / "summary.json").read_text())
        recorded = json.loads((folder / SETTINGS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    same = isinstance(recorded, dict) and recorded.get("simulate") == wanted
    return s if same and not s.get("diverged") else None


def run_one(setting: str, delta: bool, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    folder = args.out / "runs" / run_name(setting, delta, seed)
    wanted = simulate_args(setting, delta, seed, args)
    done = finished(folder, wanted)
    if done is not None:
        return done
    (folder / SETTINGS_FILE).unlink(missing_ok=True)  # a run with other settings is replaced
    cmd = [sys.executable, "-m", "cli.main", *wanted, "--out", str(folder)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    t0 = time.perf_counter()
    print(f"{run_name(setting, delta, seed)}: running", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    (folder / "log.txt").parent.mkdir(parents=True, exist_ok=True)
    (folder / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    (folder / SETTINGS_FILE).write_text(json.dumps({"simulate": wanted}, indent=1) + "\n")
    print(f"{run_name(setting, delta, seed)}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads((folder / "summary.json").read_text())


def _model_bytes(folder: Path) -> int:
    """The whole model's blob: round 1's bytes down per client (nobody holds a model before it)."""
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "round" and rec.get("round") == 1:
            return int(rec["bytes_down"]) // max(1, len(rec["selected"]))
    raise SystemExit(f"{folder}: no round 1 in metrics.jsonl")


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def summarise(args: argparse.Namespace, seeds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for setting in SETTINGS:
        for delta in (False, True):
            runs = [run_one(setting, delta, s, args) for s in seeds]
            folder = args.out / "runs" / run_name(setting, delta, seeds[0])
            model = _model_bytes(folder)
            acc, acc_sd = _mean_sd([100 * r["final_personal_acc"] for r in runs])
            up = statistics.fmean(r["upload_bytes_total"] / r["clients"] for r in runs)
            down = statistics.fmean(r["download_bytes_total"] / r["clients"] for r in runs)
            per_upload = statistics.fmean(r["upload_bytes_total"] / r["uploads"] for r in runs)
            per_download = statistics.fmean(r["download_bytes_total"] / r["uploads"] for r in runs)
            rows.append({"setting": setting, "delta": SETTINGS[setting][1] if delta else "off", "seeds": seeds,
                         "acc": acc, "acc_sd": acc_sd, "mb_up": up / 1e6, "mb_down": down / 1e6,
                         "upload_vs_dense_fp32": per_upload / model, "model_bytes": model,
                         "bytes_per_upload": per_upload, "bytes_per_download": per_download,
                         "final_round_acc": statistics.fmean(100 * r["final_round_acc"] for r in runs)})
    return rows


def write(args: argparse.Namespace, rows: list[dict[str, Any]], seeds: list[int]) -> None:
    from cli.plots import _pyplot

    base = next(r for r in rows if r["setting"] == "fp32" and r["delta"] == "off")
    meta = {"command": " ".join(["python benchmarks/thin_links.py", *sys.argv[1:]]), "seeds": seeds,
            "rounds": args.rounds, "samples": args.samples, "clients": args.clients, "keep": args.keep,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [(f"FLAYER on Fashion-MNIST Dir(0.1), {args.clients} clients, {args.samples} images, {args.rounds} "
              f"rounds, seeds {','.join(map(str, seeds))} (mean, and sd over seeds); `{meta['command']}`, "
              f"{meta['date']}."), "",
             ("| upload | delta downloads | personal acc % | vs fp32 (points) | final-round acc % | MB up / client "
              "| MB down / client | upload / dense fp32 |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['delta']} | {r['acc']:.2f} +- {r['acc_sd']:.2f} | "
                     f"{r['acc'] - base['acc']:+.2f} | {r['final_round_acc']:.2f} | {r['mb_up']:.2f} | "
                     f"{r['mb_down']:.2f} | {r['upload_vs_dense_fp32']:.3f} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "links.md").write_text(link_costs(rows))
    plt = _pyplot()
    if plt is None:
        return
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8), dpi=110, sharey=True)
    colours = dict(zip(SETTINGS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for ax, key, what in ((axes[0], "mb_up", "MB up per client"), (axes[1], "mb_down", "MB down per client")):
        for r in rows:
            full = r["delta"] == "off"
            if key == "mb_up" and not full:
                continue  # the same uploads with either download: one point per upload setting
            ax.errorbar(r[key], r["acc"], yerr=r["acc_sd"], fmt="o" if full else "s", color=colours[r["setting"]],
                        mfc=colours[r["setting"]] if full else "white", capsize=3, markersize=7,
                        label=f"{r['setting']} upload, {'full model' if full else 'delta ' + r['delta']}")
        ax.set_xscale("log")
        lo, hi = min(r[key] for r in rows), max(r[key] for r in rows)
        ax.set_xlim(lo / 1.3, hi * 1.3)
        ax.set_xticks([t for t in (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if lo / 1.3 <= t <= hi * 1.3])
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(what + f" ({args.rounds} rounds)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final personal-model accuracy (%)")
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=4)
    fig.suptitle(f"FLAYER, Fashion-MNIST Dir(0.1), {args.clients} clients: accuracy against bytes")
    fig.subplots_adjust(left=0.08, right=0.98, top=0.9, bottom=0.27, wspace=0.08)
    fig.savefig(args.out / "thin_links.png")
    plt.close(fig)


def link_costs(rows: list[dict[str, Any]]) -> str:
    """Seconds per upload and per download on each built-in link profile (transfer time at its rate)."""
    from emulator.profiles import BUILTIN_PROFILES

    links = [p for p in BUILTIN_PROFILES.values() if p.up_mbps > 0 and p.down_mbps > 0]
    head = " | ".join(f"{p.name} ({p.up_mbps:g} / {p.down_mbps:g} Mbit/s)" for p in links)
    out = [("Seconds to send one update (up) and to receive one round's model (down; mean over the rounds, "
            "the first one's whole model included) at each built-in profile's rate."), "",
           f"| upload | delta downloads | kB up | kB down | {head} |",
           "|---|---|---|---|" + "---|" * len(links)]
    for r in rows:
        cells = [f"{8 * r['bytes_per_upload'] / (p.up_mbps * 1e6):.2f} up, "
                 f"{8 * r['bytes_per_download'] / (p.down_mbps * 1e6):.2f} down" for p in links]
        out.append(f"| {r['setting']} | {r['delta']} | {r['bytes_per_upload'] / 1e3:.0f} | "
                   f"{r['bytes_per_download'] / 1e3:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (0,1,2)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--samples", type=int, default=12000, help="seeded stratified subsample of Fashion-MNIST")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--keep", type=float, default=0.25, help="top-k share of the int8 + error feedback setting")
    p.add_argument("--lr", type=float, default=None, help="FLAYER's learning rate (default: simulate's)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/thin-links")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds or args.rounds < 1 or args.samples < args.clients or not 0 < args.keep <= 1:
        p.error("need seeds, --rounds >= 1, --samples >= --clients and --keep in (0, 1]")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = summarise(args, seeds)
    write(args, rows, seeds)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
