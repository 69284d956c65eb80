"""The round journal: an append-only file per round, so nothing acknowledged is ever lost.

The coordinator writes a round's plan when it opens the round and every accepted update before it
folds and acknowledges it; each append is fsynced. After a crash it loads the last checkpoint
(round r complete), replays ``round-<r+1>`` -- the same plan (so the same devices are selected) and
every journaled update, folded again -- and carries on with that round.

File ``journal/round-<r:06d>.jnl``; records back to back, little-endian::

    "FLJ2"  u8 kind (1 plan, 2 update)  u32 payload length  32-byte HMAC-SHA256(key, kind + length + payload)  payload

The key is 32 random bytes in ``journal/.key`` (0600), made by the coordinator and never sent: a device controls
the bytes of its own update, which lie inside a record, and could shape them as a whole record of its choosing
(another device's update, a plan); without the key it cannot authenticate one, so nothing it planted is ever read
as a record. (Records of an earlier release, ``"FLJR"`` with a CRC32, are still read in order from the start of a
file, but never resynchronised onto.)

    plan payload    the plan's envelope payload (protocol.encode_message)
    update payload  u8 client length, client id (ASCII), u32 round, 32-byte sha256 of the blob, blob

Reading one device's update back (a secure round's masked input whose device gave no consent): :class:`Journal`
notes the offset and length of each device's first update record as it appends it (n integers a round), and
:meth:`Journal.read_updates` reads only those records, each authenticated alone -- O(record) memory and reads per
device, whatever the size of the round. Where the index does not cover the file (it held records before the
:class:`Journal` opened it), :func:`scan_updates` finds them in one streaming pass, every record authenticated as it
passes and only the wanted ones kept.

A crash can leave the last record torn (short, or failing its CRC). A damaged record anywhere else (the disk
flipped a bit in its payload, or in its length, so its end cannot be trusted) is skipped and counted, and
:func:`read_journal` resynchronises on the next intact record: a magic, a kind, a length that fits and a CRC that
matches. Only bytes after which no intact record follows are a torn tail: :class:`Journal` cuts them off before
appending, and keeps what it cut beside the journal (``round-<r>.jnl.cut-<offset>``, 0600), so nothing that could
be read is ever dropped for good. A fsynced record is acknowledged only after it is whole, so a torn tail was never
acknowledged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from flayer.files import atomic_write, open_private, private_dir

__all__ = [
    "Journal",
    "JournalError",
    "JournalRecord",
    "JournalReplay",
    "journal_key",
    "journal_path",
    "prune_journals",
    "read_journal",
    "scan_updates",
]

log = logging.getLogger(__name__)

MAGIC = b"FLJ2"
LEGACY_MAGIC = b"FLJR"  # an earlier release's records: a CRC32, no key
_HEAD = struct.Struct("<4sBI32s")
_LEGACY_HEAD = struct.Struct("<4sBII")
KEY_NAME = ".key"
KIND_PLAN, KIND_UPDATE = 1, 2
MAX_RECORD = 1 << 31
_CHUNK = 1 << 20  # scan_updates: the most of a payload it holds that it does not keep
_NAME = re.compile(r"round-(\d{6,})\.jnl(?:\.cut-\d+)?")


class JournalError(RuntimeError):
    """A journal cannot be written or is not a journal at all."""


@dataclass(frozen=True)
class JournalRecord:
    kind: int
    client: str = ""
    round: int = 0
    digest: str = ""
    data: bytes = b""  # plan payload or update blob


@dataclass
class JournalReplay:
    plan: bytes | None = None  # the last plan written (asynchronous rounds write one per change of slots)
    plans: list[bytes] = field(default_factory=list)
    updates: list[JournalRecord] = field(default_factory=list)
    good_bytes: int = 0  # offset after the last intact record
    torn_bytes: int = 0  # bytes after it (a torn tail)
    corrupt: int = 0  # damaged stretches skipped before the tail (each resynchronised on the next intact record)


def journal_path(folder: Path, round_: int) -> Path:
    return folder / f"round-{round_:06d}.jnl"


def journal_key(folder: Path) -> bytes:
    """The folder's journal key (module docstring), made on first use."""
    path = folder / KEY_NAME
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        private_dir(folder, "journal folder")
        atomic_write(path, secrets.token_bytes(32))
        key = path.read_bytes()
    if len(key) != 32:
        raise JournalError(f"{path}: a journal key is 32 bytes, found {len(key)}")
    return key


def _mac(key: bytes, kind: int, payload: bytes) -> bytes:
    mac = hmac.new(key, struct.pack("<BI", kind, len(payload)), hashlib.sha256)
    mac.update(payload)  # no copy of the payload
    return mac.digest()


def _encode(kind: int, payload: bytes, key: bytes) -> bytes:
    return _HEAD.pack(MAGIC, kind, len(payload), _mac(key, kind, payload)) + payload


def _update_payload(client: str, round_: int, blob: bytes) -> tuple[bytes, str]:
    cid = client.encode("ascii")
    digest = hashlib.sha256(blob).digest()
    return struct.pack("<B", len(cid)) + cid + struct.pack("<I", round_) + digest + blob, digest.hex()


