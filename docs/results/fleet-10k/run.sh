#!/bin/bash
# The measurement behind docs/results/fleet.md's 5,000 and 10,000 rows (resumable: --resume), run from
# the repository root as runs/bench-10k/run.sh. Its output is kept beside this file: table.md (what it
# printed), progress.log (its progress), w4-fleet.json and w8-fleet.json (each fleet's raw row).
cd "$(dirname "$0")/../../.."  # the repository root
nice -n 10 python benchmarks/fleet.py --configs 5000:100 --workers 4 --skip-limit --resume --out runs/bench-10k/w4
nice -n 10 python benchmarks/fleet.py --configs 10000:100 --workers 8 --skip-limit --resume --out runs/bench-10k/w8
