"""docs/hooks.py is not a package module: load it as ``docs_hook`` for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "docs" / "hooks.py"
_spec = importlib.util.spec_from_file_location("docs_hook", _path)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
sys.modules["docs_hook"] = _module
_spec.loader.exec_module(_module)
