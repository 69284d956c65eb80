"""make test builds the site with --strict, in a way that can fail: mkdocs 1.6 with --quiet does not
count the warnings --strict is meant to fail on, so the recipe must not pass it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recipe(makefile: str, target: str) -> tuple[list[str], list[str]]:
    """(prerequisites, recipe lines) of ``target``."""
    m = re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n)*)", makefile, flags=re.MULTILINE)
    assert m, f"no target {target!r}"
    return m.group(1).split(), [line.strip() for line in m.group(2).splitlines()]


def test_make_test_builds_the_docs_strictly() -> None:
    makefile = (ROOT / "Makefile").read_text()
    prereqs, _ = recipe(makefile, "test")
    assert "docs" in prereqs
    _, lines = recipe(makefile, "docs")
    build = [line for line in lines if "mkdocs build" in line]
    assert len(build) == 1 and "--strict" in build[0]
    assert not re.search(r"\s(--quiet|-q)(\s|$)", build[0]), build[0]
    site = re.search(r"--site-dir\s+(\S+)", build[0])
    assert site is not None
    assert f"{site.group(1).rstrip('/')}/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_docs_extra_is_installed_by_make_test() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    docs = project["optional-dependencies"]["docs"]
    assert any(d.startswith("mkdocs>=") for d in docs) and any(d.startswith("mkdocs-material") for d in docs)
    _, lines = recipe((ROOT / "Makefile").read_text(), "$(VENV)/.stamp-all")
    install = next(line for line in lines if "pip install" in line and "-e" in line)
    assert "docs" in re.search(r"\[([^\]]*)\]", install).group(1).split(",")  # type: ignore[union-attr]
