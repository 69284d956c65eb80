"""The guarantees page cannot drift from the attack tests: every ``tests/attacks/...`` path it names exists,
and it names at least one attack test in every section."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "explanation" / "guarantees.md"


def test_every_attack_test_the_guarantees_page_names_exists() -> None:
    text = PAGE.read_text()
    named = set(re.findall(r"tests/attacks/[A-Za-z0-9_./-]+\.py", text))
    assert len(named) >= 10  # the page names its tests as paths (the pattern still matches them)
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert missing == [], f"{PAGE.name} names attack tests that do not exist: {missing}"
    for path in named:
        assert Path(path).name.startswith("test_attack_"), f"{path}: attack tests are test_attack_<topic>.py"


def test_every_section_of_the_guarantees_page_has_a_test_or_says_it_has_none() -> None:
    sections = re.split(r"^## ", PAGE.read_text(), flags=re.MULTILINE)[1:]
    assert len(sections) >= 7
    for section in sections:
        title = section.splitlines()[0]
        rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| guarantee")]
        assert rows, f"section {title!r} lists no guarantee"
        for row in rows:
            cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
            assert len(cells) == 2, f"{title}: a row needs a guarantee and its attack test: {row[:80]}"
            assert "tests/attacks/" in cells[1] or "no attack test" in cells[1], \
                f"{title}: {cells[0][:60]}... names no attack test and does not say it has none"
