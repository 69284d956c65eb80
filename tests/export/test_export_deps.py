"""A missing optional dependency gives one clear error naming the extra to install."""

from __future__ import annotations

import sys

import pytest

from cli.main import main
from export.deps import MissingDependency, require, require_executorch, require_onnx


@pytest.mark.parametrize("module,extra,call", [
    ("onnxruntime", "export", require_onnx),
    ("onnxscript", "export", require_onnx),
    ("onnx", "export", require_onnx),
    ("executorch", "executorch", require_executorch),
])
def test_missing_module_names_the_extra(monkeypatch, module, extra, call):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(MissingDependency) as info:
        call()
    msg = str(info.value)
    assert f"'{module}'" in msg
    assert f"pip install 'flayer-edge[{extra}]'" in msg
    assert info.value.extra == extra and info.value.module == module


def test_unknown_extra_is_an_error():
    with pytest.raises(ValueError, match="unknown extra"):
        require("nope", "x")


@pytest.mark.parametrize("fmt,module,extra", [
    ("onnx", "onnxruntime", "export"),
    ("all", "onnxscript", "export"),
    ("pte", "executorch", "executorch"),
])
def test_cli_exits_with_one_line_naming_the_extra(monkeypatch, tmp_path, capsys, fmt, module, extra):
    monkeypatch.setitem(sys.modules, module, None)
    rc = main(["export", "--state", str(tmp_path / "missing.safetensors"), "--format", fmt,
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1
    assert err[0].startswith("flayer export: error:")
    assert f"pip install 'flayer-edge[{extra}]'" in err[0]
    assert not (tmp_path / "out").exists()


def test_cli_training_program_needs_executorch(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "executorch", None)
    rc = main(["export", "--state", str(tmp_path / "m.safetensors"), "--format", "onnx", "--training-program",
               "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "flayer-edge[executorch]" in capsys.readouterr().err
