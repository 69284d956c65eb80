"""The binary layout of the stage messages (messages.py): round trips, and every malformed input refused
with a SecAggError (a ValueError) that names the field."""

from __future__ import annotations

import numpy as np
import pytest

from flayer.secagg import (
    KeyAdvert,
    KeyBundle,
    MaskedInput,
    SecAggError,
    ShareBatch,
    UnmaskRequest,
    UnmaskShares,
    _wire,
    decode_message,
)
from flayer.secagg.shamir import SHARE_LEN


@pytest.fixture
def messages(staged):
    r = staged(count=5)
    r.advertise()
    r.share()
    r.mask()
    request = r.server.unmask_request("dev-00")
    return {
        "advert": r.adverts["dev-00"],
        "bundle": r.bundles["dev-00"],
        "batch": r.batches["dev-00"],
        "routed": r.routed["dev-00"],
        "masked": r.masked["dev-00"],
        "request": request,
        "answer": r.clients["dev-00"].unmask(request),
    }


def same(a, b) -> bool:
    if isinstance(a, MaskedInput):
        return a.round == b.round and a.device == b.device and np.array_equal(a.vector, b.vector)
    return a == b


@pytest.mark.parametrize("name", ["advert", "bundle", "batch", "routed", "masked", "request", "answer"])
def test_every_message_round_trips(messages, name):
    msg = messages[name]
    raw = msg.to_bytes()
    assert raw[:4] == b"FLSA" and raw[4] == 1
    assert same(decode_message(raw), msg)
    assert same(type(msg).from_bytes(raw), msg)


def test_sizes_are_what_the_layout_says(messages):
    # a channel key per neighbour (k = 4); u16 0 signatures (no long-term keys in this round); u16 0 certificate bytes
    assert len(messages["advert"].to_bytes()) == 10 + 7 + 96 + 2 + 3 * 32 + 2 + 2
    assert len(messages["masked"].to_bytes()) == 10 + 7 + 1 + 4 + 4 * 16  # 1: the ring width
    assert len(messages["batch"].to_bytes()) == 10 + 7 + 2 + 1 + 4 * (7 + 7 + 164)  # 1: the signed flag (unsigned)
    assert len(messages["answer"].to_bytes()) == 10 + 7 + 2 + 5 * (7 + SHARE_LEN) + 2 + 2  # + 2: no pair seeds


@pytest.mark.parametrize("name", ["advert", "bundle", "batch", "masked", "request", "answer"])
def test_every_truncation_and_any_trailing_byte_is_refused(messages, name):
    raw = messages[name].to_bytes()
    for cut in range(len(raw)):
        with pytest.raises(SecAggError, match="truncated|shorter than its header"):
            decode_message(raw[:cut])
    with pytest.raises(SecAggError, match="1 unexpected trailing bytes"):
        decode_message(raw + b"\x00")


@pytest.mark.parametrize("name", ["advert", "bundle", "batch", "masked", "request", "answer"])
def test_mutated_bytes_decode_or_raise_secagg_error_only(messages, name):
    raw = messages[name].to_bytes()
    rng = np.random.default_rng(0)
    for i in range(len(raw)) if len(raw) < 400 else rng.integers(0, len(raw), 400):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(raw)
            bad[i] ^= flip
            try:
                decode_message(bytes(bad))
            except SecAggError:
                pass
    for size in (0, 1, 9, 10, 50, 500):
        try:
            decode_message(rng.bytes(size))
        except SecAggError:
            pass


def test_header_fields_are_named(messages):
    raw = messages["advert"].to_bytes()
    with pytest.raises(SecAggError, match="bad magic"):
        decode_message(b"XXXX" + raw[4:])
    with pytest.raises(SecAggError, match="unsupported version 2"):
        decode_message(raw[:4] + b"\x02" + raw[5:])
    with pytest.raises(SecAggError, match="unknown kind 12"):
        decode_message(raw[:5] + b"\x0c" + raw[6:])
    with pytest.raises(SecAggError, match="kind 1 is not 4"):
        MaskedInput.from_bytes(raw)
    with pytest.raises(SecAggError, match="expected bytes"):
        KeyAdvert.from_bytes("text")  # type: ignore[arg-type]


