"""The config file reference, rendered from the frozen config dataclasses (so it cannot drift).

For every file the project reads (run config, ``federation.toml``, ``device.toml``, emulate config,
profiles, credentials, ``broker.json``) and every table in it: each key with its type, its default
and the checks the code applies to it. The checks are read from the ``raise`` statements of the
dataclass's ``__post_init__`` (and the ``_check_int(...)`` calls of the broker config), so a bound
changed in the code changes here. A key's description is the comment on its line in the dataclass,
or on its line in the module docstring's example file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cli.docgen import md_escape

__all__ = ["ConfigFile", "Table", "checks", "config_files", "config_reference", "descriptions"]


@dataclass(frozen=True)
class Table:
    name: str  # as written in the file: "[data]", "top level", "[profile.NAME]"
    cls: type
    exclude: tuple[str, ...] = ()  # fields that are not keys of this table
    only: tuple[str, ...] = ()  # when set: just these fields
    defaults: Mapping[str, Any] = field(default_factory=dict)  # defaults that differ in this file
    note: str = ""
    types: Mapping[str, str] = field(default_factory=dict)  # what the file holds, where the field stores it otherwise
    extra: tuple[tuple[str, str, str, str], ...] = ()  # keys the loader reads besides the fields: key, type, default, meaning

    def documented(self) -> list[dataclasses.Field[Any]]:
        return [f for f in dataclasses.fields(self.cls)
                if f.name not in self.exclude and (not self.only or f.name in self.only)]


@dataclass(frozen=True)
class ConfigFile:
    title: str
    anchor: str
    about: str
    tables: tuple[Table, ...]


# ---- reading the code ---------------------------------------------------------------------------------

_COMMENT = re.compile(r"^\s*(\w+)\s*[:=][^#]*#\s*(.+?)\s*$")


def descriptions(cls: type) -> dict[str, str]:
    """Key -> the comment on its line: in the class body (and its bases'), else in the module docstring's
    example file. A comment block right above a field counts as its comment."""
    out: dict[str, str] = {}
    module = sys.modules[cls.__module__]
    for line in (module.__doc__ or "").splitlines():
        m = _COMMENT.match(line)
        if m:
            out.setdefault(m.group(1), m.group(2))
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        above: list[str] = []
        for line in inspect.getsource(klass).splitlines():
            stripped = line.strip()
            if stripped.startswith("#"):
                above.append(stripped.lstrip("# "))
                continue
            m = re.match(r"^\s*(\w+)\s*:[^#]*(?:#\s*(.+?))?\s*$", line)
            if m and (m.group(2) or above):
                out[m.group(1)] = m.group(2) or " ".join(above)
            above = []
    return out


def _render(node: ast.expr, namespace: Mapping[str, Any], loop: Mapping[str, str]) -> str:
    """The text of a message expression: constants as is, expressions evaluated when they need nothing
    but module globals, loop variables by their value, anything else as an ellipsis."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(_render(v, namespace, loop) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        if isinstance(node.value, ast.Name) and node.value.id in loop:
            return loop[node.value.id]
        try:
            return str(eval(compile(ast.Expression(node.value), "<check>", "eval"), dict(namespace)))
        except Exception:  # noqa: BLE001 - anything that needs the instance is shown as an ellipsis
            return "\u2026"
    return "\u2026"


def _clean(message: str) -> str:
    message = re.split(r"[,;]? got \u2026| \(leave it out| \(it caps", message)[0]
    message = re.sub(r"^[^:]*\u2026[^:]*: ", "", message)  # "profile 'x': slowdown must ..." -> "slowdown must ..."
    message = re.sub(r" ?\(\u2026\)", "", message)
    return message.strip().rstrip(":;,")


def _messages(tree: ast.AST, namespace: Mapping[str, Any], loop: dict[str, str]) -> Iterable[str]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Tuple):
            for elt in node.iter.elts:
                if isinstance(elt, ast.Constant):
                    yield from _messages(node, namespace, {**loop, node.target.id: str(elt.value)})
            continue
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            yield _render(node.exc.args[0], namespace, loop)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_check_int" and len(node.args) == 4:
            what, lo, hi = (_render(ast.FormattedValue(a, -1, None), namespace, loop) for a in node.args[1:])
            yield f"{what} must be an integer in [{lo}, {hi}]"
        yield from _messages(node, namespace, loop)


