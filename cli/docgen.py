"""The command-line reference, rendered from the real argparse parsers (so it cannot drift).

The docs site's build hook (``docs/hooks.py``) replaces a marker in ``docs/reference/cli.md`` with
:func:`cli_reference`; ``tests/docs`` checks that every flag of every parser is in it. The config
file reference lives in :mod:`cli.configdoc`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

__all__ = ["cli_reference", "md_escape", "option_strings", "walk_parsers"]

WIDTH = 100  # usage lines are wrapped at this width, whatever the terminal


def walk_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("flayer",)
                 ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every parser of the tree, depth first: (command words, parser, one-line help)."""
    yield path, parser, ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                for p, q, h in walk_parsers(sub, (*path, name)):
                    yield p, q, h or helps.get(name, "")


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The flags of one parser (its own, not its sub-commands'), help excluded."""
    return [s for a in parser._actions if not isinstance(a, argparse._HelpAction)
            for s in a.option_strings]


def md_escape(text: str) -> str:
    """Text for a Markdown table cell."""
    return (text.replace("``", "`").replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")
            .replace(">", "&gt;").replace("*", "\\*"))


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _argument(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return str(action.metavar or action.dest.upper())


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0 or d == []:
        return ""
    return f"`{d}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if text is argparse.SUPPRESS:
        return ""
    params = {**vars(action), "default": action.default, "prog": ""}
    try:
        text = text % params
    except (KeyError, TypeError, ValueError):
        pass
    return md_escape(text)


def _flag_table(parser: argparse.ArgumentParser) -> list[str]:
    rows: list[str] = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
            arg = _argument(action)
            shown = md_escape(arg) if "|" in arg else arg and f"`{arg}`"  # no escaped pipe inside a code span
            rows.append(f"| {names} | {shown} | {_default(action)} "
                        f"| {_help(action)} |")
    if not rows:
        return []
    return ["| flag | value | default | what it does |", "|---|---|---|---|", *rows, ""]


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """Markdown: one section per command and sub-command, with usage and every flag."""
    if parser is None:
        from cli.main import build_parser

        parser = build_parser()
    lines: list[str] = []
    for path, p, one_line in walk_parsers(parser):
        name = " ".join(path)
        level = "#" * min(len(path) + 1, 4)
        lines += [f"{level} `{name}`", ""]
        if one_line:
            lines += [md_escape(one_line[0].upper() + one_line[1:]) + ".", ""]
        if p.description and p.description != one_line:
            lines += [md_escape(p.description), ""]
        lines += ["```text", _usage(p), "```", ""]
        lines += _flag_table(p)
    return "\n".join(lines)


# ---- Python API -----------------------------------------------------------------------------------------

def _doc(obj: object) -> str:
    """A docstring as Markdown: reST roles and literals become code spans."""
    import inspect
    import re

    text = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and text.startswith(f"{obj.__name__}("):  # a dataclass's generated docstring
        return ""
    text = re.sub(r":(?:class|meth|func|mod|attr):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`").replace("::\n", ":\n")
    return text


def _signature(fn: object, name: str = "") -> str:
    """``name(params) -> result``, one parameter a line when long; without ``self``/``cls`` and quotes."""
    import inspect
    import re

    sig = inspect.signature(fn)  # type: ignore[arg-type]
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    sig = sig.replace(parameters=params)
    text = re.sub(r"<built-in function (\w+)>", r"\1", str(sig).replace("'", ""))
    if len(name) + len(text) <= WIDTH:
        return name + text
    parts, star = [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(re.sub(r"<built-in function (\w+)>", r"\1", str(p).replace("'", "")))
    ret = "" if sig.return_annotation is sig.empty else f" -> {sig.return_annotation}".replace("'", "")
    return name + "(\n    " + ",\n    ".join(parts) + ",\n)" + ret


def python_api(objects: list[object]) -> str:
    """Markdown for classes (their signature, docstring and public methods) and functions, from the
    live objects: signatures and docstrings are the code's own."""
    import dataclasses
    import inspect

    lines: list[str] = []
    for obj in objects:
        name = f"{obj.__module__}.{obj.__qualname__}"  # type: ignore[attr-defined]
        target = obj.__init__ if inspect.isclass(obj) else obj
        lines += [f"### `{obj.__qualname__}`", "", "```python", _signature(target, name), "```", ""]  # type: ignore[attr-defined]
        if _doc(obj):
            lines += [_doc(obj), ""]
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
            lines += ["Fields: " + ", ".join(f"`{f.name}`" for f in dataclasses.fields(obj)) + ".", ""]
        if not inspect.isclass(obj):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_"):
                continue
            if isinstance(member, property):
                lines += [f"- `{attr}` (property): {_doc(member).splitlines()[0] if _doc(member) else ''}"]
            elif isinstance(member, (classmethod, staticmethod)) or inspect.isfunction(member):
                fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                first = _doc(fn).split("\n\n")[0].replace("\n", " ")
                lines += [f"- `{_signature(fn, attr)}`".replace("\n", " ") + (f": {first}" if first else "")]
        lines += [""]
    return "\n".join(lines)
