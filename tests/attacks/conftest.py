"""Attack tests: each guarantee the documentation states, attacked as the adversary would, with only what
the adversary holds. The federation and broker helpers are reused from their folders (fedtestlib)."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
for _sub in ("integration", "mqtt_broker"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / _sub))
