"""An acknowledged update is never lost (docs/explanation/guarantees.md, "No acknowledged update is lost").

The adversary is a crash at the worst moment: the coordinator process (``flayer coordinator``, a real
process on a real Mosquitto with persistence, devices ``flayer edge`` processes) is killed with SIGKILL the
instant the first device has seen an ``accepted`` ack of round 1 -- the ack is out, the round is not closed,
nothing after the ack had a chance to run. It is restarted over the same folder. The guarantee holds when
every update any device saw acknowledged is in the journal exactly once, every round folded exactly what
its journal holds, and the final model is the journals' fold (the fault suite's accounting,
``tests/faults/faultlib.py``). Slow: real processes, two rounds and a restart.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mqtt_broker import mosquitto_available

_TESTS = Path(__file__).resolve().parent.parent
for _sub in ("integration", "mqtt_broker", "faults"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / _sub))

from faultlib import accounting, check_accounting, fold_journals, max_diff, proc_federation

DEVICES = ["dev-0", "dev-1", "dev-2"]


@pytest.mark.slow
@pytest.mark.timeout(480)  # the run itself may take 240 s to finish; a lost update then fails there, named
@pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")
def test_a_coordinator_killed_right_after_an_ack_loses_no_acknowledged_update(tmp_path: Path, digits: Any) -> None:
    fed = proc_federation(tmp_path, digits, DEVICES, rounds=2)
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        deadline = time.monotonic() + 180
        acked: list[str] = []
        while time.monotonic() < deadline and not acked:
            acked = [d for d in DEVICES if any(r == 1 and s == "accepted" for r, s in fed.device_acks(d))]
            time.sleep(0.02)
        assert acked, "no device saw an ack of round 1"
        fed.coordinator.kill9()
        open_at_kill = 1 not in fed.closed_rounds()
        fed.start_coordinator()
        fed.wait_all(240)
        acc = accounting(fed)
        assert {(d, 1) for d in acked} <= acc.acked
        check_accounting(acc, fed.rounds)  # every acked update journaled once, every round folded its journal
        assert max_diff(fed.final_state(), fold_journals(fed, fed.make_strategy(digits))) == 0.0
        assert set(acc.journaled) == {(d, r) for d in DEVICES for r in (1, 2)}  # and the run completed
        print(f"killed with round 1 {'open' if open_at_kill else 'already closed'}; acked then: {acked}")
    finally:
        fed.stop()
