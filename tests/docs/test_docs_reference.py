"""The generated reference cannot drift: every flag of every parser and every key of every config
dataclass must be in it, and the CLI parsers accept no abbreviations and show no reST markup."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from cli.configdoc import Table, checks, config_files, config_reference, descriptions
from cli.docgen import cli_reference, option_strings, walk_parsers
from cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


@pytest.fixture(scope="module")
def cli_md(parser: argparse.ArgumentParser) -> str:
    return cli_reference(parser)


def _sections(markdown: str) -> dict[str, str]:
    """Heading text -> the Markdown under it, up to the next heading of any level."""
    parts = re.split(r"^(#{2,4} .*)$", markdown, flags=re.MULTILINE)
    return {parts[i].lstrip("# ").strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_every_command_and_flag_is_in_the_cli_reference(parser: argparse.ArgumentParser, cli_md: str) -> None:
    sections = _sections(cli_md)
    commands = list(walk_parsers(parser))
    assert len(commands) >= 14  # flayer, 9 commands, 4 broker actions
    for path, sub, _ in commands:
        title = f"`{' '.join(path)}`"
        assert title in sections, f"{title} has no section in the CLI reference"
        for flag in option_strings(sub):
            assert f"`{flag}`" in sections[title], f"{title}: flag {flag} missing from its section"


def test_a_flag_missing_from_the_reference_is_detected(parser: argparse.ArgumentParser) -> None:
    """The check above can fail: a parser with one more flag than the reference was rendered from."""
    rendered = _sections(cli_reference(parser))
    extra = build_parser()
    next(sub for path, sub, _ in walk_parsers(extra) if path == ("flayer", "simulate")).add_argument("--brand-new")
    missing = [flag for path, sub, _ in walk_parsers(extra) for flag in option_strings(sub)
               if f"`{flag}`" not in rendered[f"`{' '.join(path)}`"]]
    assert missing == ["--brand-new"]


def test_no_flag_abbreviations(parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]) -> None:
    for path, sub, _ in walk_parsers(parser):
        assert sub.allow_abbrev is False, " ".join(path)
    with pytest.raises(SystemExit) as exc:  # used to be taken as --model sync
        parser.parse_args(["emulate", "--mod", "sync"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --mod sync" in capsys.readouterr().err


def test_help_texts_have_no_restructuredtext_markup(parser: argparse.ArgumentParser) -> None:
    for path, sub, _ in walk_parsers(parser):
        text = sub.format_help()
        assert "``" not in text and ":class:" not in text and ":func:" not in text, " ".join(path)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"flayer {declared}"


def test_every_config_key_is_in_the_config_reference() -> None:
    files = config_files()
    md = config_reference(files)
    sections = _sections(md)
    seen = 0
    for cf in files:
        for table in cf.tables:
            title = next(t for t in sections if t.startswith(cf.title.split(":")[-1].strip())
                         and (table.name in t if table.name != "top level" else t.endswith("top level")))
            for f in table.documented():
                assert f"| `{f.name}` |" in sections[title], f"{cf.title} {table.name}: key {f.name} missing"
                seen += 1
    assert seen > 100


def test_config_reference_covers_every_config_dataclass() -> None:
    """Each loader's dataclass is documented: run, federation, device, emulator, profiles, credentials,
    broker; and every strategy with options has its [strategy.NAME] table."""
    from coordinator.config import FederationSettings
    from edge_client.config import DeviceData, EdgeSettings
    from emulator.options import EmulatorSettings
    from emulator.profiles import DeviceProfile
    from flayer.config import DataConfig, RunConfig, TrainConfig
    from flayer.strategies import STRATEGIES
    from mqtt_broker.config import BrokerConfig
    from transport.credentials import Credentials, TlsSettings

    documented = {t.cls for cf in config_files() for t in cf.tables}
    expected = {RunConfig, DataConfig, TrainConfig, FederationSettings, DeviceData, EdgeSettings,
                EmulatorSettings, DeviceProfile, BrokerConfig, Credentials, TlsSettings}
    expected |= {c.options_type for c in STRATEGIES.values() if dataclasses.fields(c.options_type)}
    assert expected <= documented, expected - documented


def test_checks_and_descriptions_come_from_the_code() -> None:
    from coordinator.config import FederationSettings
    from mqtt_broker.config import BrokerConfig

    rules = checks(FederationSettings)
    assert "over_selection must be in [1, 10]" in rules["over_selection"]
    assert any("fp32" in r and "int8" in r for r in rules["value_codec"])  # evaluated from VALUE_CODECS
    assert "deadline_s must be > 0" in rules["deadline_s"]  # expanded from a loop over names
    assert "port must be an integer in [0, 65535]" in checks(BrokerConfig)["port"]
    assert "unfinished update chunks" in descriptions(FederationSettings)["max_pending_bytes"]
    row = "\n".join(__import__("cli.configdoc", fromlist=["table_rows"]).table_rows(
        Table("[federation]", FederationSettings)))
    assert "| `quorum` | integer | `1` |" in row


def test_reference_pages_hold_their_markers() -> None:
    """The site's hook fills these pages; a page that lost its marker would be empty."""
    from docs_hook import MARKERS  # type: ignore[import-not-found]

    pages = {"<!-- flayer:cli -->": "cli.md", "<!-- flayer:config -->": "config.md",
             "<!-- flayer:api -->": "python-api.md"}
    assert set(pages) == set(MARKERS)
    for marker, page in pages.items():
        assert marker in (ROOT / "docs" / "reference" / page).read_text(), page
        assert "##" in MARKERS[marker]()
