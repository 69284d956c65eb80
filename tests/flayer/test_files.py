"""Private state files (flayer.files): 0700 folders and 0600 files whatever the umask; an open folder is closed
when it is this user's own, refused when it is shared or someone else's."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from flayer.files import OpenFolderError, atomic_write, open_private, private_dir


@pytest.fixture(autouse=True)
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_new_folders_and_files_are_private(tmp_path: Path) -> None:
    folder = private_dir(tmp_path / "a" / "state")
    assert _mode(folder) == 0o700
    assert _mode(atomic_write(folder / "x.bin", b"secret")) == 0o600
    assert _mode(atomic_write(tmp_path / "new" / "y.txt", "text")) == 0o600
    assert _mode(tmp_path / "new") == 0o700  # a folder atomic_write had to create
    with open_private(folder / "log.jsonl", "a", encoding="utf-8") as fh:
        fh.write("{}\n")
    assert _mode(folder / "log.jsonl") == 0o600
    assert (folder / "x.bin").read_bytes() == b"secret" and not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_an_open_folder_of_ones_own_is_closed_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "old"
    folder.mkdir()
    os.chmod(folder, 0o755)
    with caplog.at_level(logging.WARNING, logger="flayer.files"):
        private_dir(folder)
    assert _mode(folder) == 0o700
    assert "was open to other users (mode 0755): made it 0700" in caplog.text


def test_a_shared_sticky_folder_is_refused_and_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    with pytest.raises(OpenFolderError, match=r"open to other users \(mode 1777, a shared \(sticky\) folder\)"):
        private_dir(folder, "state_dir")
    assert _mode(folder) == 0o1777


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_someone_elses_open_folder_is_refused_and_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir()
    os.chown(folder, 65534, 65534)
    os.chmod(folder, 0o755)
    with pytest.raises(OpenFolderError, match="belongs to uid 65534"):
        private_dir(folder)
    assert _mode(folder) == 0o755


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_someone_elses_closed_folder_is_refused_too(tmp_path: Path) -> None:
    """A local user who made the folder first (0700, its own) could swap its files or plant links to files of
    this user: refused whatever its mode; and an append never follows a planted link."""
    from flayer.files import open_private

    folder = tmp_path / "planted"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(OpenFolderError, match="belongs to uid 65534"):
        private_dir(folder)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    target = tmp_path / "precious"
    target.write_text("keep")
    (mine / "journal.bin").symlink_to(target)
    with pytest.raises(OSError):
        open_private(mine / "journal.bin")
    assert target.read_text() == "keep"


def test_a_folder_lock_refuses_a_second_holder_until_released(tmp_path: Path) -> None:
    from flayer.files import FolderBusyError, FolderLock

    first = FolderLock(tmp_path, "state_dir")
    assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n" and _mode(tmp_path / ".lock") == 0o600
    with pytest.raises(FolderBusyError, match=f"state_dir {tmp_path} is in use by another process \\(pid {os.getpid()}\\)"):
        FolderLock(tmp_path, "state_dir")
    first.release()
    FolderLock(tmp_path).release()  # free again
