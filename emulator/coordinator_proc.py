"""``python -m emulator.coordinator_proc --config federation.toml --events FILE``: the real coordinator
in its own process, with an event file for the launcher's live view.

The coordinator is :class:`coordinator.server.Coordinator`, unchanged; this module only listens to
its ``on_progress`` / ``on_round`` callbacks and adds what the launcher cannot see from outside: the
devices selected when a round opens and how many devices the registry counts as online (from their
retained statuses and heartbeats). SIGTERM stops it cleanly (it resumes from its checkpoint when
started again); SIGINT is ignored (the launcher owns Ctrl-C). Exit 0 when every round ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .events import EventLog

__all__ = ["CoordinatorEvents", "main"]


class CoordinatorEvents:
    """The coordinator's callbacks, written to ``events`` (called on the coordinator's thread)."""

    def __init__(self, events: EventLog, clock: Any = time.time) -> None:
        self.events, self.clock = events, clock
        self.coord: Any = None
        self._waiting_at = 0.0

    def _online(self) -> dict[str, int]:
        reg = self.coord.registry
        return {"online": len(reg.online(self.clock())), "known": len(reg)}

    def progress(self, kind: str, info: dict[str, Any]) -> None:
        if kind == "open":
            rnd = self.coord.open
            self.events.write("open", **info, selected_ids=sorted(rnd.selected) if rnd is not None else [],
                              **self._online())
        elif kind == "waiting":
            now = time.monotonic()
            if now - self._waiting_at >= 2.0:
                self._waiting_at = now
                self.events.write("waiting", **info, known=len(self.coord.registry))
        else:
            self.events.write(kind, **info)

    def round(self, record: dict[str, Any]) -> None:
        self.events.write("round", record=record, **self._online())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m emulator.coordinator_proc",
                                description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--events", required=True, type=Path)
    p.add_argument("--host", help="broker address (overrides the credentials file)")
    p.add_argument("--port", type=int)
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s coordinator %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)
    from coordinator.config import load_coordinator_config
    from coordinator.server import Coordinator
    from transport import Credentials

    cfg = load_coordinator_config(args.config)
    creds = Credentials.load(cfg.credentials)
    if args.host and args.port:
        creds = dataclasses.replace(creds, host=args.host, port=args.port)
    events = EventLog(args.events)
    cb = CoordinatorEvents(events)
    coord = Coordinator(cfg, creds, on_round=cb.round, on_progress=cb.progress)
    cb.coord = coord
    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    try:
        result = coord.run()
    except BaseException as exc:
        events.write("done", finished=False, error=str(exc))
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a late SIGTERM must not kill the interpreter's exit
    events.write("done", finished=result.finished, rounds=result.rounds_done, counters=result.counters,
                 digest=result.model_digest)
    events.close()
    return 0 if result.finished else 1


if __name__ == "__main__":
    sys.exit(main())
