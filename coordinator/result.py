"""What :meth:`coordinator.server.Coordinator.run` returns, and the error it raises when it cannot run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["CoordinatorError", "CoordinatorResult", "StateWriteError"]


class CoordinatorError(RuntimeError):
    """The coordinator cannot run (refused by the broker, unusable state folder, ...)."""


class StateWriteError(CoordinatorError):
    """The state folder could not be written (full disk, permissions, I/O error): the coordinator
    stopped before acknowledging anything that is not on disk; a restart resumes."""

    @classmethod
    def of(cls, exc: BaseException, state_dir: Path) -> StateWriteError:
        """The error for ``exc`` (an OSError, or a journal error naming its file)."""
        if isinstance(exc, OSError):
            where = exc.filename or f"a file in the state folder {state_dir}"
            what = f"cannot write {where}: {exc.strerror or exc}"
        else:
            what = str(exc)
        return cls(f"the coordinator stopped: {what}. Everything acknowledged is on disk; fix the cause (free "
                   f"space, permissions) and run the same command to resume")


@dataclass
class CoordinatorResult:
    rounds_done: int
    global_state: dict[str, torch.Tensor]
    model_digest: str
    history: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    finished: bool = False  # every round ran
    stopped: bool = False  # stop() ended it early
