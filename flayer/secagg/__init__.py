"""Secure aggregation (SecAgg / SecAgg+) of aligned sparse updates: the coordinator learns only their sum.

In a private round every device uploads values at the same positions (drawn from the round's public
seed), so the uploads are aligned uint32 vectors of one length n (each layer's values at the common
positions, concatenated in a fixed order). This package is the pure core -- no network, threads or
clocks; deterministic given the entropy passed in -- of the protocol of Bonawitz et al., "Practical
Secure Aggregation for Privacy-Preserving Machine Learning" (CCS 2017, arXiv:1611.04482), run over
the sparse neighbour graph of Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead" (CCS 2020, "SecAgg+").

**Protocol** (per round; k = a device's neighbour count, t = the threshold; :class:`SecAggParams`):

1. *Advertise keys*: each device u makes two X25519 pairs, c_u (encryption) and s_u (masks), and sends
   both public keys. The coordinator gives each device its neighbours' adverts.
2. *Share keys*: u draws a self-mask seed b_u, Shamir-splits b_u and s_u^SK t-of-(k+1), and sends each
   neighbour v its two shares sealed with ChaCha20-Poly1305 under a key from KA(c_u, c_v); the
   coordinator routes them.
3. *Masked input*: u sends ``y_u = x_u + PRG(b_u) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv) mod 2^bits``
   over the neighbours v whose shares reached it, s_uv = HKDF(KA(s_u, s_v)).
4. *Consent* (with the consistency round, :mod:`.msg_consent`): each device whose masked input arrived signs its
   consent (having booked the round); the survivors are those with a masked input and a consent, and a neighbour
   reveals a share of b_u only for a u whose consent it verifies. *Consistency* (optional, :mod:`.consistency`):
   each survivor signs the whole survivor set it is shown.
5. *Unmask*: the coordinator names the survivors (sent y) and the dropped (shared keys, sent no y);
   each survivor returns its share of b_v for surviving and of s_v^SK for dropped neighbours,
   never both for one v. The coordinator rebuilds each survivor's b_u and each dropped device's
   s_v^SK (>= t shares each), removes PRG(b_u) and the dropped devices' pairwise masks, and is left
   with ``sum_{u in survivors} x_u``.

**Threat model.** The coordinator relays every message and is *honest but curious*: it follows the
protocol and tries to learn single updates from what it sees. It then learns only the survivors' sum:
it holds no share unless devices reveal one, and devices reveal a b-share and an s-share of one device
never both (the coordinator also refuses, in code, to rebuild both secrets of one device). Devices
colluding with it learn nothing beyond the sum of the honest survivors' inputs as long as fewer than
t of any honest device's k+1 share holders collude and the honest survivors' graph stays connected:
in the complete graph any t-1 colluding devices; in a sparse graph a fraction gamma of colluders
within the failure budget of :func:`neighbour_count` (its ``corrupt_fraction``). t >= 2 always,
and the default rule takes t a strict majority of the k+1 holders. An *active* coordinator that tells different devices different survivor sets is caught by the consistency round
(:mod:`.consistency`, with a :class:`DeviceConsistency`): every survivor signs the whole survivor set with its
long-term key, and a device unmasks only with T = floor((P + c)/2) + 1 signatures over the set it signed (c =
max(1, ceil(gamma P)) colluders assumed), so all honest devices that answer saw one set. With the same long-term
keys each device signs its keys toward each neighbour (:mod:`.signed_adverts`, Bonawitz's active variant), and
checks every key the coordinator relays against the federation's registry before it seals a share: a coordinator
that swaps public keys in the bundles is refused. Devices also check t against a floor they compute, the
graph seed and the survivor list. A false share is caught: b_u is checked
against the commitment in u's advert, s_u against its public key, every share beyond t against the
rebuilt polynomial and skipped when off it. Named (``SecAggServer.faulty``): a device whose share of its own
secret is off, or whose shares agree on a secret other than the one it advertised -- only when the shares
determine the polynomial (2e <= m - t: getting it wrong takes more than (m - t)/2 false shares) -- and a device
advertising a low-order, shared or repeated key; never a holder for a share of another's secret (a dealer could
have sealed it that share).
Device authentication rides on the broker: each device publishes only under its own credentials and
ACL, so the coordinator knows which device sent which message; the sealed shares' associated data
binds (session, round, sender, receiver, stage) against replay, forgery and misaddressing.

**Dropout tolerance.** The round finishes if at least t devices remain at every stage, every survivor
keeps t responsive share holders (itself and its neighbours) and every dropped device t responsive
neighbours; otherwise it ends with :class:`SecAggAbandoned` and a reason. Masks cancel within each
connected part of the survivors' graph, so the coordinator also abandons a round whose survivors'
graph is split (each part's sum would be exposed). :func:`neighbour_count` picks k = O(log n) and t
so that a dropout rate delta is survived with failure probability <= 2^-20 per round (rule in
:mod:`flayer.secagg.graph`); n <= 8 uses the complete graph.

**Ring** (:mod:`flayer.secagg.ring`). Values are clipped to [-C, C], scaled by s and rounded
stochastically (unbiased; nearest without an rng) to integers mod 2^bits (bits <= 32). With
:meth:`RingSpec.for_summands` s is the largest power of two with ``max_summands * ceil(C s) <=
2^(bits-1) - 1``, so the sum never wraps; :meth:`RingSpec.for_bound` instead fixes s from a resolution
and takes the ring only as wide as the sum of ``max_summands`` such values needs (plus a margin bit).
The masks are the low ``bits`` bits of the PRG's words and the masked input travels packed at ``bits``
bits a value (:mod:`flayer.secagg.packing`). The error per coordinate and summand is below 1/s, so a
decoded sum of m inputs is within m/s of the sum of the clipped values.

**Cost per device** (k neighbours, n coordinates): 4 messages up (advert, shares, masked input,
unmask shares) and 3 down (bundle, shares, unmask request); per neighbour its own channel key in the
advert (32 B), one advert in the bundle (id + 96 B), a sealed share each way (2 ids + 164 B) and one
revealed share (id + 68 B), about 570 B with 6-character ids, plus n bits / 8 B for the masked input:
O(k + n) bytes and O(k n) PRG work, never n times the participants. The coordinator: O(N k) routing and
O((survivors + k * dropped) n) PRG work. The consistency round adds one message each way and O(N) bytes
and signature checks per device (the survivor set, T signatures); the consent stage two messages (about 100 B)
and up to k consents in the unmask request (73 B each with 8-character ids); the signed adverts 128 B and two signature
operations per neighbour (k signed, k checked), and N k checks at the coordinator.

Entry points: :class:`SecAggClient` (device), :class:`SecAggServer` (coordinator),
:func:`run_round` (all in process), :func:`encode` / :func:`decode_sum` (the ring).
"""

