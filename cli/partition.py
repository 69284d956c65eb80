"""``flayer partition``: make a partition, show it, save it for every other command to read."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cli.common import CliError, add_common_flags, load_data, run_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("partition", help="split a data set across clients; --show prints it, --save writes it")
    add_common_flags(p, rounds=False, strategy=False)
    p.add_argument("--show", action="store_true", help="print samples and classes per client")
    p.add_argument("--save", metavar="FILE.npz", help="write the partition (indices + JSON summary)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flayer.partition import format_partition, save_partition

    cfg = run_config(args)
    prepared = load_data(cfg)
    if not args.show and not args.save:
        raise CliError("nothing to do: pass --show, --save FILE.npz, or both")
    if args.show:
        print(format_partition(prepared.partition))
    if args.save:
        path = save_partition(prepared.partition, Path(args.save))
        print(f"saved partition to {path}", file=sys.stderr)
    return 0
