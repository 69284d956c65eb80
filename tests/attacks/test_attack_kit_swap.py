"""A local user who swaps what a kit unpacks to, or the folder above its code (docs/explanation/security.md, "It
cannot run other code on a device"; red-team findings on the kit-code consent).

The adversary is another local user of the device's host (uid ``nobody``):

1. it makes the folder a kit will be unpacked into before the owner runs ``flayer edge --kit`` (in a shared
   folder), then replaces the unpacked ``device.toml`` with one naming ``[data] source = "python"``,
   ``entry = "os:system"``; the consent check read the tarball's ``device.toml``, the device loaded the swapped
   one at its next start and ran the command;
2. the owner keeps its code folder in a folder others can write without the sticky bit (a group share): the
   adversary renames the owner's folder away and puts its own in its place after the start-time check.

The guarantee: a kit is unpacked only into a folder of the owner's own, the ``device.toml`` a restart loads is
the one checked for code, and a ``python_path`` folder under a folder others may write is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flayer.config import ConfigError, add_python_path
from mqtt_broker import BrokerConfig, add_device
from mqtt_broker.kit import write_kit
from mqtt_broker.state import write_broker_files
from transport.kit import KitError, unpack_kit

NOBODY = 65534


def _kit(tmp: Path) -> Path:
    state = tmp / "broker"
    write_broker_files(BrokerConfig(federation="k1", persistence=False), state)
    add_device(state, "dev-a")
    return write_kit(state, "dev-a", tmp / "kits")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_kit_folder_made_by_another_user_is_refused(tmp_path: Path) -> None:
    kit = _kit(tmp_path)
    planted = tmp_path / "share" / "dev-a"
    planted.mkdir(parents=True, mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(KitError, match="not a private folder of this user"):
        unpack_kit(kit, planted)


def test_a_swapped_device_toml_is_checked_at_restart(tmp_path: Path) -> None:
    kit = _kit(tmp_path)
    dest = tmp_path / "mine"
    toml = unpack_kit(kit, dest)
    text = toml.read_text()
    assert 'source = "folder"' in text
    toml.write_text(text.replace('source = "folder"', 'source = "python"\nentry = "os:system"', 1))
    with pytest.raises(KitError, match="names code this device would run"):
        unpack_kit(kit, dest)  # the restart: refused without the owner's consent
    assert unpack_kit(kit, dest, allow_code=True) == toml


def test_code_under_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    share = tmp_path / "group-share"
    share.mkdir()
    os.chmod(share, 0o775)  # group-writable, no sticky bit: a member can rename what it holds
    mine = share / "code"
    mine.mkdir(mode=0o755)
    with pytest.raises(ConfigError, match="which other users can write"):
        add_python_path(["code"], share, "device.toml:")
    sticky = tmp_path / "tmp-like"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # sticky: others cannot rename the owner's folder
    (sticky / "code").mkdir(mode=0o755)
    add_python_path(["code"], sticky, "device.toml:")