def checks(cls: type) -> dict[str, list[str]]:
    """Key -> the validation rules that name it, read from ``__post_init__`` of ``cls`` and its bases."""
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, list[str]] = {}
    for klass in cls.__mro__:
        post = klass.__dict__.get("__post_init__")
        if post is None:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(post)))
        namespace = vars(sys.modules[klass.__module__])
        for raw in _messages(tree, namespace, {}):
            message = _clean(raw)
            for name in names:
                if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message):
                    out.setdefault(name, [])
                    if message not in out[name]:
                        out[name].append(message)
    return out


def _type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        (inner, *_rest) = typing.get_args(tp) or (Any,)
        return f"list of {_type(inner)}"
    if tp is type(None):
        return "none"
    names = {str: "string", int: "integer", float: "number", bool: "true/false"}
    return names.get(tp, getattr(tp, "__name__", str(tp)).replace("Path", "path"))


def _value(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, int) and v >= 1 << 20 and v & (v - 1) == 0:
        return f"{v} ({v >> 20} MiB)" if v < 1 << 30 else f"{v} ({v >> 30} GiB)"
    return repr(v)


def _default(f: dataclasses.Field[Any], override: Mapping[str, Any]) -> str:
    if f.name in override:
        return f"`{_value(override[f.name])}`"
    if f.default is not dataclasses.MISSING:
        return f"`{_value(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{_value(f.default_factory())}`"
    return "required"


def table_rows(table: Table) -> list[str]:
    hints = typing.get_type_hints(table.cls)
    about = descriptions(table.cls)
    rules = checks(table.cls)
    rows = ["| key | type | default | checks | meaning |", "|---|---|---|---|---|"]
    for f in table.documented():
        rows.append(f"| `{f.name}` | {table.types.get(f.name) or _type(hints[f.name])} | "
                    f"{_default(f, table.defaults)} | "
                    f"{md_escape('; '.join(rules.get(f.name, [])))} | {md_escape(about.get(f.name, ''))} |")
    for key, kind, default, meaning in table.extra:
        rows.append(f"| `{key}` | {kind} | {default} |  | {md_escape(meaning)} |")
    return rows


# [model] of federation.toml: the loader (coordinator.config.model_spec_from_table) reads a table of keyword
# arguments and a list of class names, stored in the spec as canonical JSON text, and two keys of its own
MODEL_TYPES = {"args": "table", "classes": "list of string"}
MODEL_EXTRA = (
    ("initial_model", "string", "none", "a .safetensors checkpoint the federation starts from (relative: to the file)"),
    ("python_path", "list of string", "`[]`",
     "folders searched for the entry point's module (relative: to the file); docs/howto/own-model.md"),
)


# ---- what the project reads ------------------------------------------------------------------------------

