"""What the coordinator does with each message a device sends (a part of
:class:`coordinator.server.Coordinator`, called on its worker thread).

Every message passes the inbox first (:mod:`coordinator.inbox`: topic, retained junk, the signature of the
device the topic names), then the revocation list. Then by kind: a secure round's messages go to the secure
phase (:mod:`coordinator.secure_phase`); update chunks are collected and each complete update screened,
journaled, folded and acknowledged (:meth:`MessageIntake._accept`); a status updates the registry and may
announce an upload the round's close waits for (:class:`coordinator.rounds.Announcements`); metrics are a
secure round's evaluation report or a calibration report (round 0). A check this code does not foresee
refuses the message and counts it; it never stops the loop.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from protocol import Kind, Metrics, Status
from transport.link import Received

from .async_rounds import AsyncVersions
from .calibration import CalibrationPhase
from .cycle import RoundCycle
from .inbox import CompleteUpdate, Inbox
from .registry import DeviceRegistry
from .revocations import RevocationList
from .secure_phase import SecurePhase

__all__ = ["MessageIntake"]

log = logging.getLogger("coordinator.server")


class MessageIntake:
    """Routes a received message (module docstring)."""

    def __init__(self, inbox: Inbox, revoked: RevocationList, registry: DeviceRegistry, cycle: RoundCycle,
                 secure: SecurePhase, calibration: CalibrationPhase, versions: AsyncVersions | None,
                 counters: Counter[str], clock: Callable[[], float], close: Callable[[str], None],
                 on_progress: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        """``close``: closes the open round with a reason (the round loop's, which opens the next version of
        asynchronous rounds at once)."""
        self.inbox, self.revoked, self.registry, self.cycle = inbox, revoked, registry, cycle
        self.secure, self.calibration, self.versions = secure, calibration, versions
        self.counters, self.clock, self.close, self.on_progress = counters, clock, close, on_progress
        revoked.on_new = self.withdraw  # a device revoked from now on: the open round stops waiting for it

    def on_message(self, ev: Received) -> None:
        parsed = self.inbox.parse(ev.topic)
        if parsed is None:
            return
        if self.inbox.not_input(parsed, ev):  # retained junk (cleared), or the echo of a clear
            return
        if parsed.client in self.revoked.refresh():
            self.inbox.count("revoked", f"{parsed.kind} from revoked device {parsed.client} dropped", parsed.client)
            return
        if parsed.kind == "secagg":  # coordinator.secure_phase
            assert parsed.client is not None
            closing = self.secure.on_message(self.cycle.open, parsed.client, parsed, ev.payload)
            if closing is not None:
                self.close(closing)
        elif parsed.kind == "update":
            p = self.cycle.progress
            try:
                done = self.inbox.update_chunk(parsed, ev.payload, p.done_round, p.accepted_before,
                                               self.versions.window if self.versions is not None else None)
            except ValueError as exc:  # a check this code does not foresee: refuse, count, keep running
                log.exception("update chunk from %s", parsed.client)
                self.inbox.count("malformed", f"update chunk from {parsed.client}: {exc}")
                return
            if done is not None:
                self._accept(done)
        elif (got := self.inbox.message(parsed, ev.payload, Kind.STATUS if parsed.kind == "status"
                                        else Kind.METRICS)) is not None:
            env, msg = got
            assert parsed.client is not None
            if isinstance(msg, Status):
                why = self.registry.replayed(parsed.client, msg, env.digest, ev.retain)
                if why is not None:  # an earlier status of the device, put back (coordinator.registry)
                    self.inbox.count("replayed", f"status of {parsed.client}: {why}", parsed.client)
                    return
                self.registry.observe(parsed.client, msg, self.clock(), ev.retain)
                self._announced(parsed.client, msg, ev.retain)
            elif isinstance(msg, Metrics) and self.secure.metrics(self.cycle.open, parsed.client, msg):
                pass  # a secure round's evaluation report (coordinator.secure_phase)
            elif isinstance(msg, Metrics) and msg.round == 0 and \
                    (taken := self.calibration.report(parsed.client, msg.values)) is not None:
                status, reason = taken
                if status != "accepted":
                    self.inbox.count(status if status in ("duplicate", "not_selected") else "bad_message", reason)
                self.inbox.ack(parsed.client, 0, env.digest, status, reason)

    def withdraw(self, revoked: frozenset[str]) -> None:
        """Devices revoked just now (:class:`coordinator.revocations.RevocationList`): the open round's close no
        longer waits for those selected whose update has not come (:meth:`coordinator.rounds.RoundTimer.withdraw`);
        whatever they send is dropped, and the registry counts them offline, so no stage of a secure round waits
        for them either."""
        rnd = self.cycle.open
        if rnd is None or rnd.timer is None or self.versions is not None:  # async: their slots are freed instead
            return
        for device in sorted((revoked & frozenset(rnd.selected)) - frozenset(rnd.accepted)):
            rnd.timer.withdraw(device)
            log.warning("round %d: %s was revoked before its update came: the round no longer waits for it",
                        rnd.number, device)

    def _announced(self, client: str, msg: Status, retained: bool) -> None:
        """A device's status announcing an upload it has started: the round's close may wait for it
        (coordinator.rounds, Announcements; a retained copy says nothing about now)."""
        rnd = self.cycle.open
        if retained or msg.state != "uploading" or rnd is None or rnd.timer is None or rnd.timer.announced is None:
            return
        if self.versions is not None:  # any slot holder, for a version still young enough
            self.versions.announcing(rnd)
        why = rnd.timer.announced.add(client, msg.info, self.clock(), rnd.accepted)
        if why and "upload_round" in msg.info:
            log.debug("%s: announcement not taken (%s)", client, why)

    def _accept(self, up: CompleteUpdate) -> None:
        rnd = self.cycle.open
        assert rnd is not None
        rnd.accept(up.client, up.round, up.blob, up.verdict, self.clock())  # journaled and fsynced, then folded
        if up.verdict.clipped:
            self.counters["clipped"] += 1
        if self.versions is not None:
            self.versions.accepted(up.client)  # a tick soon gives the slot to an idle device
        # async: the version whose buffer took it, so the device does not train on that version again
        self.inbox.ack(up.client, up.round, up.digest, "accepted", up.verdict.reason,
                       rnd.number if self.versions is not None else 0)
        if self.on_progress is not None:
            self.on_progress("accepted", {"round": up.round, "client": up.client, "accepted": len(rnd.accepted),
                                          "selected": len(rnd.selected)})
