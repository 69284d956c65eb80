"""The coordinator's side of the consistency round (:mod:`.consistency`), a part of :class:`~.server.SecAggServer`.

After stage 3 closes, each survivor is sent the whole survivor set; its signature is checked against the devices'
keys (``ServerConsistency.verify``) and kept; the unmask requests carry T of them (:meth:`SecAggServer.unmask_request`).
"""

from __future__ import annotations

from collections.abc import Container

from .consistency import ServerConsistency, consistency_threshold, survivor_set_message
from .errors import SecAggError
from .messages import ConsistencyRequest, SurvivorSignature
from .params import SecAggParams

__all__ = ["ConsistencyStage"]


class ConsistencyStage:
    """The consistency round's state and calls (mixed into SecAggServer, which sets these attributes)."""

    params: SecAggParams
    consistency: ServerConsistency | None
    _signatures: dict[str, bytes]
    _signed_closed: bool
    _set_message: bytes | None
    _masked: set[str]
    faulty: dict[str, str]

    def _at(self, stages: tuple[int, ...], what: str) -> None:
        raise NotImplementedError

    def _check(self, round_id: int, device: str, members: Container[str], what: str) -> None:
        raise NotImplementedError

    def _close_masked(self) -> None:
        raise NotImplementedError

    @property
    def signed(self) -> frozenset[str]:
        """The survivors whose signature over the survivor set arrived (the consistency round)."""
        return frozenset(self._signatures)

    @property
    def witnesses(self) -> frozenset[str]:
        """The signers that are not survivors (their keys, shares or masked input came late, or never)."""
        return frozenset(self._signatures) - frozenset(self._masked)

    @property
    def signatures_needed(self) -> int:
        assert self.consistency is not None
        return max(self.params.threshold,
                   consistency_threshold(len(self.params.participants), self.consistency.corrupt_fraction))

    def consistency_request(self, device: str) -> ConsistencyRequest:
        """The whole survivor set, for ``device`` to sign (closes stage 3 on the first call)."""
        if self.consistency is None:
            raise SecAggError("this round runs no consistency round")
        self._at((3, 4), "consistency request")
        self._close_masked()
        if self._signed_closed:
            raise SecAggError("the consistency round is over")
        if not self.params.is_participant(device) or device in self.faulty:
            raise SecAggError(f"{device} is no participant of the round in good standing")
        return ConsistencyRequest(self.params.round, device, tuple(sorted(self._masked)))

    def receive_signature(self, msg: SurvivorSignature) -> None:
        if self.consistency is None:
            raise SecAggError("this round runs no consistency round")
        self._at((4,), "survivor signature")
        self._check(msg.round, msg.device, self.params.participants, "survivor signature")  # witnesses too
        if self._signed_closed:
            raise SecAggError(f"survivor signature from {msg.device} after the consistency round closed")
        if msg.device in self._signatures:
            raise SecAggError(f"second survivor signature from {msg.device}")
        verify = self.consistency.verify
        if self._set_message is None:
            self._set_message = survivor_set_message(self.params.session, self.params.round, self._masked,
                                                     self.params.transcript)
        message = self._set_message
        if verify is not None and not verify(msg.device, message, msg.signature):
            raise SecAggError(f"survivor signature from {msg.device} does not verify under its key")
        self._signatures[msg.device] = msg.signature
