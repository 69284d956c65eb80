"""The coordinator's view of 'flayer broker revoke': revoked.json, re-read when it changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

from coordinator.revocations import RevocationList


def test_the_list_follows_the_file_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = tmp_path / "revoked.json"
    now = [0.0]
    rl = RevocationList(path, min_interval_s=1.0, clock=lambda: now[0])
    assert "dev-1" not in rl  # no file: nobody revoked
    path.write_text(json.dumps({"dev-1": 1.0}))
    assert "dev-1" not in rl.refresh()  # read at most every min_interval_s
    now[0] = 2.0
    assert rl.refresh() == {"dev-1"} and "dev-1" in rl
    path.write_text("{not json")
    os.utime(path, (5, 5))
    now[0] = 4.0
    assert rl.refresh() == {"dev-1"}  # a malformed file keeps the last good list
    path.write_text(json.dumps({"dev-1": 1.0, "dev-2": 3.0}))
    now[0] = 6.0
    assert rl.refresh() == {"dev-1", "dev-2"}
    assert RevocationList(None).refresh() == frozenset()
