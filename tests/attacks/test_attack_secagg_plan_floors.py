"""A coordinator that writes a secure round's plan below what the devices would choose (docs/explanation/
secure-aggregation.md, "Dropouts, threshold and neighbours").

The adversary is the coordinator: it writes and signs the plan, chooses the cohort and the run seed, and holds one
or two colluding devices. Its moves:

* **k = 2 at P = 100.** A plan stating two neighbours a device (and t = 2, the majority floor of k = 2): the
  victim's shares are held by its two neighbours alone, so two colluders placed either side of it (a few hundred
  run seeds tried) hold t shares of both its secrets and read its input in an otherwise honest round. On the code
  before, the device took k from the plan and checked only t against the floor of that k.
* **A two-device cohort.** A plan selecting only the victim and one colluder (k = 1, t = 2, T = 2): whatever the
  protocol does, the sum minus the colluder's input is the victim's input.

Now each device computes k and t itself, with the function the coordinator chooses them by
(:func:`flayer.engine.secure_plan.round_degree`), from the cohort's size, the plan's dropout and the colluding
fraction, and refuses a cohort below :data:`~flayer.engine.secure_plan.MIN_COHORT` (two honest inputs in any sum
beside the colluders assumed), a k below its own, and a t below the majority floor of the plan's k. Over Mosquitto,
a real edge client sent such a plan sends no key advert (the honest plan after it: an advert).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from flayer.engine.secure import graph_seed_of, round_ring, secure_from_plan
from flayer.secagg import KeyAdvert, decode_message
from mqtt_broker import mosquitto_available
from protocol import Plan, Topics, decode_envelope, encode_message

FED, RUN_SEED = "itest", 7
T = Topics(FED)


def _plan(cohort: tuple[str, ...], degree: int, threshold: int, round_: int = 1) -> dict[str, Any]:
    """The ``secure`` mapping the coordinator writes, every key a device reads, with the k and t it chose."""
    return {"session": f"{FED}.{round_}.ab", "threshold": threshold, "degree": degree,
            "graph_seed": graph_seed_of(RUN_SEED, round_).hex(), "length": 8,
            "bits": round_ring(1.0, len(cohort), 16).bits, "value_bits": 16, "layout": "ab" * 32, "adaptive": False,
            "stage_s": 10.0, "noise_std": 0.0, "bound": 1.0, "value_range": 1.0, "corrupt_fraction": 0.0,
            "run_seed": RUN_SEED, "keep": 1.0, "dropout": 0.1}


COHORT = tuple(f"dev-{i:03d}" for i in range(100))


def test_a_plan_with_two_neighbours_a_device_at_100_devices_is_refused() -> None:
    assert secure_from_plan(_plan(COHORT, 34, 18), 1, COHORT) is not None  # what the coordinator's rule gives
    victim = COHORT[50]
    try:
        planned = secure_from_plan(_plan(COHORT, 2, 2), 1, COHORT)
    except ValueError as exc:
        assert "k=2 neighbours, below the 34" in str(exc)
        planned = None
    if planned is not None:  # the victim's two neighbours are all its holders: t of both its secrets
        near = planned.params.neighbours(victim)
        assert len(near) < planned.params.threshold, f"two colluders {sorted(near)} either side of {victim} hold t"
    assert planned is None, "a device took a plan with k = 2 at P = 100"


def test_a_plan_of_the_victim_and_one_colluder_is_refused() -> None:
    pair = ("dev-000", "dev-001")  # the victim and the coordinator's device
    with pytest.raises(ValueError, match="secure round over 2 devices"):
        secure_from_plan(_plan(pair, 1, 2), 1, pair)
    three = ("dev-000", "dev-001", "dev-002")  # the least cohort: two honest inputs beside one colluder
    assert secure_from_plan(_plan(three, 2, 2), 1, three) is not None


def test_a_lower_threshold_than_the_plans_k_gives_is_still_refused() -> None:
    with pytest.raises(ValueError, match="below the floor 19"):
        secure_from_plan(_plan(COHORT, 36, 18), 1, COHORT)  # a larger k is more holders, t must follow it


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")
@pytest.mark.timeout(120)
def test_a_real_device_sends_no_keys_on_a_plan_below_its_floors(tmp_path: Path, attack_fed: Any,
                                                                digits_shard: Any) -> None:
    """The coordinator signs and publishes each plan on the round topic; dev-000 answers a plan it accepts with its key
    advert on ``secagg/dev-000``, and sends nothing on one below its floors."""
    fed = attack_fed(["dev-000", "dev-001", "dev-002"], view="coordinator", federation=FED)
    shard = digits_shard(0)
    coord = fed.listen([T.all_secagg()])
    client = EdgeClient(EdgeSettings(state_dir=str(tmp_path / "dev-000"), client_index=0, device="cpu",
                                     heartbeat_s=2.0), fed.devices["dev-000"], shard)
    client.start()

    def publish(round_: int, cohort: tuple[str, ...], degree: int, threshold: int) -> Any:
        plan = Plan(round_, cohort, time.time() + 600, "fedavg", {}, {"name": "mlp"}, "ab" * 32, 1, 100,
                    seed=RUN_SEED, secure=_plan(cohort, degree, threshold, round_))
        payload = encode_message(plan, FED, "coordinator", key=fed.coordinator.signer())
        assert coord.link.wait_published([coord.link.publish(T.round(), payload, retain=True)], 5)

        def advert(m: Any) -> bool:
            env = decode_envelope(m.payload)
            return m.topic == T.secagg("dev-000") and env.round == round_ and \
                isinstance(decode_message(env.body), KeyAdvert)

        return coord.wait_message(advert, 6)

    try:
        big = ("dev-000", *(f"dev-{i:03d}" for i in range(3, 102)))
        assert publish(1, big, 2, 2) is None, "dev-000 sent its keys for a plan with k = 2 at P = 100"
        assert publish(2, ("dev-000", "dev-001"), 1, 2) is None, "dev-000 sent its keys for a two-device cohort"
        assert publish(3, ("dev-000", "dev-001", "dev-002"), 2, 2) is not None  # the least cohort: it takes part
    finally:
        client.stop()
        coord.close()
