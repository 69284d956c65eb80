"""A revoked or re-keyed device still believed by a device that reads the registry in place
(docs/explanation/secure-aggregation.md, "Trust assumption: where a device gets the other devices' keys").

The adversary is a coordinator that holds a device's old private key -- the reason the admin revoked the device, or
re-keyed it (``flayer broker revoke`` / ``rekey``: the old public key leaves ``signing_keys.json``). It selects that
device and plays it: its key adverts and survivor signatures signed with the old key. A device on the broker's
machine reads the registry in place, "again when it changes"; on the code before it read it again only when a key
was missing, so a key it had once read -- the revoked one, or the one replaced -- was believed for ever: the
coordinator's extra colluder, beyond the c that t and T count, and the re-keyed device's new signatures refused.
Now every look-up reads the file again when its modification time changed.
"""

from __future__ import annotations

import os
from pathlib import Path

from edge_client.peer_keys import PeerKeys
from protocol import SigningKey
from protocol.signing import advert_signer, advert_verifier, render_key_registry


def test_a_device_revoked_or_rekeyed_since_is_no_longer_believed(tmp_path: Path) -> None:
    path = tmp_path / "signing_keys.json"
    stolen, other = SigningKey.generate(), SigningKey.generate()
    path.write_text(render_key_registry(None, {"dev-1": stolen.public, "dev-2": other.public}))
    os.utime(path, (1, 1))
    peers = PeerKeys("f1", path)
    verify = advert_verifier(peers, "f1", 5)
    signed = advert_signer(stolen, "f1", 5, "dev-1")(b"an advert")
    assert verify("dev-1", b"an advert", signed)  # believed while registered
    path.write_text(render_key_registry(None, {"dev-2": other.public}))  # flayer broker revoke dev-1
    os.utime(path, (2, 2))
    assert not verify("dev-1", b"an advert", signed), "a revoked device's signature is still believed"
    new = SigningKey.generate()
    path.write_text(render_key_registry(None, {"dev-1": new.public, "dev-2": other.public}))  # re-added, new key
    os.utime(path, (3, 3))
    assert not verify("dev-1", b"an advert", signed), "a replaced key is still believed"
    assert verify("dev-1", b"an advert", advert_signer(new, "f1", 5, "dev-1")(b"an advert"))