def config_files() -> tuple[ConfigFile, ...]:
    """Every config file, table by table, from the dataclasses that load them."""
    from coordinator.config import FederationSettings
    from edge_client.config import DeviceConfig, DeviceData, DevicePrivacy, EdgeSettings
    from emulator.options import DEFAULT_EDGE, EmulatorSettings
    from emulator.profiles import DeviceProfile
    from flayer.config import DataConfig, RunConfig, TrainConfig
    from flayer.privacy_config import PrivacySettings
    from flayer.spec import ModelSpec
    from flayer.strategies import STRATEGIES
    from mqtt_broker.config import BrokerConfig
    from transport.credentials import Credentials, TlsSettings

    run_tables = (
        Table("[run]", RunConfig, exclude=("data", "train", "strategy_options", "privacy")),
        Table("[data]", DataConfig),
        Table("[train]", TrainConfig),
        Table("[privacy]", PrivacySettings,
              note="Client-level differential privacy, off unless `enabled`: docs/explanation/privacy.md."),
    )
    strategy_tables = tuple(
        Table(f"[strategy.{name}]", cls.options_type) for name, cls in STRATEGIES.items()
        if dataclasses.fields(cls.options_type))
    return (
        ConfigFile("Run config", "run",
                   "Read by `flayer simulate`, `flayer bench`, `flayer ablate` and `flayer partition` "
                   "(`--config FILE.toml`; flags override the file). Its tables are also the run tables of "
                   "`federation.toml` and of the emulate config. Example: `configs/demo.toml`. A strategy's "
                   "options go in `[strategy.NAME]`, or on the command line as `--set NAME.KEY=VALUE`; "
                   "strategies without options (" + ", ".join(
                       f"`{n}`" for n, c in STRATEGIES.items() if not dataclasses.fields(c.options_type))
                   + ") take no table.",
                   run_tables + strategy_tables),
        ConfigFile("Coordinator: federation.toml", "federation",
                   "Read by `flayer coordinator --config`. Holds `[federation]`, the run tables above "
                   "(`[run]`, `[data]`, `[train]`, `[strategy.NAME]`: options must be scalars, since they "
                   "travel in the round plan) and, instead of `[data]`'s data set, an optional `[model]`. "
                   "Relative paths are read relative to the file. Example: `configs/federation.toml`.",
                   (Table("[federation]", FederationSettings),
                    Table("[model]", ModelSpec, types=MODEL_TYPES, extra=MODEL_EXTRA))),
        ConfigFile("Device: device.toml", "device",
                   "Read by `flayer edge --config`. Relative paths are read relative to the file. "
                   "Example: `configs/device-1.toml`.",
                   (Table("top level", DeviceConfig, only=("credentials",)),
                    Table("[data]", DeviceData),
                    Table("[edge]", EdgeSettings, exclude=("client_index", "device_budget", "device_delta", "privacy_require"),
                          note="`client_index` is not a key: it is `[data] client`."),
                    Table("[privacy]", DevicePrivacy,
                          note="This device's own privacy budget: docs/explanation/privacy.md, "
                               "\"A device's own budget\"."))),
        ConfigFile("Emulated fleet", "emulate",
                   "Read by `flayer emulate --config`: the run tables above (`[data] clients` is the number "
                   "of devices), plus `[federation]` and `[edge]` as in `federation.toml` and `device.toml` "
                   "(without the keys the emulator sets per device) and `[emulator]`. Example: "
                   "`configs/emulate-demo.toml`.",
                   (Table("[emulator]", EmulatorSettings),
                    Table("[federation]", FederationSettings, exclude=("credentials", "state_dir"),
                          note="Unset, `quorum` is half the fleet, `min_devices` the quorum, `deadline_s` 120 "
                               "and `grace_s` 3 (`emulator.options.federation_table`)."),
                    Table("[edge]", EdgeSettings, exclude=("state_dir", "client_index"), defaults=DEFAULT_EDGE))),
        ConfigFile("Device profiles", "profiles",
                   "Read by `flayer emulate --profiles FILE` (or `[emulator] profiles`). One "
                   "`[profile.NAME]` table per profile (a built-in of the same name is replaced), and "
                   "`[mix]`: `NAME = share` for each profile, normalised. Example: `configs/profiles.toml`.",
                   (Table("[profile.NAME]", DeviceProfile, exclude=("name",)),)),
        ConfigFile("Credentials file", "credentials",
                   "Written by `flayer broker start` (the coordinator's) and `flayer broker add-device` "
                   "(one per device) as `<state>/credentials/<user>.toml`, mode 0600; read by the "
                   "coordinator and the edge client. `max_payload` is written for information and "
                   "recomputed from `max_packet_size` on load.",
                   (Table("top level", Credentials, exclude=("tls",)), Table("[tls]", TlsSettings))),
        ConfigFile("Broker settings: broker.json", "broker",
                   "JSON, in the broker's state folder (`.flayer/broker/broker.json` by default), written "
                   "by `flayer broker start` from its flags and reused by later starts.",
                   (Table("top level", BrokerConfig),)),
    )


def config_reference(files: Iterable[ConfigFile] | None = None,
                     heading: Callable[[str], str] = lambda title: f"## {title}") -> str:
    """Markdown: one section per config file, one table per table of the file."""
    lines: list[str] = []
    for cf in files if files is not None else config_files():
        lines += [heading(cf.title) + f" {{#{cf.anchor}}}", "", cf.about, ""]
        for table in cf.tables:
            lines += [f"### {cf.title.split(':')[-1].strip()} `{table.name}`" if table.name != "top level"
                      else f"### {cf.title.split(':')[-1].strip()}, top level", ""]
            if table.note:
                lines += [table.note, ""]
            lines += table_rows(table) + [""]
    return "\n".join(lines)
