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
    assert "epsilon 1.235 spent so far at delta 1e-05" in unmasked
    gone = closing_notes({"secure_survivors": ["a"], "secure_abandoned": "1 survivor < t = 2", "epsilon": "inf",
                          "delta": 1e-5})
    assert "secure round abandoned (1 survivor < t = 2), nothing unmasked" in gone and "epsilon inf" in gone
