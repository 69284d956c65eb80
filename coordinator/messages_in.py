"""What the coordinator does with each message a device sends (a mixin of
:class:`coordinator.server.Coordinator`, on its worker thread).

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
from typing import Any

from protocol import Kind, Metrics, Status
from transport.link import Received

from .inbox import CompleteUpdate

__all__ = ["MessageIntake"]

log = logging.getLogger("coordinator.server")


class MessageIntake:
    """Routes a received message (module docstring)."""

    inbox: Any
    revoked: Any
    secure_phase: Any
    registry: Any
    calibration: Any
    counters: Any
    slots: Any
    fs: Any
    asynchronous: bool
    done_round: int
    accepted_before: Any
    window: Any
    clock: Any
    on_progress: Any
    open: Any

    def _on_message(self, ev: Received) -> None:
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
            self.secure_phase.on_message(parsed.client, parsed, ev.payload)
        elif parsed.kind == "update":
            try:
                done = self.inbox.update_chunk(parsed, ev.payload, self.done_round, self.accepted_before, self.window)
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
            elif isinstance(msg, Metrics) and self.secure_phase.metrics(parsed.client, msg):
                pass  # a secure round's evaluation report (coordinator.secure_phase)
            elif isinstance(msg, Metrics) and self.calibration is not None and msg.round == 0:
                status, reason = self.calibration.add(parsed.client, msg.values)
                if status != "accepted":
                    self.inbox.count(status if status in ("duplicate", "not_selected") else "bad_message", reason)
                self.inbox.ack(parsed.client, 0, env.digest, status, reason)

    def _announced(self, client: str, msg: Status, retained: bool) -> None:
        """A device's status announcing an upload it has started: the round's close may wait for it
        (coordinator.rounds, Announcements; a retained copy says nothing about now)."""
        rnd = self.open
        if retained or msg.state != "uploading" or rnd is None or rnd.timer is None or rnd.timer.announced is None:
            return
        if self.asynchronous:  # any slot holder, for a version still young enough (waited for at the last version)
            rnd.timer.announced.selected = frozenset(self.slots.held) | rnd.selected
            rnd.timer.announced.rounds = range(max(1, rnd.number - self.fs.max_staleness), rnd.number + 1)
        why = rnd.timer.announced.add(client, msg.info, self.clock(), rnd.accepted)
        if why and "upload_round" in msg.info:
            log.debug("%s: announcement not taken (%s)", client, why)

    def _accept(self, up: CompleteUpdate) -> None:
        rnd = self.open
        assert rnd is not None
        rnd.accept(up.client, up.round, up.blob, up.verdict, self.clock())  # journaled and fsynced, then folded
        if up.verdict.clipped:
            self.counters["clipped"] += 1
        if self.asynchronous:
            self.slots.release(up.client)  # a tick soon gives the slot to an idle device (coordinator.async_rounds)
        # async: the version whose buffer took it, so the device does not train on that version again
        self.inbox.ack(up.client, up.round, up.digest, "accepted", up.verdict.reason,
                       rnd.number if self.asynchronous else 0)
        if self.on_progress is not None:
            self.on_progress("accepted", {"round": up.round, "client": up.client, "accepted": len(rnd.accepted),
                                          "selected": len(rnd.selected)})
