"""Colluding devices that withhold their consents cannot make the coordinator reread its round journal
(docs/explanation/secure-aggregation.md, "The consent stage": the coordinator keeps only the running sum, O(model)).

The adversary is d colluding devices of a secure round of n: each runs the protocol as an honest device does up to
its masked input -- key advert, shares, masked input, each accepted and journaled by the coordinator -- and then
never answers the ConsentRequest. When the consent stage closes, the coordinator must take each withheld input back
out of the running sum, reading it back from the round's journal. The coordinator's real parts run: its secure round
(coordinator.secure_round.SecureRound, with the recall coordinator.secure_phase installs), the round's journal opened
and appended as coordinator.open_round.OpenRound does, real devices' protocol (flayer.secagg.SecAggClient).

Before the defence each withheld consent read and authenticated the whole journal -- every device's masked input --
once: d x n records read and ~2n model vectors held on the coordinator's worker thread. The guarantee measured here
is the bytes the coordinator's process reads while the stage closes (the kernel's count, /proc/self/io: any way of
reading the file counts): about d records, not d x n; and the sum the survivors unmask is still exactly theirs.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from coordinator.intake import Verdict
from coordinator.journal import journal_path
from coordinator.open_round import OpenRound
from coordinator.secure_phase import journaled_masked
from coordinator.secure_round import SecureRound
from flayer.engine.secure import PlannedSecure, device_vector, round_params
from flayer.engine.secure_layout import layout_of
from flayer.privacy_config import PrivacySettings
from flayer.secagg import LocalIdentities, MaskedInput, SecAggClient, SeededEntropy, decode_message
from flayer.update import TensorDelta, Update

N = 16  # devices of the round
COLLUDERS = ("dev-03", "dev-07", "dev-11", "dev-15")  # d = 4: masked input sent, consent withheld
LENGTH = 20_000  # coordinates of the model: a record is ~80 KB, far above any other read of the process
IO = Path("/proc/self/io")

pytestmark = pytest.mark.skipif(not IO.exists(), reason="needs the kernel's per-process read count (/proc/self/io)")


def _read_bytes() -> int:
    return int(next(line.split()[1] for line in IO.read_text().splitlines() if line.startswith("rchar:")))


def _update(seed: int) -> Update:
    rng = np.random.default_rng(seed)
    return Update({"w": TensorDelta((LENGTH,), rng.normal(0, 0.01, LENGTH).astype(np.float32))}, 10)


def _deliver(out: list[tuple[str, bytes]]) -> dict[str, object]:
    return {d: decode_message(b) for d, b in out}


def test_withheld_consents_read_back_about_d_records_not_the_whole_journal_d_times(tmp_path: Path) -> None:
    ids = tuple(f"dev-{i:02d}" for i in range(N))
    ups = {d: _update(i) for i, d in enumerate(ids)}
    lay = layout_of(ups[ids[0]])
    params, _ = round_params(PrivacySettings(secure_aggregation=True), "fed.1.x", 1, ids, lay, 0)
    keys = LocalIdentities(ids, SeededEntropy(bytes(32)))
    sec = SecureRound(PlannedSecure(params, lay.digest, False, 5.0), lay, stage_end=105.0, verify=keys.verify)
    devices = {d: SecAggClient(params, d, consistency=keys.for_device(d)) for d in ids}
    # the coordinator's open round: its journal opened and appended as OpenRound does, its recall as SecurePhase's
    rnd = types.SimpleNamespace(number=1, secure=sec, accepted=set(), timer=None, journal=None, journal_dir=None)
    OpenRound.open_journal(rnd, tmp_path / "journal")  # type: ignore[arg-type]
    sec.recall = lambda devs: journaled_masked(rnd, devs)  # type: ignore[arg-type]
    sec.server = sec._new_server()

    for d in ids:
        assert sec.receive(d, devices[d].advertise().to_bytes()) is None
    bundles = _deliver(sec.advance(101.0))
    for d in ids:
        assert sec.receive(d, devices[d].share_keys(bundles[d]).to_bytes()) is None
    shares = _deliver(sec.advance(101.0))
    masked: dict[str, np.ndarray] = {}
    for d in ids:  # every device, colluders too, sends its masked input; each is accepted and journaled
        blob = devices[d].masked_input(shares[d], device_vector(ups[d], lay, params, np.random.default_rng(0))) \
            .to_bytes()
        assert sec.masked(d, blob) is None
        OpenRound.accept(rnd, d, 1, blob, Verdict("accepted"), 101.5)  # type: ignore[arg-type]
        msg = decode_message(blob)
        assert isinstance(msg, MaskedInput)
        masked[d] = msg.vector
    assert sec.server.consent is not None and sec.server.consent._inputs is None  # only the running sum in memory
    record = journal_path(tmp_path / "journal", 1).stat().st_size / N
    asks = _deliver(sec.advance(102.0, masked_done=True))
    honest = [d for d in ids if d not in COLLUDERS]
    for d in honest:  # the colluders never answer their ConsentRequest
        assert sec.receive(d, devices[d].consent(asks[d]).to_bytes()) is None

    before = _read_bytes()
    sets = _deliver(sec.advance(108.0))  # the consent stage's time is up: the withheld inputs leave the sum
    read = _read_bytes() - before
    assert sec.stage == 5 and all(m.survivors == tuple(honest) for m in sets.values())
    d = len(COLLUDERS)
    # before the defence: d x n records (~5 MB here); now d records and what authenticating them costs
    assert read <= 2 * d * record, f"{read} bytes read back for {d} withheld consents of {N} ({record:.0f} B a record)"
    running = sec.server._sum.copy()
    assert np.array_equal(running, np.sum([masked[h] for h in honest], axis=0, dtype=np.uint32))  # exactly theirs

    for dev in ids:
        sec.receive(dev, devices[dev].sign_survivors(sets[dev]).to_bytes())
    requests = _deliver(sec.advance(108.0))
    assert set(requests) == set(honest) and all(r.dropped == COLLUDERS for r in requests.values())
    for dev, req in requests.items():
        assert sec.receive(dev, devices[dev].unmask(req).to_bytes()) is None
    out = sec.finish()
    assert out.reason is None and out.survivors == tuple(honest) and out.dropped == COLLUDERS
    plain = sum(ups[h].deltas["w"].values.astype(np.float64) for h in honest)
    assert out.update is not None
    assert np.abs(out.update.deltas["w"].values - plain).max() < N / sec.planned.params.ring.scale
    assert rnd.journal is not None
    rnd.journal.close()