def test_bad_ids_counts_and_lengths_are_named(messages):
    advert = messages["advert"].to_bytes()
    with pytest.raises(SecAggError, match="device 'dev/00' must be 1-64 characters"):
        decode_message(advert.replace(b"dev-00", b"dev/00"))
    with pytest.raises(SecAggError, match="device is not ASCII"):
        decode_message(advert.replace(b"dev-00", "dév0".encode()))
    empty = advert[:10] + b"\x00" + advert[17:]
    with pytest.raises(SecAggError, match="device '' must be"):
        decode_message(empty)
    bundle = messages["bundle"].to_bytes()
    with pytest.raises(SecAggError, match="advert count 60000 exceeds the limit 1025"):
        decode_message(bundle[:17] + (60000).to_bytes(2, "little") + bundle[19:])
    masked = messages["masked"].to_bytes()
    with pytest.raises(SecAggError, match="length 0 outside"):
        decode_message(masked[:18] + bytes(4) + masked[22:])
    with pytest.raises(SecAggError, match="length 4294967295 outside"):
        decode_message(masked[:18] + b"\xff" * 4 + masked[22:])
    for width in (0, 1, 33, 255):  # the ring's width byte
        with pytest.raises(SecAggError, match=f"bits {width} outside"):
            decode_message(masked[:17] + bytes([width]) + masked[18:])
    with pytest.raises(SecAggError, match="32 unexpected trailing bytes"):  # 16 values of 32 bits read at 16
        decode_message(masked[:17] + bytes([16]) + masked[18:])


def test_an_oversized_message_is_refused_before_it_is_parsed(messages, monkeypatch):
    assert len(messages["masked"].to_bytes()) == 86 and len(messages["advert"].to_bytes()) == 215
    monkeypatch.setattr(_wire, "MAX_MESSAGE", 210)
    with pytest.raises(SecAggError, match="215 bytes exceed any message"):
        decode_message(messages["advert"].to_bytes())
    decode_message(messages["masked"].to_bytes())


def test_messages_refuse_bad_fields_when_built(messages):
    answer = messages["answer"]
    with pytest.raises(SecAggError, match=r"reveals both shares of \['dev-01'\]"):
        UnmaskShares(1, "dev-00", answer.b_shares, ((answer.b_shares[1][0], answer.b_shares[1][1]),))
    with pytest.raises(SecAggError, match="duplicate device"):
        UnmaskRequest(1, "dev-00", 5, ("dev-00", "dev-00"), ())
    with pytest.raises(SecAggError, match="c_pk must be 32 bytes"):
        KeyAdvert(1, "dev-00", b"short", bytes(32))
    with pytest.raises(SecAggError, match="duplicate"):
        ShareBatch(1, "dev-00", messages["batch"].shares[:1] * 2)
    with pytest.raises(SecAggError, match="KeyAdverts of the bundle's round"):
        KeyBundle(2, "dev-00", messages["bundle"].adverts)
    with pytest.raises(SecAggError, match="1-D uint32"):
        MaskedInput(1, "dev-00", np.zeros(3, np.float32))
    with pytest.raises(SecAggError, match="round"):
        MaskedInput(-1, "dev-00", np.zeros(3, np.uint32))


def test_signed_adverts_and_bundle_entries_round_trip_and_bad_signature_fields_are_named():
    from flayer.secagg import (
        LocalIdentities,
        RingSpec,
        SecAggClient,
        SecAggParams,
        SecAggServer,
        SeededEntropy,
        ServerConsistency,
    )

    ids = tuple(f"dev-{i:02d}" for i in range(4))
    params = SecAggParams("fed.1.ab", 1, ids, 3, 3, bytes(32), 8, RingSpec.for_summands(1.0, 4))
    who = LocalIdentities(ids, SeededEntropy(bytes(32)))
    server = SecAggServer(params, ServerConsistency(who.verify))
    adverts = [SecAggClient(params, d, SeededEntropy(bytes([i]) * 32), who.for_device(d)).advertise()
               for i, d in enumerate(ids)]
    for a in adverts:
        server.receive_advert(a)
    advert, bundle = adverts[0], server.key_bundle(ids[0])
    assert len(advert.signatures) == 3 and all(len(a.signatures) == 1 for a in bundle.adverts)
    raw = advert.to_bytes()
    assert len(raw) == 10 + 7 + 96 + 2 + 2 * 32 + 2 + 3 * 64 + 2 and decode_message(raw) == advert
    assert decode_message(bundle.to_bytes()) == bundle
    assert len(bundle.to_bytes()) == 10 + 7 + 2 + 3 * (7 + 96 + 2 + 2 + 64 + 2)  # an entry: its one signature
    with pytest.raises(SecAggError, match="truncated at KeyAdvert signature 2"):
        decode_message(raw[:-3])
    with pytest.raises(SecAggError, match="KeyAdvert signatures 1026 exceeds the limit 1025"):
        decode_message(raw[:-(2 + 3 * 64 + 2)] + (1026).to_bytes(2, "little"))
    with pytest.raises(SecAggError, match="KeyAdvert cert length 4097 exceeds the limit 4096"):
        decode_message(raw[:-2] + (4097).to_bytes(2, "little"))
    with pytest.raises(SecAggError, match="KeyAdvert signature must be 64 bytes"):
        KeyAdvert(1, "dev-00", advert.c_pk, advert.s_pk, advert.b_commit, (), (b"x" * 63,))
    with pytest.raises(SecAggError, match="more than its owner's one signature"):
        KeyBundle(1, ids[0], (advert,))
