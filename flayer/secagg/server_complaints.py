"""Verifiable complaints about sealed shares (the coordinator's side; a part of :class:`~.server.SecAggServer`).

A device whose neighbour's sealed share does not open (or holds no share at its x) does not refuse the round: it
masks with that neighbour as usual (the pairwise mask needs the neighbour's mask key, not its shares), holds
nothing of it, and files a :class:`~flayer.secagg.msg_setup.ShareComplaint` revealing its own **channel key of
that pair only** -- every device advertises one channel key pair per neighbour, so the key opens nothing but the
two sealed shares of that pair: the accused's own shares (what the accused holds anyway) and the complainer's
shares held by the accused. It says nothing of any mask. The coordinator checks the key against the one the
complainer advertised for the pair, derives the channel key with the accused's key for the pair, and opens the
ciphertext it routed itself:

* it does not open, or holds no well-formed share at the complainer's x: the **accused** is named faulty;
* it opens to well-formed shares: the **complainer** is named (a false complaint);
* the revealed key is not the complainer's for that pair: the **complainer** is named.

A device named faulty is refused from then on in the round (a masked input it sends later is not taken, nor its
consent: one whose masked input was in already is taken back out at the consent stage; either way it counts as
dropped, its pairwise masks removed with its neighbours' shares of its mask key or their pair seeds) and, as every
named device, is left out of later rounds by the coordinator. The round goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Container

from . import keys, shamir
from .errors import SecAggError
from .msg_setup import EncryptedShare, KeyAdvert, ShareComplaint
from .params import SecAggParams

__all__ = ["SHARE_STAGE", "ComplaintStage"]

log = logging.getLogger(__name__)
SHARE_STAGE = 2  # the stage byte of a sealed share's associated data (as flayer.secagg.client)


class ComplaintStage:
    """Complaints and per-pair channel keys (mixed into SecAggServer, which sets these attributes)."""

    params: SecAggParams
    faulty: dict[str, str]
    _adverts: dict[str, KeyAdvert]
    _sent: dict[str, tuple[EncryptedShare, ...]]
    _complaints: set[tuple[str, str]]

    def _at(self, stages: tuple[int, ...], what: str) -> None:
        raise NotImplementedError

    def _check(self, round_id: int, device: str, members: Container[str], what: str) -> None:
        raise NotImplementedError

    def _pair_key(self, owner: str, toward: str) -> bytes:
        """``owner``'s advertised channel key toward ``toward`` (its single c_pk without per-pair keys)."""
        advert = self._adverts[owner]
        if not advert.pair_pks:
            return advert.c_pk
        i = sorted(self.params.neighbours(owner)).index(toward)
        return advert.c_pk if i == 0 else advert.pair_pks[i - 1]

    def _pair_keys_problem(self, advert: KeyAdvert) -> str | None:
        """Why an advert's per-pair keys are malformed (their count), or None (each is checked as a key besides)."""
        need = len(self.params.neighbours(advert.device)) - 1  # none at all: its complaints could not be checked
        if len(advert.pair_pks) != need:
            return f"{advert.device} advertised {len(advert.pair_pks)} pair keys, not one per neighbour ({need})"
        return None

    def _name(self, device: str, why: str) -> None:
        if device not in self.faulty:
            self.faulty[device] = why
            log.warning("secagg round %d: %s", self.params.round, why)

    def receive_complaint(self, msg: ShareComplaint) -> str:
        """Check a complaint (module docstring); the device it names faulty."""
        self._at((3,), "share complaint")
        p, me, accused = self.params, msg.device, msg.accused
        self._check(msg.round, me, self._sent, "share complaint")
        if accused not in p.neighbours(me) or accused not in self._sent:
            raise SecAggError(f"{me} complains of {accused}, which sent it no share")
        if (me, accused) in self._complaints:
            raise SecAggError(f"second complaint from {me} of {accused}")
        if not self._adverts[me].pair_pks or not self._adverts[accused].pair_pks:
            raise SecAggError(f"{me} complains of {accused}, but one of them has no per-pair channel keys: the "
                              "complaint cannot be checked")
        self._complaints.add((me, accused))
        try:
            mine = keys.public_from_private(msg.key)
        except SecAggError:
            mine = b""
        if mine != self._pair_key(me, accused):
            self._name(me, f"{me} complained of {accused} with a channel key that is not its own for the pair")
            return me
        share = next(s for s in self._sent[accused] if s.receiver == me)
        channel = keys.derive_aead_key(keys.agree(msg.key, self._pair_key(accused, me)), p.session, p.round, me,
                                       accused)
        ad = keys.associated_data(p.session, p.round, accused, me, SHARE_STAGE, p.transcript)
        try:
            plain = keys.open_sealed(channel, share.ciphertext, ad, f"share from {accused}")
            xs = {shamir.decode_share(plain[:shamir.SHARE_LEN])[0], shamir.decode_share(plain[shamir.SHARE_LEN:])[0]}
        except (SecAggError, ValueError):
            xs = set()
        if xs == {p.x_of(me)}:
            self._name(me, f"{me} complained of the share from {accused}, which opens (a false complaint)")
            return me
        self._name(accused, f"{accused} sealed a share for {me} that does not open to a share at its x")
        return accused
