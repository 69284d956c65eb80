"""Every ``flayer ...`` command line in README.md and docs/ (in code blocks) parses with the real parser:
a renamed or removed flag breaks the build, not the reader. Commands are parsed, never run."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*(?:```|~~~)\s*(\w*)")
SHELL = {"", "bash", "sh", "shell", "console"}  # blocks of commands; in others (text, toml...) only "$ " lines


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, language, lines) of every fenced code block."""
    blocks: list[tuple[int, str, list[str]]] = []
    current: list[str] | None = None
    start, lang = 0, ""
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if current is None:
                current, start, lang = [], n + 1, m.group(1)
            else:
                blocks.append((start, lang, current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def commands(lines: list[str], prompt_only: bool = False) -> list[tuple[int, str]]:
    """(offset, command) of every line that runs ``flayer`` (a ``$ `` prompt allowed; required when
    ``prompt_only``, for blocks of output), with backslash continuations joined."""
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        first = i
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        i += 1
        if prompt_only and not line.startswith("$ "):
            continue
        line = line.removeprefix("$ ").strip()
        if line.startswith("flayer ") or line == "flayer":
            out.append((first, line))
    return out


def found() -> list[tuple[str, str]]:
    cases = []
    for path in doc_files():
        for start, lang, lines in code_blocks(path.read_text(encoding="utf-8")):
            for offset, command in commands(lines, prompt_only=lang not in SHELL):
                cases.append((f"{path.relative_to(ROOT)}:{start + offset}", command))
    return cases


CASES = found()


SHELL_OPERATORS = frozenset({">", ">>", "<", "|", "&&", "||", ";", "2>&1", "&"})


class _Refused(Exception):
    pass


def parse(parser: argparse.ArgumentParser, command: str) -> argparse.Namespace:
    words = shlex.split(command, comments=True)
    assert words[0] == "flayer"
    cut = [i for i, w in enumerate(words) if w in SHELL_OPERATORS]  # `flayer ... > FILE`, `| tee`, `&& ...`
    words = words[:cut[0]] if cut else words
    try:
        return parser.parse_args(words[1:])
    except SystemExit as exc:
        raise _Refused(f"exit {exc.code}") from None


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    p = build_parser()

    def refuse(message: str) -> None:  # keep argparse from printing usage and exiting
        raise _Refused(message)

    for sub in _all(p):
        sub.error = refuse  # type: ignore[method-assign]
    return p


def _all(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    from cli.docgen import walk_parsers

    return [q for _, q, _ in walk_parsers(p)]


def test_the_docs_hold_commands() -> None:
    assert len(CASES) >= 40
    assert {c.split()[1] for _, c in CASES} >= {"simulate", "bench", "ablate", "partition", "broker", "coordinator",
                                                "edge", "emulate", "export"}


@pytest.mark.parametrize(("where", "command"), CASES, ids=[w for w, _ in CASES])
def test_command_parses(parser: argparse.ArgumentParser, where: str, command: str) -> None:
    try:
        parse(parser, command)
    except _Refused as exc:
        pytest.fail(f"{where}: {command!r} does not parse: {exc}")


def test_a_wrong_flag_is_caught(parser: argparse.ArgumentParser) -> None:
    with pytest.raises(_Refused):
        parse(parser, "flayer emulate --mode asynchronous")
    with pytest.raises(_Refused):
        parse(parser, "flayer simulate --sample 100")  # an abbreviation of --samples
    assert parse(parser, "flayer simulate --samples 100 --rounds 2  # a comment").samples == 100


def test_continuations_and_prompts_are_joined() -> None:
    lines = ["$ flayer bench --dataset fmnist \\", "    --seeds 0,1 --out runs/b", "not a command", "flayer --version"]
    assert commands(lines) == [(0, "flayer bench --dataset fmnist  --seeds 0,1 --out runs/b"), (3, "flayer --version")]
    assert commands(["flayer   all three mechanisms  0.91", "$ flayer broker stop"], prompt_only=True) == [
        (1, "flayer broker stop")]
    blocks = code_blocks("text\n```text\nflayer x\n```\n```bash\nflayer y\n```\n")
    assert blocks == [(3, "text", ["flayer x"]), (6, "bash", ["flayer y"])]
