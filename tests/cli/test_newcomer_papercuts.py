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