def _parse_update(payload: bytes) -> JournalRecord:
    n = payload[0]
    client = payload[1:1 + n].decode("ascii")
    (round_,) = struct.unpack_from("<I", payload, 1 + n)
    digest = payload[5 + n:37 + n]
    blob = payload[37 + n:]
    if len(digest) != 32 or hashlib.sha256(blob).digest() != digest:
        raise ValueError("update record: blob does not match its digest")
    return JournalRecord(KIND_UPDATE, client, round_, digest.hex(), blob)


def _intact(data: bytes, at: int, key: bytes, legacy: bool = False) -> tuple[int, int, bytes] | None:
    """(kind, end, payload) of the record at ``at`` when it is whole and authenticates under ``key``, else None;
    ``legacy``: an earlier release's CRC record is taken too (in order only, never by resynchronising)."""
    if len(data) - at >= _HEAD.size and data[at:at + 4] == MAGIC:
        _magic, kind, length, mac = _HEAD.unpack_from(data, at)
        end = at + _HEAD.size + length
        if kind not in (KIND_PLAN, KIND_UPDATE) or end > len(data):
            return None
        payload = data[at + _HEAD.size:end]
        return (kind, end, payload) if hmac.compare_digest(mac, _mac(key, kind, payload)) else None
    if legacy and len(data) - at >= _LEGACY_HEAD.size and data[at:at + 4] == LEGACY_MAGIC:
        _magic, kind, length, crc = _LEGACY_HEAD.unpack_from(data, at)
        end = at + _LEGACY_HEAD.size + length
        if kind not in (KIND_PLAN, KIND_UPDATE) or end > len(data):
            return None
        payload = data[at + _LEGACY_HEAD.size:end]
        return (kind, end, payload) if zlib.crc32(bytes([kind]) + payload) == crc else None
    return None


def _unreadable(path: Path, at: int, why: str) -> JournalError:
    return JournalError(f"journal {path}: the record at byte {at} {why}")


def _parsed_at(path: Path, at: int, payload: bytes) -> JournalRecord:
    """The authenticated update payload of the record at byte ``at``, parsed, else JournalError naming it."""
    try:
        return _parse_update(payload)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
        raise _unreadable(path, at, f"is unreadable ({exc})") from None


def _update_at(path: Path, data: bytes, at: int, client: str, key: bytes) -> JournalRecord:
    """The update record ``data`` (read at byte ``at``), authenticated and ``client``'s, else JournalError."""
    rec = _intact(data, 0, key)
    if rec is None or rec[0] != KIND_UPDATE or rec[1] != len(data):
        raise _unreadable(path, at, f"does not authenticate as an update record ({client}'s)")
    out = _parsed_at(path, at, rec[2])
    if out.client != client:
        raise _unreadable(path, at, f"is {out.client!r}'s update, not {client!r}'s")
    return out


def scan_updates(path: Path, key: bytes, clients: Iterable[str]) -> Iterator[JournalRecord]:
    """The first update record of each of ``clients`` in ``path``, in one streaming pass from the start: every record's
    HMAC is checked as it passes (in chunks of ``_CHUNK``), only the wanted records are kept, and the pass stops once
    all are found. Unlike :func:`read_journal` it never resynchronises: a record that does not authenticate (damaged,
    or an earlier release's) raises JournalError naming its offset; a torn tail ends the pass."""
    wanted = set(clients)
    try:
        with open(path, "rb") as fh:
            at = 0
            while wanted:
                head = fh.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    return  # the end, or a torn tail
                magic, kind, length, mac = _HEAD.unpack(head)
                if magic != MAGIC or kind not in (KIND_PLAN, KIND_UPDATE):
                    raise _unreadable(path, at, "is not a record")
                check = hmac.new(key, struct.pack("<BI", kind, length), hashlib.sha256)
                first = fh.read(min(length, 256)) if kind == KIND_UPDATE else b""  # the client id lies in it
                keep = [first] if first and first[1:1 + first[0]].decode("ascii", "replace") in wanted else None
                check.update(first)
                left = length - len(first)
                while left:
                    chunk = fh.read(min(left, _CHUNK))
                    if not chunk:
                        return  # a torn tail
                    check.update(chunk)
                    if keep is not None:
                        keep.append(chunk)
                    left -= len(chunk)
                if not hmac.compare_digest(check.digest(), mac):
                    raise _unreadable(path, at, "does not authenticate")
                if keep is not None:
                    rec = _parsed_at(path, at, b"".join(keep))
                    if rec.client in wanted:
                        wanted.discard(rec.client)
                        yield rec
                at += _HEAD.size + length
    except OSError as exc:
        raise JournalError(f"cannot read the journal {path}: {exc.strerror or exc}") from exc


def _next_intact(data: bytes, start: int, key: bytes) -> int | None:
    """The offset of the first record at or after ``start`` that authenticates under ``key`` (None: none, the rest
    is a torn tail). Bytes a device shaped as a record inside its own upload do not authenticate."""
    at = data.find(MAGIC, start)
    while at >= 0:
        if _intact(data, at, key) is not None:
            return at
        at = data.find(MAGIC, at + 1)
    return None


