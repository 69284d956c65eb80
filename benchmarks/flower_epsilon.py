"""The epsilon Flower's DP wrapper reports for given settings, computed by Flower's own code.

Runs in an environment of its own holding ``flwr[dp]`` (not this project's: it imports nothing of
FLAYER). For each ``N:m:rounds:z`` it builds ``DifferentialPrivacyServerSideFixedClipping`` around
``FedAvg`` with Flower's ``RdpAccountant`` (add-or-remove-one neighbours, ``no-amplification``: the only
sampling its fixed-clipping wrappers accept), then walks the wrapper's own accounting path round by
round (the hooks its ``configure_train`` and ``aggregate_train`` call: prepare the round's event with
``m`` sampled replies, compose it once the aggregate is released), and prints what
``privacy_spent()`` then states::

    python -m venv /tmp/flwr && /tmp/flwr/bin/pip install "flwr[dp]"
    /tmp/flwr/bin/python benchmarks/flower_epsilon.py --delta 1e-5 100:20:10:1.8985 100:20:10:3.42
"""

from __future__ import annotations

import argparse
import json


def flower_epsilon(population: int, cohort: int, rounds: int, z: float, delta: float, clip: float = 0.1) -> float:
    from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    config = PrivacyConfig(target_delta=delta, population_size=population,
                           neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                           sampling_method=SamplingMethod.NO_AMPLIFICATION)
    wrapper = DifferentialPrivacyServerSideFixedClipping(FedAvg(), noise_multiplier=z, clipping_norm=clip,
                                                         num_sampled_clients=cohort,
                                                         accountant=RdpAccountant(config))
    for r in range(1, rounds + 1):
        wrapper._prepare_accounting(r, [object()] * cohort)  # the round's m sampled replies
        wrapper._compose_release(wrapper._pop_pending_event(r))  # the aggregate released
    spent = wrapper.privacy_spent()
    assert spent is not None and spent.num_releases == rounds
    return float(spent.epsilon)


def main() -> int:
    import flwr

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("settings", nargs="+", metavar="N:m:rounds:z")
    p.add_argument("--delta", type=float, default=1e-5)
    a = p.parse_args()
    for s in a.settings:
        n, m, t, z = s.split(":")
        eps = flower_epsilon(int(n), int(m), int(t), float(z), a.delta)
        print(json.dumps({"flwr": flwr.__version__, "population": int(n), "cohort": int(m), "rounds": int(t),
                          "z": float(z), "delta": a.delta, "epsilon": eps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
