"""Models over HTTP, the coordinator's side: every model and delta blob it publishes, also written as an
immutable file ``<models_dir>/<sha256>`` that a web server serves (``[federation] models_dir`` and
``models_url``; docs/howto/http-models.md).

A file is written atomically (a temporary dotfile, fsync, rename, fsync of the folder: a web server
sees the whole file or none) before the plan naming it goes out, and never rewritten: a name is a
digest, so a file that is there is that blob (a device checks the sha256 anyway). :meth:`ModelFiles.prune`
removes every digest-named file but the ones still offered (the live model and its deltas) together
with the retained chunks of old models, and temporary files a crash left behind; files with other names
are not touched.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

from flayer.state import atomic_write

__all__ = ["ModelFiles"]

log = logging.getLogger(__name__)

_DIGEST = re.compile(r"[0-9a-f]{64}")
_TEMP = re.compile(r"\.[0-9a-f]{64}\.[0-9]+\.tmp")  # flayer.files.atomic_write's temporary names


class ModelFiles:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def path(self, digest: str) -> Path:
        if not _DIGEST.fullmatch(digest):
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return self.folder / digest

    def write(self, digest: str, blob: bytes) -> bool:
        """Write ``blob`` as ``<digest>`` unless a file of that name and size is there; True when written."""
        path = self.path(digest)
        try:
            if path.stat().st_size == len(blob):
                return False
        except FileNotFoundError:
            pass
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, blob)
        return True

    def prune(self, keep: Iterable[str]) -> int:
        """Remove the digest-named files not in ``keep`` and stale temporary files; returns how many."""
        keep = set(keep)
        removed = 0
        try:
            entries = list(self.folder.iterdir())
        except FileNotFoundError:
            return 0
        for entry in entries:
            name = entry.name
            if (_DIGEST.fullmatch(name) and name not in keep) or _TEMP.fullmatch(name):
                try:
                    entry.unlink()
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("could not remove old model file %s: %s", entry, exc)
        return removed
