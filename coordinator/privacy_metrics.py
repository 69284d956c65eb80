"""The coordinator's privacy gauges for Prometheus (docs/reference/metrics.md, "Prometheus"; rule 5 of
:mod:`coordinator.exporter`). Every epsilon names its adversary and the participation schema it assumes, as the
run's closing lines and ``flayer status`` do (docs/explanation/privacy.md, "Who learns what"):

- ``flayer_privacy_epsilon{schema}``: against readers of the published models and plans, devices and broker
  observers; ``flayer_privacy_epsilon_coordinator{schema}``: against the coordinator (+Inf where it sees the
  updates, or their sum, before the noise). ``schema`` is ``every round`` or ``at most k rounds, b apart``
  (:meth:`flayer.privacy_config.ParticipationSchema.short`), read from each round's record; when it changes, the
  old series goes, so a scrape never shows a figure under a schema it no longer assumes.
- ``flayer_device_epsilon{stat, against}``: the devices' own figures; ``against`` is what a device's ledger
  books in the federation's mode (:data:`DEVICE_AGAINST`, edge_client.budget): ``models`` in central mode (the
  coordinator sees the clipped update and is trusted to add the noise), ``coordinator`` in local mode (the
  device's own noise share covers it against every party, the coordinator included).

The gauges appear with the first private round record or device ledger: a run without privacy exports none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from flayer.privacy_config import ParticipationSchema

__all__ = ["DEVICE_AGAINST", "PrivacyGauges"]

DEVICE_AGAINST = {"central": "models", "local": "coordinator"}


def _value(eps: Any) -> float:
    """A record's epsilon as a gauge value: "inf" (JSON has no infinity) or missing is +Inf."""
    return math.inf if eps is None or eps == "inf" else float(eps)


class PrivacyGauges:
    """The privacy gauges of one registry (module docstring), fed on the coordinator's worker thread."""

    def __init__(self, registry: CollectorRegistry, mode: str = "central") -> None:
        self.registry = registry
        self.against = DEVICE_AGAINST.get(mode, "models")
        self.schema: str | None = None  # the schema label the epsilon gauges carry now
        self._g: dict[str, Gauge] = {}

    def round_closed(self, record: Mapping[str, Any]) -> None:
        """A closed round's record: its epsilon against each adversary, under the schema it names (nothing for a
        round without privacy)."""
        eps = record.get("epsilon")
        if eps is None or record.get("delta") is None:
            return
        g = self._gauges()
        schema = ParticipationSchema.of_record(record).short()
        if self.schema is not None and self.schema != schema:  # one series: the schema the figures assume now
            for name in ("epsilon", "epsilon_coordinator"):
                g[name].remove(self.schema)
        self.schema = schema
        g["epsilon"].labels(schema).set(_value(eps))
        g["epsilon_coordinator"].labels(schema).set(_value(record.get("epsilon_coordinator")))
        g["delta"].set(float(record["delta"]))

    def devices(self, dp: Mapping[str, Any]) -> None:
        """:func:`coordinator.device_privacy.device_privacy`'s summary of the devices' ledgers."""
        g = self._gauges()
        for stat in ("min", "median", "max"):
            g["device"].labels(stat, self.against).set(math.nan if dp[stat] is None else _value(dp[stat]))
        g["at_budget"].set(dp["at_budget"])
        g["counting"].set(dp["devices"])

    def _gauges(self) -> dict[str, Gauge]:
        if not self._g:
            r = self.registry
            self._g = {
                "epsilon": Gauge("flayer_privacy_epsilon", "Epsilon spent after the latest closed round, at "
                                 "flayer_privacy_delta, against readers of the models and plans, devices and broker "
                                 "observers, for a device in the rounds `schema` names (+Inf: no noise)", ["schema"],
                                 registry=r),
                "epsilon_coordinator": Gauge("flayer_privacy_epsilon_coordinator", "Epsilon spent after the latest "
                                             "closed round, at flayer_privacy_delta, against the coordinator, for a "
                                             "device in the rounds `schema` names (+Inf: it sees the updates or "
                                             "their sum before the noise, no guarantee)", ["schema"], registry=r),
                "delta": Gauge("flayer_privacy_delta", "The delta the federation's epsilon is counted at",
                               registry=r),
                "device": Gauge("flayer_device_epsilon", "The devices' own epsilon (q = 1, over the private rounds "
                                "each contributed to) as their statuses report it: min, median, max; `against`: "
                                "models (central mode: readers of the models, the coordinator trusted) or "
                                "coordinator (local mode: every party, the coordinator included)", ["stat", "against"],
                                registry=r),
                "at_budget": Gauge("flayer_devices_at_budget", "Devices whose next contribution would pass their "
                                   "own privacy budget (they refuse private rounds)", registry=r),
                "counting": Gauge("flayer_devices_counting_privacy", "Devices whose status reports a privacy "
                                  "ledger", registry=r)}
        return self._g