def read_journal(path: Path, key: bytes | None = None) -> JournalReplay:
    """Every intact record of ``path`` (see module docstring for torn and damaged records); ``key``: the journal
    key (default: the one beside the file)."""
    data = path.read_bytes()
    key = journal_key(path.parent) if key is None else key
    out = JournalReplay()
    at = 0
    legacy = True  # an earlier release's records, in order from the start of the file
    while at < len(data):
        rec = _intact(data, at, key, legacy)
        if rec is None:
            legacy = False
            nxt = _next_intact(data, at + 1, key)
            if nxt is None:
                break  # a torn tail: no intact record after it
            out.corrupt += 1
            log.error("journal %s: bytes %d-%d are a damaged record; skipped, read on from the next intact record",
                      path, at, nxt)
            at = nxt
            continue
        kind, end, payload = rec
        if kind == KIND_PLAN:
            out.plan = payload
            out.plans.append(payload)
        else:
            try:
                out.updates.append(_parse_update(payload))
            except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
                out.corrupt += 1
                log.error("journal %s: update record at byte %d unreadable (%s); skipped", path, at, exc)
        at = end
        out.good_bytes = at
    out.torn_bytes = len(data) - out.good_bytes
    if out.torn_bytes:
        log.warning("journal %s: %d bytes of a torn last record ignored", path, out.torn_bytes)
    return out


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


class Journal:
    """The open journal of one round (append + fsync per record)."""

    def __init__(self, folder: Path, round_: int) -> None:
        self.path = journal_path(folder, round_)
        self.round = round_
        self._where: dict[str, tuple[int, int]] = {}  # client -> (offset, length) of its first update record
        self.indexed = True  # every update record of the file is in _where (False: some were there before it opened)
        try:
            private_dir(folder, "journal folder")
            self._key = journal_key(folder)
            created = not self.path.exists()
            if not created:
                replay = read_journal(self.path, self._key)
                self.indexed = not replay.updates
                if replay.torn_bytes:  # kept aside first: nothing cut is lost for good (module docstring)
                    cut = self.path.with_name(f"{self.path.name}.cut-{replay.good_bytes}")
                    with open(self.path, "rb") as fh:
                        fh.seek(replay.good_bytes)
                        atomic_write(cut, fh.read())
                    os.truncate(self.path, replay.good_bytes)
            self._fh = open_private(self.path, "ab", buffering=0)  # unbuffered: nothing held back; 0600
        except OSError as exc:
            raise JournalError(f"cannot open the journal {self.path}: {exc.strerror or exc}") from exc
        if created:
            _fsync_dir(folder)

    def _append(self, kind: int, payload: bytes) -> tuple[int, int]:
        """Append one record and fsync it; returns its offset and length. On an I/O error (a full disk) the file is cut back to where
        the record began, when it can be, and JournalError names the file: the caller must not go on as
        if the record were written (the coordinator stops; a restart cuts any torn tail)."""
        if len(payload) >= MAX_RECORD:
            raise JournalError(f"journal record of {len(payload)} bytes is too large")
        fd = self._fh.fileno()
        start = os.fstat(fd).st_size
        try:
            data = memoryview(_encode(kind, payload, self._key))
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
            return start, _HEAD.size + len(payload)
        except OSError as exc:
            try:
                os.truncate(self.path, start)
            except OSError:
                pass  # a torn tail: read_journal stops before it, the next Journal cuts it
            raise JournalError(f"cannot write the journal {self.path}: {exc.strerror or exc}") from exc

    def append_plan(self, plan_payload: bytes) -> None:
        self._append(KIND_PLAN, plan_payload)

    def append_update(self, client: str, round_: int, blob: bytes) -> str:
        """Append and fsync; returns the blob's sha256 hex."""
        payload, digest = _update_payload(client, round_, blob)
        self._where.setdefault(client, self._append(KIND_UPDATE, payload))
        return digest

    def read_updates(self, clients: Iterable[str]) -> Iterator[JournalRecord]:
        """The first update record of each of ``clients`` (one without any is left out), each read alone where it was
        appended and authenticated (module docstring); JournalError: a record there does not authenticate, or is not
        that client's update. When the index does not cover the file, one pass of :func:`scan_updates` instead."""
        wanted = list(dict.fromkeys(clients))
        if not self.indexed:
            yield from scan_updates(self.path, self._key, wanted)
            return
        try:
            with open(self.path, "rb", buffering=0) as fh:
                for client in wanted:
                    if (where := self._where.get(client)) is not None:
                        yield _update_at(self.path, os.pread(fh.fileno(), where[1], where[0]), where[0], client,
                                         self._key)
        except OSError as exc:
            raise JournalError(f"cannot read the journal {self.path}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        self._fh.close()


def prune_journals(folder: Path, done_round: int, keep: int) -> list[Path]:
    """Delete journals of rounds <= done_round - keep (their rounds are in a checkpoint)."""
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = _NAME.fullmatch(p.name)
        if m and int(m.group(1)) <= done_round - keep:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed
