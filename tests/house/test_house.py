"""The house stays tidy: no import circle among the project's modules (every import counts, a function's
local import and a type-checking one too) and no module over 400 lines but the listed ones, each of which
may only shrink (docs/explanation/design.md, "Layers")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flayer", "protocol", "transport", "coordinator", "edge_client", "emulator", "export", "mqtt_broker",
            "cli")
MAX_LINES = 400
# modules over MAX_LINES today, at their length now: a module on this list may shrink, never grow, and leaves
# the list once it is split (a new long module fails the test)
ALLOWED_LONG: dict[str, int] = {}


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "node_modules" in path.parts:
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` names the module, else the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_among_the_projects_modules() -> None:
    mods = modules()
    known = set(mods)
    graph = {n: imports(n, p, known) - {n} for n, p in mods.items()}
    # a package's __init__ re-exports its modules: an edge into the package is an edge into what it holds,
    # so edges from a package's own modules to the package itself are not circles of the design
    for n in graph:
        graph[n] = {t for t in graph[n] if not n.startswith(t + ".")}
    assert sum(len(v) for v in graph.values()) > 500  # the graph is really read
    assert circles(graph) == []


def test_no_module_over_400_lines_but_the_shrinking_list() -> None:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules().values()}
    long = {k: v for k, v in lengths.items() if v > MAX_LINES}
    grown = {k: (v, ALLOWED_LONG.get(k)) for k, v in long.items() if v > ALLOWED_LONG.get(k, MAX_LINES)}
    assert not grown, f"modules over {MAX_LINES} lines (now, allowed): {grown}; split them"
    stale = {k: lengths.get(k) for k in ALLOWED_LONG if lengths.get(k, 0) <= MAX_LINES}
    assert not stale, f"no longer over {MAX_LINES} lines, take them off ALLOWED_LONG: {stale}"


def test_a_broker_process_imports_no_torch() -> None:
    """The broker side (``flayer broker``, the embedded broker, the wire format) starts without torch: every
    broker a test or a fleet starts would otherwise pay about 2 s of CPU importing it
    (docs/howto/test-suite.md, "Where the time goes")."""
    code = ("import sys, protocol, transport, mqtt_broker, mqtt_broker.embedded, cli.broker, cli.main; "
            "cli.main.build_parser(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"torch imported: {proc.stdout}"
