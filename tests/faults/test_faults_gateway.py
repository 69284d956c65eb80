"""Field gateway under faults: the coordinator on the central Mosquitto, the devices on a site Mosquitto
bridged to it (mqtt_broker.bridge), everything a real process. The bridge's link is cut in the middle
of a model chunk and in the middle of an update chunk, and the site broker is restarted while the
link is down and the devices' updates wait in its queue; every run is checked by journal accounting
(every update a device saw acknowledged is journaled exactly once, each round folded what its
journal holds) and by comparing the final model with an uninterrupted run of the same seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from faultlib import (
    FEDERATION,
    accounting,
    check_accounting,
    fold_journals,
    max_diff,
    reference_run,
    wait_until,
)
from gatewaylib import GatewayFederation, gateway_federation

from mqtt_broker import mosquitto_available

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]
DEVICES = ["dev-0", "dev-1", "dev-2"]
MODEL = f"fl/{FEDERATION}/model/".encode()
UPDATE = f"fl/{FEDERATION}/update/".encode()


def _check(fed: GatewayFederation, ds: Any) -> tuple[int, int]:
    acc = accounting(fed)
    check_accounting(acc, fed.rounds)
    assert set(acc.journaled) == {(d, r) for d in fed.devices for r in range(1, fed.rounds + 1)}
    assert acc.acked == set(acc.journaled), "a device never saw its update acknowledged"
    strategy = fed.make_strategy(ds)
    final = fed.final_state()
    assert max_diff(final, fold_journals(fed, strategy)) == 0.0
    worst = max_diff(final, reference_run(fed, ds, strategy, len(fed.devices)))
    print(f"max |bridged run - uninterrupted direct run| = {worst:.3g}")
    assert worst <= 1e-6
    return len(acc.acked), acc.aggregated


def test_federation_over_a_bridged_site_matches_the_direct_run(tmp_path: Path, digits: Any) -> None:
    fed = gateway_federation(tmp_path, digits, DEVICES, rounds=3, proxy=False)
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        fed.wait_all(240)
        _check(fed, digits)
    finally:
        fed.stop()


def test_bridge_cut_mid_download_mid_upload_and_site_restart_keep_exactly_once(
    tmp_path: Path, digits: Any, faults_ledger: Any
) -> None:
    fed = gateway_federation(tmp_path, digits, DEVICES, rounds=4)
    bh = fed.backhaul
    assert bh is not None and fed.site is not None
    try:
        # round 1: the bridge's link dies 200 bytes into the first model chunk
        bh.cut_on("down", MODEL, 200)
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        assert bh.fired.wait(120), f"no model chunk crossed the bridge\n{fed.logs()}"
        # then 200 bytes into the next update chunk going up
        bh.cut_on("up", UPDATE, 200)
        assert bh.fired.wait(120), f"no update chunk crossed the bridge\n{fed.logs()}"
        # a later round: the link dies as the first update chunk goes up and stays down; the devices hand
        # their updates to the site broker, which is restarted (SIGTERM: it saves its queue) before the
        # link comes back
        wait_until(lambda: 2 in fed.closed_rounds(), 180, "round 2 to close", fed.logs)
        r = max(fed.closed_rounds()) + 1
        assert r <= fed.rounds
        bh.cut_on("up", UPDATE, 0, hold=True)
        assert bh.fired.wait(120), f"no round-{r} update reached the bridge\n{fed.logs()}"
        try:
            wait_until(lambda: all(f"round {r}: trained" in fed.procs[d].text() for d in DEVICES), 30,
                       f"every device's round-{r} update")
        except AssertionError:
            pass  # a device still downloading when the link died trains once it is back
        queued = sum(f"round {r}: trained" in fed.procs[d].text() for d in DEVICES)
        print(f"round {r}: {queued} update(s) handed to the site broker while the link was down")
        assert queued >= 1
        fed.restart_site()
        bh.release()
        fed.wait_all(300)
        assert [c[0] for c in bh.cuts] == ["down", "up", "up"]
        acked, aggregated = _check(fed, digits)
        faults_ledger.fault("field gateway: bridge cut mid-model, mid-update, site broker restarted", 3, True,
                            acked, aggregated)
    finally:
        fed.stop()
