"""``--print-unit``: a systemd service unit that runs the command as it was given (docs/howto/service.md).

``flayer broker start ... --print-unit``, ``flayer coordinator ... --print-unit`` and ``flayer edge ...
--print-unit`` print the unit and exit without starting anything. The unit:

1. runs the same ``flayer`` (this installation's executable) with the same flags, every path flag made
   absolute (:data:`PATH_FLAGS`), quoted for systemd (``%`` and ``$`` escaped);
2. as a dedicated user (``--unit-user``, default ``flayer``), its state folder named: under ``/var/lib``
   as ``StateDirectory=`` (systemd creates it, owned by that user), elsewhere in a comment to create it;
3. restarts on failure (``Restart=on-failure``), but not after a configuration error (exit 2:
   ``RestartPreventExitStatus=2``); exits 130 / 143 after SIGINT / SIGTERM are clean stops
   (``SuccessExitStatus``), so ``systemctl stop`` leaves the unit inactive, not failed;
4. is stopped with SIGTERM to the main process only (``KillMode=mixed``: the broker's wrapper stops its
   mosquitto itself), SIGKILL after ``TimeoutStopSec``;
5. logs to the journal (stdout and stderr, unbuffered), under ``SyslogIdentifier=flayer-KIND``;
6. starts at boot (``WantedBy=multi-user.target``) once the network is up;
7. the broker's: may open as many files as every listener full needs, plus the wrapper's own
   (``LimitNOFILE``: ``BrokerConfig.open_files_wanted`` + :data:`UNIT_FILES`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["PATH_FLAGS", "UNIT_FILES", "add_unit_flags", "command_args", "flayer_command", "quote", "unit_text"]

PATH_FLAGS = frozenset({"--config", "--state-dir", "--credentials", "--kit", "--data", "--partition-file",
                        "--log-file", "--tensorboard", "--metrics-token-file"})
UNIT_FLAGS = {"--print-unit": 0, "--unit-user": 1}  # flag -> values it takes; left out of the unit's command
UNIT_FILES = 1024  # the flayer wrapper's own descriptors beside the broker's
STOP_TIMEOUT_S = {"broker": 30, "coordinator": 120, "edge": 300}  # a device finishes its local round first
DESCRIPTIONS = {"broker": "FLAYER Edge MQTT broker", "coordinator": "FLAYER Edge coordinator",
                "edge": "FLAYER Edge device"}


def add_unit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--print-unit", action="store_true",
                   help="print a systemd service unit running this command (paths made absolute) and exit; "
                        "see docs/howto/service.md")
    p.add_argument("--unit-user", default="flayer", metavar="USER",
                   help="with --print-unit: the dedicated user the service runs as (default flayer)")


def command_args(argv: Sequence[str]) -> list[str]:
    """``argv`` without the unit flags, the values of :data:`PATH_FLAGS` made absolute (rule 1)."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in UNIT_FLAGS:
            if not eq and UNIT_FLAGS[flag]:
                next(it, None)
            continue
        if flag in PATH_FLAGS:
            if eq:
                out.append(f"{flag}={Path(value).resolve()}")
                continue
            nxt = next(it, None)
            out += [arg] if nxt is None else [arg, str(Path(nxt).resolve())]
            continue
        out.append(arg)
    return out


def flayer_command() -> list[str]:
    """This installation's ``flayer``: the script beside the running interpreter, else ``python -m cli.main``."""
    here = Path(sys.executable).parent / "flayer"
    if here.exists():
        return [str(here)]
    found = shutil.which("flayer")
    return [found] if found else [sys.executable, "-m", "cli.main"]


def quote(arg: str) -> str:
    """One ExecStart= word (systemd.service(5), "Command lines"; systemd.unit(5), "Specifiers")."""
    text = arg.replace("%", "%%").replace("$", "$$")
    if text and not any(c in text for c in " \t\n\"'\\;"):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def unit_text(kind: str, argv: Sequence[str], user: str, state_dirs: Iterable[Path], what: str = "",
              open_files: int = 0) -> str:
    """The unit (module docstring) of ``kind`` (broker, coordinator or edge) running ``argv``; ``open_files``: its
    ``LimitNOFILE`` (the broker: every listener full plus its own, ``BrokerConfig.open_files_wanted``)."""
    if kind not in DESCRIPTIONS:
        raise ValueError(f"kind must be one of {', '.join(DESCRIPTIONS)}, got {kind!r}")
    if not user or any(c.isspace() for c in user):
        raise ValueError(f"--unit-user must be a user name, got {user!r}")
    managed: list[str] = []
    elsewhere: list[str] = []
    for d in state_dirs:
        d = d.resolve()
        parts = d.relative_to("/var/lib").parts if d.is_relative_to("/var/lib") else ()
        (managed if parts else elsewhere).append("/".join(parts) if parts else str(d))
    after = "network-online.target" + (" flayer-broker.service" if kind == "coordinator" else "")
    lines = [(f"# flayer-{kind}.service, written by 'flayer {kind if kind != 'broker' else 'broker start'} "
              f"--print-unit' (docs/howto/service.md)"),
             ("# install: sudo cp THIS /etc/systemd/system/ && sudo systemctl daemon-reload && "
              f"sudo systemctl enable --now flayer-{kind}"),
             *[f"# state folder {d}: create it for the user first (sudo install -d -o {user} -g {user} {d})"
               for d in elsewhere],
             "[Unit]", f"Description={DESCRIPTIONS[kind]}{f' ({what})' if what else ''}",
             f"After={after}", "Wants=network-online.target", "",
             "[Service]", "Type=simple", f"User={user}", f"Group={user}",
             *[f"StateDirectory={d}" for d in managed], *(["StateDirectoryMode=0700"] if managed else []),
             "ExecStart=" + " ".join(quote(a) for a in argv),
             "Restart=on-failure", "RestartSec=10s", "RestartPreventExitStatus=2",
             "SuccessExitStatus=130 143", "KillMode=mixed", "KillSignal=SIGTERM",
             f"TimeoutStopSec={STOP_TIMEOUT_S[kind]}s", *([f"LimitNOFILE={open_files}"] if open_files else []),
             "Environment=PYTHONUNBUFFERED=1", "StandardOutput=journal", "StandardError=journal",
             f"SyslogIdentifier=flayer-{kind}", "NoNewPrivileges=yes", "PrivateTmp=yes", "ProtectSystem=full", "",
             "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def print_unit(args: argparse.Namespace, kind: str, state_dirs: Iterable[Path], what: str = "",
               extra: Sequence[str] = (), open_files: int = 0) -> int:
    """Print the unit of the command in ``args.argv`` (set by :func:`cli.main.main`) plus ``extra``."""
    from cli.common import CliError

    try:
        text = unit_text(kind, [*flayer_command(), *command_args(args.argv), *extra], args.unit_user, state_dirs,
                         what, open_files)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    sys.stdout.write(text)
    return 0
