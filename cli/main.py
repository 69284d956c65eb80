"""Entry point of the ``flayer`` command. Each subcommand lives in its own module with
``add_parser(subparsers)`` and ``run(args) -> int``; heavy imports happen inside ``run``."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import import_module, metadata
from typing import Any

# subcommand -> module under cli/ (order = order in --help)
SUBCOMMANDS = {
    "partition": "cli.partition",
    "simulate": "cli.simulate",
    "bench": "cli.bench",
    "tune": "cli.tune",
    "ablate": "cli.ablate",
    "broker": "cli.broker",
    "coordinator": "cli.coordinator",
    "edge": "cli.edge",
    "emulate": "cli.emulate",
    "status": "cli.status",
    "dashboard": "cli.dashboard",
    "export": "cli.export",
    "models": "cli.models",
}


class Parser(argparse.ArgumentParser):
    """Every ``flayer`` parser: no prefix matching of long flags (``--mode`` must not become ``--model``),
    and help text shown without the reStructuredText markup of the docstrings it comes from.
    Sub-parsers are built with the class of their parent, so the whole tree gets both."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        if kwargs.get("description"):
            kwargs["description"] = plain_text(kwargs["description"])
        super().__init__(*args, **kwargs)


def plain_text(text: str) -> str:
    """Help text without reStructuredText literals: ``x`` -> x."""
    return text.replace("``", "")


def version() -> str:
    try:
        return metadata.version("flayer-edge")
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        from flayer import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="flayer", description="FLAYER Edge: personalized federated learning "
                    "on edge fleets over MQTT")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in SUBCOMMANDS.items():
        import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (cli.unit: --print-unit)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cli.common import CliError

    try:
        if getattr(args, "log_file", None):
            from cli.logfile import log_to_file

            log_to_file(args.log_file)
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"flayer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"flayer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
