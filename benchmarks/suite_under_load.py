"""The default test suite on a busy machine: one core kept busy by a CPU-bound process of our own.

A user's machine (and CI's) is not always idle: a second `flayer simulate` may hold one of the two
cores. This script runs the default suite (`python -m pytest`, which deselects `slow`) while a
single-threaded busy loop of its own occupies one core, stops that process by PID at the end, and
prints the pass count, the wall time against an idle run of the same suite, and the ten slowest tests
of the loaded run beside their idle times.

    python benchmarks/suite_under_load.py                 # idle run, then the loaded run
    python benchmarks/suite_under_load.py --no-idle       # the loaded run only
    python benchmarks/suite_under_load.py --loaders 2 -- tests/integration   # both cores busy, one folder

Exit status: 0 when every run passed, 1 when a run had failures or errors, 2 on bad arguments.
The load process ends by itself after `--max-load-s` even if this script is killed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A bounded CPU-bound loop: it stops by itself after the given number of seconds.
BUSY = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nx = 0\nwhile time.monotonic() < end:\n" \
       "    for _ in range(100000):\n        x += 1\n"


@dataclass
class SuiteRun:
    label: str
    wall_s: float
    returncode: int
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    durations: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.failed == 0 and self.errors == 0 and self.passed > 0


def read_junit(path: Path, run: SuiteRun) -> None:
    """Fill the counts and per-test durations (call phase plus fixtures, as junit reports them)."""
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        run.durations[name] = float(case.get("time", "0") or 0.0)
        if case.find("failure") is not None:
            run.failed += 1
        elif case.find("error") is not None:
            run.errors += 1
        elif case.find("skipped") is not None:
            run.skipped += 1
        else:
            run.passed += 1


def run_suite(label: str, pytest_args: list[str], log_dir: Path) -> SuiteRun:
    junit = log_dir / f"{label}.xml"
    log = log_dir / f"{label}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *pytest_args]
    print(f"[{label}] {' '.join(cmd[2:])}  (log: {log})", flush=True)
    t0 = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    run = SuiteRun(label, time.monotonic() - t0, rc)
    if junit.exists():
        read_junit(junit, run)
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
    print(f"[{label}] {run.wall_s:.0f} s, exit {rc}: {tail[0]}", flush=True)
    return run


def start_load(n: int, max_s: float) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", BUSY, str(max_s)]) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def report(idle: SuiteRun | None, loaded: SuiteRun) -> None:
    runs = [r for r in (idle, loaded) if r is not None]
    print("\nrun      passed  failed  errors  skipped   wall s")
    for r in runs:
        print(f"{r.label:<8} {r.passed:>6}  {r.failed:>6}  {r.errors:>6}  {r.skipped:>7}  {r.wall_s:>7.0f}")
    if idle is not None and idle.wall_s > 0:
        print(f"wall time loaded / idle: {loaded.wall_s / idle.wall_s:.2f}")
    print("\nten slowest tests of the loaded run (s):")
    print(f"{'loaded':>8} {'idle':>8}  test")
    for name, t in sorted(loaded.durations.items(), key=lambda kv: -kv[1])[:10]:
        it = f"{idle.durations[name]:.1f}" if idle is not None and name in idle.durations else "-"
        print(f"{t:>8.1f} {it:>8}  {name}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--no-idle", action="store_true", help="skip the idle reference run")
    p.add_argument("--loaders", type=int, default=1, help="busy processes, one core each (default 1)")
    p.add_argument("--max-load-s", type=float, default=3600.0,
                   help="the load processes stop by themselves after this many seconds (default 3600)")
    p.add_argument("--log-dir", type=Path, default=None, help="where logs and junit files go (default: a temp dir)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args()
    if not 1 <= args.loaders <= (os.cpu_count() or 2):
        p.error(f"--loaders must be between 1 and the number of cores ({os.cpu_count()}), got {args.loaders}")
    if not 10 <= args.max_load_s <= 4 * 3600:
        p.error(f"--max-load-s must be between 10 and 14400, got {args.max_load_s}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="suite-under-load-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    idle = None if args.no_idle else run_suite("idle", args.pytest_args, log_dir)
    load = start_load(args.loaders, args.max_load_s)
    print(f"load: {args.loaders} busy process(es), PID {', '.join(str(q.pid) for q in load)}", flush=True)
    try:
        loaded = run_suite("loaded", args.pytest_args, log_dir)
    finally:
        stop_load(load)
    report(idle, loaded)
    ok = loaded.ok and (idle is None or idle.ok)
    print(f"\n{'PASS' if ok else 'FAIL'}: logs and junit files in {log_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