from __future__ import annotations

from .client import SecAggClient
from .consistency import DeviceConsistency, LocalIdentities, ServerConsistency, consistency_threshold
from .errors import SecAggAbandoned, SecAggError
from .graph import neighbour_count, neighbour_graph
from .local import DROP_POINTS, RoundOutcome, run_round
from .messages import (
    Consent,
    ConsentRequest,
    ConsistencyRequest,
    EncryptedShare,
    KeyAdvert,
    KeyBundle,
    MaskedInput,
    Message,
    ShareBatch,
    ShareComplaint,
    SurvivorSignature,
    UnmaskRequest,
    UnmaskShares,
    decode_message,
)
from .params import SecAggParams
from .prg import SeededEntropy, expand
from .ring import RingSpec, decode_sum, encode
from .server import SecAggServer

__all__ = [
    "DROP_POINTS",
    "Consent",
    "ConsentRequest",
    "ConsistencyRequest",
    "DeviceConsistency",
    "EncryptedShare",
    "KeyAdvert",
    "KeyBundle",
    "LocalIdentities",
    "MaskedInput",
    "Message",
    "RingSpec",
    "RoundOutcome",
    "SecAggAbandoned",
    "SecAggClient",
    "SecAggError",
    "SecAggParams",
    "SecAggServer",
    "SeededEntropy",
    "ServerConsistency",
    "ShareBatch",
    "ShareComplaint",
    "SurvivorSignature",
    "UnmaskRequest",
    "UnmaskShares",
    "consistency_threshold",
    "decode_message",
    "decode_sum",
    "encode",
    "expand",
    "neighbour_count",
    "neighbour_graph",
    "run_round",
]
