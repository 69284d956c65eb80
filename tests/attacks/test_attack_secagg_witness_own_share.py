"""A device shown a survivor set without itself never reveals its own share of its self-mask seed b_u
(docs/explanation/secure-aggregation.md, "What the coordinator can and cannot learn"; docs/explanation/guarantees.md).

The adversary is the coordinator with t-1 colluding neighbours of the victim v: it routes every message, so it holds
every public key, masked input, consent and survivor signature, and the colluders hand it the shares of v's secrets
they hold. The round runs honestly until v has sent its masked input and consented. Then the coordinator shows every
device the same survivor set S without v: v signs it as a witness, so T signatures over S exist with no device shown
another set, and v's honest neighbours, told v dropped, reveal their shares of v's mask key s_v. The coordinator then
sends v an unmask request that lists v itself as a survivor. With v's own share of b_v the colluders' t-1 shares would
make t, b_v would be rebuilt, and v's input would come out on its own: y_v - PRG(b_v) - the pairwise masks. On the
code before, v answered (it counted itself among the survivors of the set it signed without itself), and the test
below recovered v's input exactly. The survivor count an unmask request states is unsigned: a device now takes it
only as the size of the set it signed (before, any count at least the number listed was taken). Each device here is a
real :class:`~flayer.secagg.SecAggClient` with its long-term key.
"""

from __future__ import annotations

import numpy as np
import pytest
from attacklib_secagg import honest_to_masked

from flayer.secagg import (
    ConsentRequest,
    ConsistencyRequest,
    LocalIdentities,
    RingSpec,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    UnmaskRequest,
    keys,
    shamir,
)
from flayer.secagg.prg import expand

IDS = tuple(f"dev-{i:02d}" for i in range(6))
VICTIM = IDS[0]
COLLUDERS = IDS[1:4]  # t-1 of the victim's k other share holders
N = 16
PARAMS = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), N, RingSpec.for_summands(1.0, len(IDS)))  # k=5, t=4


def _round(survivors: tuple[str, ...]):  # type: ignore[no-untyped-def]
    """Every device through its masked input and consent; every device shown ``survivors`` and signing it."""
    who = LocalIdentities(IDS, SeededEntropy(b"witness own shar" * 2))
    clients = {d: SecAggClient(PARAMS, d, SeededEntropy(d.encode().ljust(32, b"\0")), who.for_device(d)) for d in IDS}
    rng = np.random.default_rng(7)
    inputs = {d: rng.integers(0, PARAMS.ring.modulus, N, dtype=np.uint32) for d in IDS}
    adverts, masked = honest_to_masked(SecAggServer(PARAMS), clients, inputs)
    consents = {d: clients[d].consent(ConsentRequest(1, d)).signature for d in IDS}  # the victim books the round
    sigs = {d: clients[d].sign_survivors(ConsistencyRequest(1, d, survivors)).signature for d in IDS}
    return clients, adverts, inputs, masked, consents, sigs


def _ask(d: str, survivors: tuple[str, ...], dropped: tuple[str, ...], count: int, consents: dict[str, bytes],
         sigs: dict[str, bytes]) -> UnmaskRequest:
    return UnmaskRequest(1, d, count, survivors, dropped, tuple((s, g) for s, g in sorted(sigs.items()) if s != d),
                         consents=tuple((u, consents[u]) for u in survivors if u != d))


def _combine(raw: list[bytes]) -> bytes:
    return shamir.combine(dict(shamir.decode_share(s) for s in raw), PARAMS.threshold)


def _unmask_alone(b_v: bytes, s_v: bytes, y_v: np.ndarray, adverts, others) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The victim's input from its masked input, its self-mask seed and its mask key (what the coordinator computes)."""
    mask = expand(b_v, N)
    for w in others:
        seed = keys.derive_mask_seed(keys.agree(s_v, adverts[w].s_pk), PARAMS.session, 1, VICTIM, w)
        mask = mask + expand(seed, N) if PARAMS.index(w) > PARAMS.index(VICTIM) else mask - expand(seed, N)
    return (y_v - mask) & np.uint32(PARAMS.ring.modulus - 1)


def test_a_witness_reveals_no_share_of_its_own_b_so_t_minus_1_colluders_learn_nothing() -> None:
    s = tuple(d for d in IDS if d != VICTIM)
    clients, adverts, inputs, masked, consents, sigs = _round(s)
    assert clients[VICTIM].left_out  # it signed S without itself, as a witness
    held_b = [clients[d]._held[VICTIM][0] for d in COLLUDERS]  # the colluders hand over what they hold of the victim
    for count in (len(IDS), len(IDS), len(s)):  # the victim listed among the survivors; asked again, with S's count
        try:
            answer = clients[VICTIM].unmask(_ask(VICTIM, (VICTIM, *s), (), count, consents, sigs))
            held_b.append(dict(answer.b_shares).get(VICTIM, b""))
        except SecAggError:
            pass  # refused: nothing of it reaches the adversary
    honest = {d: clients[d].unmask(_ask(d, s, (VICTIM,), len(s), consents, sigs)) for d in s if d not in COLLUDERS}
    s_shares = [dict(a.s_shares)[VICTIM] for a in honest.values()] + [clients[d]._held[VICTIM][1] for d in COLLUDERS]
    s_v = _combine(s_shares[:PARAMS.threshold])
    assert keys.public_from_private(s_v) == adverts[VICTIM].s_pk  # the adversary holds the victim's mask key: only b_v lacks
    own = [b for b in held_b if b]
    if len({shamir.decode_share(b)[0] for b in own}) >= PARAMS.threshold:  # t shares of b_v: rebuild it, unmask v
        recovered = _unmask_alone(_combine(own), s_v, masked[VICTIM], adverts, s)
        assert not np.array_equal(recovered, inputs[VICTIM]), "the victim's input was recovered on its own"
    assert len(own) == PARAMS.threshold - 1  # the colluders' shares only
    with pytest.raises(ValueError):  # fewer than t shares: b_v cannot be rebuilt
        _combine(own)


def test_the_same_device_in_the_set_it_signed_answers() -> None:
    """The control: the refusal above is the witness's doing (here the victim is in the set shown to everyone)."""
    clients, _, _, _, consents, sigs = _round(IDS)
    answer = clients[VICTIM].unmask(_ask(VICTIM, IDS, (), len(IDS), consents, sigs))
    assert dict(answer.b_shares)[VICTIM]  # its own share of b_v, as every survivor reveals it


@pytest.mark.parametrize("count", [len(IDS) + 1, 0xFFFFFFFF])
def test_a_survivor_count_other_than_the_signed_sets_is_refused(count: int) -> None:
    """The count is the coordinator's bare word, unsigned: a device takes it only as the size of the set it signed."""
    clients, _, _, _, consents, sigs = _round(IDS)
    with pytest.raises(SecAggError, match=f"survivor count {count}, not the {len(IDS)}"):
        clients[VICTIM].unmask(_ask(VICTIM, IDS, (), count, consents, sigs))
    with pytest.raises(SecAggError, match="refused an earlier message"):  # nothing revealed on a second try either
        clients[VICTIM].unmask(_ask(VICTIM, IDS, (), len(IDS), consents, sigs))
