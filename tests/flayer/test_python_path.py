"""``python_path`` (flayer.config.add_python_path): its folders come after the project and the installed packages,
and a folder other users can write is refused."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from flayer.config import ConfigError, add_python_path


def test_python_path_folders_come_after_the_installed_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    own = tmp_path / "code"
    own.mkdir(mode=0o755)
    (own / "PIL.py").write_text("raise RuntimeError('the wrong PIL')\n")
    add_python_path(["code"], tmp_path, "device.toml:")
    assert sys.path[-1] == str(own.resolve())
    import importlib.util

    spec = importlib.util.find_spec("PIL")
    assert spec is not None and spec.origin is not None and str(own) not in spec.origin


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_a_folder_other_users_can_write_is_refused(tmp_path: Path, mode: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(ConfigError, match=f"python_path: {shared} can be written by other users \\(mode {mode:04o}"):
        add_python_path([str(shared)], tmp_path, "device.toml:")
    assert str(shared) not in sys.path


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_folder_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match="owner uid 65534"):
        add_python_path([str(theirs)], tmp_path, "device.toml:")
