"""The round engine: written once, driven by the in-process simulator (``flayer.simulation``), the
virtual-clock fleet (``emulator.virtual``) and the MQTT coordinator.

- :mod:`.selection` -- who trains (PFLlib's join ratio, over-selection, asynchronous slots);
- :mod:`.calibration` -- round 0 for strategies that configure themselves from the clients' data;
- :mod:`.client_step` -- the client's share of a round, the same on an edge device;
- :mod:`.gate` -- the one validity gate and the admission policy (norm bound, weight cap, staleness);
- :mod:`.round` -- the open round's aggregate, its tally and the round record;
- :mod:`.versions` -- asynchronous buffered rounds: model versions, staleness and slots.
"""

from .calibration import CalibrationError, calibrate, resolve_calibration
from .client_step import ClientEval, client_round
from .gate import STALENESS_RULES, Bounds, Verdict, admit, check, refuse, scale_update, staleness_weight
from .round import OpenAggregate, RoundRecord, RoundTally, initial_global_state
from .selection import assign_slots, draw, select_clients, select_devices
from .versions import AsyncSettings, VersionWindow, expected_close, screen

__all__ = [
    "STALENESS_RULES",
    "AsyncSettings",
    "Bounds",
    "CalibrationError",
    "ClientEval",
    "OpenAggregate",
    "RoundRecord",
    "RoundTally",
    "Verdict",
    "VersionWindow",
    "admit",
    "assign_slots",
    "calibrate",
    "check",
    "client_round",
    "draw",
    "expected_close",
    "initial_global_state",
    "refuse",
    "resolve_calibration",
    "scale_update",
    "screen",
    "select_clients",
    "select_devices",
    "staleness_weight",
]
