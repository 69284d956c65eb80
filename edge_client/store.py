"""A device's state on disk, so a rebooted device resumes where it stopped.

``<state_dir>/`` (0700, its files 0600, whatever the umask: :mod:`flayer.files`):

- ``client_state.safetensors`` -- the strategy's :class:`ClientState` (personal tensors, A_l and
  other scalars) plus metadata: the last round whose local round finished, the pending upload
  (round, digest, size, status) and whether the federation finished. Written atomically
  (:func:`flayer.state.save_client_state`); it is the commit point.
- ``upload.bin`` -- the encoded update of that round, written atomically *before* the state file,
  and both before anything is published: after a crash the device re-sends the same bytes
  without training again. A crash between the two files leaves the old state, so the device
  retrains that round (deterministically) and overwrites the upload.
- ``personal.safetensors`` / ``global.safetensors`` -- the models after the federation ended
  (:func:`flayer.state.save_model`, for ``flayer export``).
- ``plan_round`` -- the newest round of a plan this device took: plans only move forward, so a signed plan of
  an earlier round replayed after a reboot is refused too (docs/explanation/security.md, "Replays").
- ``secure_advert`` -- the secure round and session this device last advertised keys in, written (fsync and
  rename) before the advert leaves: its keys live in memory only, so after a reboot it sits that session out
  rather than advertise other keys in it (docs/explanation/secure-aggregation.md, "A device that restarts").

An idle client need not hold its :class:`ClientState` in memory: :meth:`DeviceStore.release` drops
the tensors from a :class:`StoredState` whose state file holds exactly them (``on_disk``);
:meth:`DeviceStore.state_of` reads them back when a round needs them, and :meth:`DeviceStore.save`
rewrites the file's metadata around the tensors already there. Bit for bit the same state: safetensors
keeps the tensors' bytes, JSON the scalars.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flayer.files import OpenFolderError, atomic_write, private_dir
from flayer.state import StateFileError, load_client_state, save_client_state
from flayer.strategies.base import ClientState

__all__ = ["UPLOAD_STATUSES", "DeviceStore", "StoredState", "UploadRecord"]

UPLOAD_STATUSES = ("pending", "accepted", "duplicate", "rejected", "late", "not_selected", "gave_up", "dropped")


@dataclass(frozen=True)
class UploadRecord:
    round: int
    digest: str
    size: int
    status: str = "pending"  # pending until the coordinator's ack (see UPLOAD_STATUSES)

    @property
    def settled(self) -> bool:
        return self.status != "pending"


@dataclass
class StoredState:
    state: ClientState | None = None
    done_round: int = 0
    upload: UploadRecord | None = None
    finished: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    on_disk: bool = False  # ``state`` released: its tensors are the state file's (DeviceStore.release)


class DeviceStore:
    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.state_file = self.dir / "client_state.safetensors"
        self.upload_file = self.dir / "upload.bin"
        self.personal_file = self.dir / "personal.safetensors"
        self.global_file = self.dir / "global.safetensors"
        self.plan_file = self.dir / "plan_round"
        self.advert_file = self.dir / "secure_advert"
        try:  # 0700 whatever the umask: the pending upload and the personal model are this device's (flayer.files)
            private_dir(self.dir, "device state_dir")
        except OpenFolderError as exc:
            raise StateFileError(str(exc)) from None

    def load(self) -> StoredState:
        if not self.state_file.exists():
            return StoredState()
        state, meta = load_client_state(self.state_file)
        up = meta.get("upload")
        try:
            upload = UploadRecord(**up) if isinstance(up, dict) else None
        except TypeError as exc:
            raise StateFileError(f"{self.state_file}: bad upload record {up!r}") from exc
        return StoredState(state, int(meta.get("done_round", 0)), upload, bool(meta.get("finished", False)),
                           dict(meta.get("extra", {})))

    def save(self, stored: StoredState) -> None:
        meta = {"done_round": stored.done_round, "upload": asdict(stored.upload) if stored.upload else None,
                "finished": stored.finished, "extra": stored.extra}
        state = stored.state
        if state is None and stored.on_disk:  # released: the tensors already in the file, new metadata
            state = load_client_state(self.state_file)[0]
        save_client_state(self.state_file, state or ClientState(), meta)

    def state_of(self, stored: StoredState) -> ClientState | None:
        """The client state ``stored`` names: held in memory, or read back from the state file."""
        if stored.state is None and stored.on_disk:
            return load_client_state(self.state_file)[0]
        return stored.state

    def release(self, stored: StoredState) -> None:
        """Drop ``stored``'s tensors from memory; only call it when the state file holds exactly them
        (after a load or a save of ``stored``)."""
        if stored.state is not None and self.state_file.exists():
            stored.state, stored.on_disk = None, True

    def plan_round(self) -> int:
        """The newest plan round this device took (0: none, or an unreadable file: the state file's rounds bound
        it then)."""
        try:
            text = self.plan_file.read_text(encoding="ascii").strip()
            return int(text) if text.isdigit() and len(text) <= 10 else 0
        except (OSError, UnicodeDecodeError):
            return 0

    def save_plan_round(self, round_: int) -> None:
        """Record ``round_`` (temporary file, fsync and rename)."""
        atomic_write(self.plan_file, str(int(round_)))

    def secure_advert(self) -> tuple[int, str] | None:
        """(round, session) of the secure round this device last advertised keys in; None: none recorded. An
        unreadable record raises StateFileError (the caller cannot tell which session it advertised in)."""
        try:
            raw = json.loads(self.advert_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise StateFileError(f"{self.advert_file}: unreadable ({exc})") from None
        r, session = (raw.get("round"), raw.get("session")) if isinstance(raw, dict) else (None, None)
        if isinstance(r, bool) or not isinstance(r, int) or r < 0 or not isinstance(session, str) \
                or not 0 < len(session) <= 256:
            raise StateFileError(f"{self.advert_file}: not a round and a session: {str(raw)[:80]!r}")
        return r, session

    def save_secure_advert(self, round_: int, session: str) -> None:
        """Record that this device advertises keys in ``session`` of secure round ``round_`` (fsync and rename:
        on disk before the advert leaves)."""
        atomic_write(self.advert_file, json.dumps({"round": int(round_), "session": str(session)}))

    def save_upload(self, blob: bytes) -> None:
        atomic_write(self.upload_file, blob)

    def load_upload(self, record: UploadRecord) -> bytes | None:
        """The stored upload bytes if they are the ones ``record`` names, else None."""
        import hashlib

        try:
            blob = self.upload_file.read_bytes()
        except FileNotFoundError:
            return None
        return blob if hashlib.sha256(blob).hexdigest() == record.digest else None
