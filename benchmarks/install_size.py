"""Install size of an extra of flayer-edge, measured from this environment's installed distributions:
the dependency closure of ``flayer-edge[EXTRA]`` as this checkout's pyproject.toml declares it
(requirements and markers resolved against the installed metadata; nothing downloaded), each
distribution's size = the sum of the files its RECORD lists. flayer-edge itself is not counted.

    python benchmarks/install_size.py edge all
"""

from __future__ import annotations

import argparse
import re
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_size(dist: metadata.Distribution) -> int:
    total = 0
    for f in dist.files or ():
        path = Path(str(dist.locate_file(f)))
        if path.is_file():
            total += path.stat().st_size
    return total


def _project_requirements(pyproject: Path, extra: str) -> list[str]:
    """The base dependencies plus those of ``extra`` (self-references like flayer-edge[plots] expanded)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name, optional = _norm(project["name"]), project.get("optional-dependencies", {})
    out, todo, seen = list(project["dependencies"]), [extra], set()
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for text in optional[e]:
            req = Requirement(text)
            if _norm(req.name) == name:
                todo.extend(req.extras)
            else:
                out.append(text)
    return out


def closure(requirements: list[str]) -> dict[str, int]:
    """Installed distributions needed by ``requirements`` -> bytes on disk."""
    seen: dict[str, int] = {}
    todo: list[tuple[str, frozenset[str]]] = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append((req.name, frozenset(req.extras)))
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, ext = todo.pop()
        if (name, ext) in done:
            continue
        done.add((name, ext))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement this environment does not have (it is not counted)
        seen.setdefault(_norm(name), _dist_size(dist))
        for text in dist.requires or ():
            req = Requirement(text)
            envs = [{"extra": e} for e in ext] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return seen


def run() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("extras", nargs="+", help="extras of flayer-edge to measure (e.g. edge all)")
    ap.add_argument("--top", type=int, default=6, help="largest distributions listed per extra")
    args = ap.parse_args()
    for extra in args.extras:
        sizes = closure(_project_requirements(Path(__file__).resolve().parent.parent / "pyproject.toml", extra))
        total = sum(sizes.values())
        top = sorted(sizes.items(), key=lambda kv: -kv[1])[: args.top]
        print(f"[{extra}] {len(sizes)} distributions, {total / 2**20:,.0f} MiB; largest: "
              + ", ".join(f"{n} {s / 2**20:,.0f}" for n, s in top))


if __name__ == "__main__":
    run()
