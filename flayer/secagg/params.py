"""The public parameters of one secure-aggregation round, fixed before stage 1 and known to every party."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ._wire import check_id
from .graph import check_degree, neighbour_count, neighbour_graph
from .keys import check_session
from .prg import MAX_LENGTH, SEED_LEN
from .ring import RingSpec

__all__ = ["MAX_DEGREE", "MAX_PARTICIPANTS", "MIN_THRESHOLD", "SecAggParams"]

MAX_PARTICIPANTS = 0xFFFF  # Shamir x = index + 1 travels as u16
MAX_DEGREE = 1024  # neighbours per device: bounds every list a message carries
MIN_THRESHOLD = 2  # with t = 1 every single share *is* the secret
_TRANSCRIPT = b"flayer-secagg/v1/transcript\x00"
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class SecAggParams:
    """Session id, round, the sorted participants, threshold t, degree k, graph seed, vector length, ring.

    Validated: 2 <= participants <= 65535, distinct valid ids (sorted here); k = n-1 or even in
    [2, n-2], k <= 1024; 2 <= t <= k+1 (t >= 2 so that no single share, hence no single colluding
    device, reveals a secret; :func:`~flayer.secagg.graph.neighbour_count` picks a strict majority
    of the k+1 holders); 1 <= length <= 2^26; ``ring.max_summands >= len(participants)`` so the
    sum cannot wrap.
    """

    session: str
    round: int
    participants: tuple[str, ...]
    threshold: int
    degree: int
    graph_seed: bytes
    length: int
    ring: RingSpec
    context: bytes = b""

    def __post_init__(self) -> None:
        check_session(self.session)
        if not isinstance(self.round, int) or isinstance(self.round, bool) or not 0 <= self.round <= 0xFFFFFFFF:
            raise ValueError(f"round must be an integer in [0, 2^32), got {self.round!r}")
        ids = tuple(sorted(check_id(p, "participant") for p in self.participants))
        if len(set(ids)) != len(ids):
            raise ValueError("participants must be distinct")
        if not 2 <= len(ids) <= MAX_PARTICIPANTS:
            raise ValueError(f"participants must number 2-{MAX_PARTICIPANTS}, got {len(ids)}")
        object.__setattr__(self, "participants", ids)
        check_degree(len(ids), self.degree)
        if self.degree > MAX_DEGREE:
            raise ValueError(f"degree k={self.degree} exceeds {MAX_DEGREE}")
        t = self.threshold
        if not isinstance(t, int) or isinstance(t, bool) or not MIN_THRESHOLD <= t <= self.degree + 1:
            raise ValueError(f"threshold t={t!r} must be an integer in [{MIN_THRESHOLD}, k+1={self.degree + 1}]")
        if not isinstance(self.graph_seed, bytes) or len(self.graph_seed) != SEED_LEN:
            raise ValueError(f"graph_seed must be {SEED_LEN} bytes")
        if not isinstance(self.length, int) or isinstance(self.length, bool) or not 1 <= self.length <= MAX_LENGTH:
            raise ValueError(f"length must be an integer in [1, {MAX_LENGTH}], got {self.length!r}")
        if not isinstance(self.ring, RingSpec):
            raise TypeError(f"ring must be a RingSpec, got {type(self.ring).__name__}")
        if self.ring.max_summands < len(ids):
            raise ValueError(f"ring.max_summands={self.ring.max_summands} is below the {len(ids)} "
                             "participants: their sum could wrap")
        if not isinstance(self.context, bytes) or len(self.context) not in (0, 32):
            raise ValueError("context must be empty or a 32-byte digest")

    @classmethod
    def for_round(cls, session: str, round: int, participants: Sequence[str], length: int, ring: RingSpec,
                  graph_seed: bytes, dropout_rate: float, **rule: Any) -> SecAggParams:
        """Parameters with k and t from :func:`~flayer.secagg.graph.neighbour_count` (``rule``: its options)."""
        k, t = neighbour_count(len(participants), dropout_rate, **rule)
        return cls(session=session, round=round, participants=tuple(participants), threshold=t, degree=k,
                   graph_seed=graph_seed, length=length, ring=ring)

    @cached_property
    def transcript(self) -> bytes:
        """The round's plan digest: SHA-256 over the session, the round, the sorted cohort, t, k, the graph seed, the
        vector length, the ring's width and :attr:`context`. Every signature of the protocol (key adverts, survivor
        sets) and every sealed share's associated data covers it: what a party signs is what it relied on, so a
        device shown another plan than its neighbours -- another cohort, another x -- verifies none of their
        messages, and none of its own verify for them. Never sent: each party computes it from its plan."""
        h = hashlib.sha256(_TRANSCRIPT + bytes([len(self.session)]) + self.session.encode() + _U32.pack(self.round))
        h.update(_U32.pack(len(self.participants)))
        for d in self.participants:
            h.update(bytes([len(d)]) + d.encode())
        h.update(_U32.pack(self.threshold) + _U32.pack(self.degree) + self.graph_seed + _U32.pack(self.length)
                 + bytes([self.ring.bits]) + bytes([len(self.context)]) + self.context)
        return h.digest()

    @cached_property
    def graph(self) -> dict[str, frozenset[str]]:
        return neighbour_graph(self.participants, self.degree, self.graph_seed)

    @cached_property
    def _index(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.participants)}

    def neighbours(self, device: str) -> frozenset[str]:
        return self.graph[device]

    def is_participant(self, device: str) -> bool:
        return device in self._index

    def x_of(self, device: str) -> int:
        """The device's Shamir x coordinate: its index among the sorted participants, plus 1."""
        return self._index[device] + 1

    def index(self, device: str) -> int:
        return self._index[device]
