"""Every ``flayer ...`` command line of the fleet pages parses with the real parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from cli.main import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ["tutorials/across-machines.md", "howto/own-model.md", "howto/own-data.md"]


def commands() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        blocks = re.findall(r"```bash\n(.*?)```", (DOCS / page).read_text(), re.DOTALL)
        out += [(page, line.strip()) for b in blocks for line in b.splitlines() if line.strip().startswith("flayer ")]
    return out


def test_the_pages_show_commands() -> None:
    assert len(commands()) >= 8


@pytest.mark.parametrize("page, line", commands())
def test_command_parses(page: str, line: str) -> None:
    build_parser().parse_args(shlex.split(line)[1:])
