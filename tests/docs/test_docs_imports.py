"""What may import what (docs/explanation/design.md, "What may import what"), checked on the source:
every ``import`` of one project package by another, at any depth, must be allowed by the table."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# package -> the project packages it may import; packages not listed (new ones) may be imported by
# every package except the pure ones, and are not checked themselves until they get a row here
ALLOWED: dict[str, set[str]] = {
    "flayer": set(),
    "protocol": {"flayer"},
    "export": {"flayer"},
    "mqtt_broker": {"protocol", "flayer"},  # flayer.files only: the one place state is written private
    "coordinator": {"flayer", "protocol", "mqtt_broker"},
    "edge_client": {"flayer", "protocol", "export", "mqtt_broker"},
    "emulator": {"flayer", "protocol", "export", "mqtt_broker", "coordinator", "edge_client"},
}
PURE = {"flayer", "protocol", "export"}  # import nothing beyond their row, new packages included


def project_packages() -> set[str]:
    return {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks", "docs"}


def imports_of(package: str) -> set[tuple[str, str]]:
    """(file, top-level module) for every absolute import in the package."""
    found: set[tuple[str, str]] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), a.name.split(".")[0]) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add((str(path.relative_to(ROOT)), node.module.split(".")[0]))
    return found


def violations(allowed: dict[str, set[str]], packages: set[str]) -> list[str]:
    out = []
    for pkg in sorted(set(allowed) & packages):
        for where, target in sorted(imports_of(pkg)):
            if target == pkg or target not in packages:
                continue
            if (target in allowed or pkg in PURE) and target not in allowed[pkg]:
                out.append(f"{where} imports {target}")
    return out


def test_packages_import_only_what_the_design_allows() -> None:
    packages = project_packages()
    assert {"flayer", "protocol", "coordinator", "edge_client", "emulator", "cli"} <= packages
    assert violations(ALLOWED, packages) == []


def test_a_forbidden_import_is_reported() -> None:
    strict = {**ALLOWED, "edge_client": {"flayer"}}  # pretend the device may import only flayer
    found = violations(strict, project_packages())
    assert any(v.startswith("edge_client/") and v.endswith("imports protocol") for v in found)
