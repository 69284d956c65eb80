"""What a newcomer meets first: the flags' defaults as ``--help`` states them, the device's and the
coordinator's lines of a secure or private round, the generated config reference and the model flag."""

from __future__ import annotations

from cli.main import main


def test_emulate_min_devices_defaults_to_the_quorum(capsys):
    """``--help`` says --min-devices defaults to the quorum: a quorum above 1 with no --min-devices is valid."""
    assert main(["emulate", "--clients", "4", "--quorum", "3", "--dp", "central", "--dp-plan"]) == 0
    assert "fixed denominator m = 3" in capsys.readouterr().out


def test_emulate_min_devices_below_the_quorum_is_still_refused(capsys):
    assert main(["emulate", "--clients", "4", "--quorum", "3", "--min-devices", "2", "--dp", "central",
                 "--dp-plan"]) == 2
    assert "min_devices (2) must be >= quorum (3)" in capsys.readouterr().err


def test_emulate_config_takes_the_quorum_as_min_devices():
    from emulator.options import federation_table, load_emulate_config

    cfg = load_emulate_config(None, {"data": {"clients": 4}, "federation": {"quorum": 3}})
    assert federation_table(cfg, 4)["min_devices"] == 3


def test_a_secure_device_prints_the_masked_bytes_it_sent_not_zero(capsys):
    from cli.edge import _show

    _show("trained", {"round": 3, "bytes": 0, "acc": 0.5, "secure": True})
    _show("sent", {"round": 3, "bytes": 223_740, "secure": True})
    out = capsys.readouterr().out
    assert "0.00 MB" not in out and "round 3: sent 0.22 MB (the masked update of a secure round)" in out


def test_the_coordinators_round_line_says_unmasked_or_abandoned_and_the_epsilon():
    from coordinator.round_log import closing_notes

    assert closing_notes({"accepted": 4}) == ""
    unmasked = closing_notes({"secure_survivors": ["a", "b", "c"], "secure_dropped": ["d"], "secure_abandoned": None,
                              "epsilon": 1.23456, "delta": 1e-5})
    assert "secure round unmasked: the sum of 3 masked inputs only, 1 device(s) dropped out" in unmasked
    assert "epsilon 1.235 spent so far at delta 1e-05 against readers of the published models" in unmasked
    assert "inf against the coordinator" in unmasked
    gone = closing_notes({"secure_survivors": ["a"], "secure_abandoned": "1 survivor < t = 2", "epsilon": "inf",
                          "delta": 1e-5})
    assert "secure round abandoned (1 survivor < t = 2), nothing unmasked" in gone and "epsilon inf" in gone


def test_the_config_reference_has_every_model_key_with_the_type_the_files_write():
    """Every key ``[model]``'s loader reads (its own pops and the spec's fields) is in the generated reference,
    ``args`` a table and ``classes`` a list, as the tutorials write them and the loader takes them."""
    import inspect
    import re

    from cli.configdoc import config_reference, config_files
    from coordinator.config import model_spec_from_table

    md = config_reference(config_files())
    section = md.split("### federation.toml `[model]`")[1].split("\n## ")[0].split("\n### ")[0]
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M)}
    own = set(re.findall(r'fields\.pop\("(\w+)"', inspect.getsource(model_spec_from_table)))
    assert own == {"initial_model", "python_path"} and own <= set(rows), rows
    assert rows["python_path"] == "list of string" and rows["args"] == "table" and rows["classes"] == "list of string"


def test_model_flag_takes_an_entry_point_as_the_registry_does(tmp_path, monkeypatch, capsys):
    (tmp_path / "papercut_tiny.py").write_text(
        "from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Flatten(), nn.Linear(256, 10))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["simulate", "--dataset", "digits", "--clients", "2", "--samples", "200", "--rounds", "1",
                 "--strategy", "fedavg", "--model", "papercut_tiny:build", "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run").is_dir()


def test_model_flag_refuses_what_is_neither_a_builtin_nor_an_entry_point(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--model", "resnet 18"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model" in err and "an entry point package.module:function, got 'resnet 18'" in err
