"""The coordinator's side of the consent stage (:mod:`.msg_consent`), held by :class:`~.server.SecAggServer`.

After the masked inputs close, each device whose masked input arrived is asked for its consent; a consent that does
not verify under the device's key (``ServerConsistency.verify``) is refused. When the stage closes (the first
survivor-set or unmask request), the survivors are the devices whose masked input **and** consent arrived; the masked
input of a device that did not consent is taken back out of the running sum and the device counts as dropped (its
neighbours reveal its mask key's shares, never its self-mask seed's).

Taking an input back out needs that input. The server keeps only the running sum when it is given ``recall`` (the
coordinator reads the masked inputs back from its round journal, where every accepted update lies, one at a time: the
recall is handed every device to read back at once and yields each input in turn, so it can find them all in one pass
and the server holds one at a time); without one, it keeps each masked input in memory until the stage closes (in
process: the simulator and the tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ._wire import check_id
from .consistency import Verify
from .errors import SecAggError
from .msg_consent import Consent, ConsentRequest, consent_message
from .params import SecAggParams

__all__ = ["ConsentBook", "Recall"]

log = logging.getLogger(__name__)

# the masked inputs (uint32) of the round of the devices named, read back by the caller: (device, input), each once
Recall = Callable[[Sequence[str]], Iterable[tuple[str, np.ndarray]]]


class ConsentBook:
    """The consents of one round: asked, received and checked, then the survivors they give (module docstring)."""

    def __init__(self, params: SecAggParams, verify: Verify | None, recall: Recall | None = None) -> None:
        self.params = params
        self._verify = verify  # None: forwarded unchecked (the neighbours check each one anyway)
        self._recall = recall
        self._inputs: dict[str, np.ndarray] | None = None if recall is not None else {}
        self._consents: dict[str, bytes] = {}
        self.asked: set[str] = set()
        self.sent: frozenset[str] | None = None  # the devices whose masked input arrived (set when the stage closes)

    @property
    def closed(self) -> bool:
        return self.sent is not None

    @property
    def consented(self) -> frozenset[str]:
        return frozenset(self._consents)

    def keep(self, device: str, vector: np.ndarray) -> None:
        """A masked input just added to the running sum (kept only without ``recall``)."""
        if self._inputs is not None:
            self._inputs[device] = vector

    def request(self, device: str, masked: frozenset[str]) -> ConsentRequest:
        if self.closed:
            raise SecAggError("the consent stage is over")
        if device not in masked:
            raise SecAggError(f"{device} sent no masked input: it is asked for no consent")
        self.asked.add(device)
        return ConsentRequest(self.params.round, device)

    def receive(self, msg: Consent, masked: frozenset[str], named: Mapping[str, str] | None = None) -> None:
        """``msg`` from a device whose masked input is in ``masked``; refused from a device ``named`` faulty (device ->
        the proof): its masked input is then taken back out of the sum when the stage closes, as one without a
        consent, and it counts as dropped."""
        p = self.params
        if named and msg.device in named:
            raise SecAggError(f"consent from {msg.device}, named faulty: {named[msg.device]}")
        if msg.round != p.round:
            raise SecAggError(f"consent from {msg.device} is for round {msg.round}, not {p.round}")
        if self.closed:
            raise SecAggError(f"consent from {msg.device} after the consent stage closed")
        if msg.device not in masked:
            raise SecAggError(f"consent from {msg.device}, whose masked input did not arrive")
        if msg.device in self._consents:
            raise SecAggError(f"second consent from {msg.device}")
        message = consent_message(p.session, p.round, msg.device, p.transcript)
        if self._verify is not None and not self._verify(msg.device, message, msg.signature):
            raise SecAggError(f"consent from {msg.device} does not verify under its key")
        self._consents[msg.device] = msg.signature

    def signatures(self, devices: Iterable[str]) -> tuple[tuple[str, bytes], ...]:
        """The consents of ``devices`` (each consented: the survivors), for an unmask request."""
        return tuple((check_id(d, "consenting device"), self._consents[d]) for d in devices)

    def close(self, masked: frozenset[str], total: np.ndarray) -> frozenset[str]:
        """Close the stage: the survivors (masked input and consent); each other masked input is subtracted from
        ``total`` (the running sum, in place)."""
        assert not self.closed
        self.sent = masked
        survivors = masked & self.consented
        missing = sorted(masked - survivors)
        inputs = self._inputs
        back = ((d, inputs[d]) for d in missing) if inputs is not None else self._recall_inputs(missing)
        for device, vector in back:
            total -= vector  # wraps mod 2^32 as the sum did
            log.info("secagg round %d: %s sent a masked input but no consent: left out of the sum, counted as dropped",
                     self.params.round, device)
        self._inputs = None
        return survivors

    def _recall_inputs(self, devices: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        """The masked inputs of ``devices`` read back, each checked (SecAggError: one is not the round's, comes twice
        or was not asked for, or one is missing)."""
        assert self._recall is not None
        left = set(devices)
        if not left:
            return
        for device, vector in self._recall(devices):
            if device not in left:
                raise SecAggError(f"a masked input of {device} read back, which was not asked for (or twice)")
            if not isinstance(vector, np.ndarray) or vector.dtype != np.uint32 or vector.shape != (self.params.length,):
                raise SecAggError(f"the masked input of {device} read back is not the round's "
                                  f"({self.params.length} uint32)")
            left.discard(device)
            yield device, vector
        if left:
            raise SecAggError(f"the masked input of {', '.join(sorted(left))} cannot be read back (not in the round's "
                              f"journal)")
