"""The privacy flags and the places epsilon is shown: ``flayer simulate --dp-plan`` (numbers from the accountant),
a private ``flayer simulate`` (records, summary, the stop at target_epsilon), refusals with the reason,
``flayer emulate``'s federation.toml carrying [privacy], and ``flayer status`` / the dashboard's fleet view."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from flayer.engine.accountant import epsilon_for, noise_for_target, rounds_for_target
from protocol.metrics_schema import read_metrics

COMMON = ["--dataset", "digits", "--clients", "10", "--rounds", "3", "--seed", "1", "--threads", "1",
          "--samples", "300", "--join-ratio", "0.5"]


def test_dp_plan_prints_the_accountants_numbers(capsys):
    assert main(["simulate", *COMMON, "--dp", "central", "--dp-noise", "1.1", "--target-epsilon", "5",
                 "--rounds", "20", "--dp-plan"]) == 0
    out = capsys.readouterr().out
    delta = 1e-5  # min(1e-5, 1/(10 N))
    assert f"delta = {delta:.3g}" in out and "q = 1" in out  # the cohort is public: no amplification
    assert (f"epsilon {epsilon_for([(1.1, 1.0, 20)], delta):.4g} after 20 rounds for a device in every round (no "
            f"max_participations), against readers of the published models, devices and broker observers") in out
    assert "epsilon against the coordinator, for a device in every round (no max_participations): infinite" in out
    assert f"need z >= {noise_for_target(5.0, delta, 1.0, 20):.3f}" in out
    assert f"allows {rounds_for_target(5.0, delta, 1.0, 1.1)} rounds" in out
    assert "warning: population N = 10" in out  # too small for a useful guarantee, said at plan time
    assert "not offered by this release, for comparison only" in out
    assert f"Poisson sampling at q = 0.5 would give {epsilon_for([(1.1, 0.5, 20)], delta):.4g}" in out


def test_the_default_clip_is_the_measured_one(capsys, tmp_path):
    """Without --dp-clip or [privacy] clip, C is 0.3: the value docs/results/privacy.md measured best of
    0.03, 0.1, 0.3 and 1 (C = 1 diverged at every epsilon there); the plan, the config and the help agree."""
    from flayer.privacy_config import PrivacySettings

    assert PrivacySettings().clip == 0.3
    assert main(["simulate", *COMMON, "--dp", "central", "--dp-noise", "1.9", "--dp-plan"]) == 0
    assert "C = 0.3," in capsys.readouterr().out
    cfg = tmp_path / "run.toml"
    cfg.write_text("[privacy]\nenabled = true\nnoise_multiplier = 1.9\n")
    assert main(["simulate", "--config", str(cfg), *COMMON, "--dp-plan"]) == 0
    assert "C = 0.3," in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    assert "upload (0.3)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, needle", [
    (["--dp", "central", "--dp-delta", "0.2"], "delta must be in (0, 1/N)"),
    (["--dp", "central", "--dp-clip", "0"], "clip (C) must be"),
    (["--dp", "local", "--dp-noise", "0", "--target-epsilon", "2"], "target_epsilon needs noise"),
    (["--dp", "central", "--set", "flayer.positions=topk"], "positions = \"topk\""),
    (["--dp", "central", "--keep", "0.5"], "--keep < 1"),
    (["--dp", "central", "--max-participations", "0"], "max_participations must be an integer >= 1"),
    (["--dp", "central", "--min-separation", "-2"], "min_separation must be an integer"),
    (["--max-participations", "2"], "they need --dp"),
])
def test_private_simulate_refuses_what_it_cannot_honour(tmp_path, capsys, flags, needle):
    assert main(["simulate", *COMMON, *flags, "--out", str(tmp_path / "x")]) == 2
    assert needle in capsys.readouterr().err


def test_private_simulate_records_epsilon_and_stops_at_the_target(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", *COMMON, "--rounds", "6", "--dp", "central", "--dp-noise", "2.0",
                 "--target-epsilon", "4", "--strategy", "fedavg", "--out", str(out)]) == 0
    q, delta = 1.0, 1e-5
    expected = rounds_for_target(4, delta, q, 2.0)
    assert 1 <= expected < 6
    recs = read_metrics(out / "metrics.jsonl")
    rounds = [r for r in recs if r["kind"] == "round"]
    assert [r["epsilon"] for r in rounds] == pytest.approx([epsilon_for([(2.0, q, t)], delta)
                                                            for t in range(1, expected + 1)])
    assert recs[-1]["kind"] == "end" and recs[-1]["epsilon"] == pytest.approx(rounds[-1]["epsilon"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(rounds[-1]["epsilon"]) and "target_epsilon 4" in summary["budget_stop"]
    assert summary["epsilon_coordinator"] == "inf" and summary["dp_noise"] == "csprng"
    captured = capsys.readouterr()
    text = captured.out
    assert (f"privacy: epsilon {rounds[-1]['epsilon']:.4g} at delta 1e-05 after {expected} rounds for a device in "
            f"every round (no max_participations), against readers") in text
    assert "epsilon infinite against the coordinator" in text and f"round {expected + 1} would bring" in text
    assert "NOT PRIVATE" not in text
    assert "warning: privacy: population N = 10" in captured.err  # said before the run, too


def test_emulate_writes_privacy_into_the_coordinators_config(tmp_path):
    from coordinator.config import load_coordinator_config
    from emulator.options import load_emulate_config
    from emulator.setup import write_federation_toml

    cfg = load_emulate_config(None, {"data": {"dataset": "digits", "clients": 8},
                                     "privacy": {"enabled": True, "noise_multiplier": 0.7, "mode": "local"}})
    path = write_federation_toml(tmp_path / "federation.toml", {"quorum": 2, "min_devices": 2}, cfg.run,
                                 tmp_path / "creds.toml", tmp_path / "state")
    dp = load_coordinator_config(path).run.privacy
    assert dp.enabled and dp.mode == "local" and dp.noise_multiplier == 0.7 and dp.population == 8


@pytest.mark.parametrize("flag", [["--dp", "central"], ["--secure-agg"]])
def test_emulate_virtual_refuses_private_and_secure_rounds(capsys, flag):
    assert main(["emulate", "--dataset", "digits", "--clients", "4", "--virtual", *flag]) == 2
    assert "--virtual does not run private or secure rounds" in capsys.readouterr().err


def test_status_and_the_fleet_view_show_epsilon():
    from cli.status import render
    from coordinator.dashboard.fleet import FleetView
    from protocol.metrics_schema import round_record

    view = FleetView()
    view.on_record(round_record("coordinator", 10.0, round=4, wall_s=1.0, selected=["a"],
                                devices=[{"id": "a", "result": "accepted", "acc": 0.5}], refused={}, bytes_up=1,
                                bytes_down=1, acc=0.5, train_loss=1.0, closed="quorum", epsilon=1.2345, delta=1e-3))
    snap = view.snapshot(11.0)
    assert snap["last_round"]["epsilon"] == 1.2345
    snap["source"] = {"federation": "f", "broker": "b", "metrics": "m.jsonl", "metrics_error": None}
    line = render(snap)
    assert "privacy: epsilon 1.234 spent at delta 0.001 after round 4 against readers of the published models" in line
    assert "inf against the coordinator" in line  # central mode: no figure against it, said so
    assert "for a device in every round (no max_participations)" in line  # the schema it assumes
    view.on_record(round_record("coordinator", 12.0, round=5, wall_s=1.0, selected=["a"],
                                devices=[{"id": "a", "result": "accepted", "acc": 0.5}], refused={}, bytes_up=1,
                                bytes_down=1, acc=0.5, train_loss=1.0, closed="quorum", epsilon=0.9, delta=1e-3,
                                dp_max_participations=2, dp_min_separation=3))
    snap = {**view.snapshot(13.0), "source": snap["source"]}
    assert "for a device in at most 2 rounds, 3 rounds apart (the participation schema)" in render(snap)


def test_a_schema_no_accountant_takes_prints_as_every_round_like_the_record_reader():
    """A record's schema fields that are not a schema (junk from a hand-edited or foreign metrics file) print the
    schema the epsilon beside them was composed for: every round, in the one wording the records' reader uses."""
    from cli.privacy import schema_text
    from flayer.privacy_config import ParticipationSchema

    every = ParticipationSchema().describe()
    for most, gap in ((None, 0), ("three", 0), (0, 0), (3, "y"), (-1, 2)):
        assert schema_text(most, gap) == every == ParticipationSchema.of_record(
            {"dp_max_participations": most, "dp_min_separation": gap}).describe()
    assert schema_text(3, 2) == "a device in at most 3 rounds, 2 rounds apart (the participation schema)"


def test_seeded_noise_is_asked_for_and_labelled_not_private(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        assert main(["simulate", *COMMON, "--rounds", "1", "--dp", "central", "--dp-noise", "2.0", "--strategy",
                     "fedavg", "--dp-seeded-noise", "--out", str(tmp_path / name)]) == 0
        runs.append(json.loads((tmp_path / name / "summary.json").read_text()))
    assert all(r["dp_noise"] == "seeded: not private" for r in runs)
    assert runs[0]["final_personal_acc"] == runs[1]["final_personal_acc"]  # reproducible: the point of the flag
    assert "NOT PRIVATE: --dp-seeded-noise drew the noise from seed 1" in capsys.readouterr().out


def test_dp_plan_composes_the_participation_schema(capsys):
    """With --max-participations k the accountant composes k rounds, not R, and every epsilon names the schema."""
    assert main(["simulate", *COMMON, "--dp", "central", "--dp-noise", "1.1", "--target-epsilon", "5",
                 "--rounds", "20", "--max-participations", "3", "--min-separation", "2", "--dp-plan"]) == 0
    out = capsys.readouterr().out
    delta, who = 1e-5, "a device in at most 3 rounds, 2 rounds apart (the participation schema)"
    assert (f"epsilon {epsilon_for([(1.1, 1.0, 3)], delta):.4g} after 20 rounds for {who}, against readers of the "
            f"published models, devices and broker observers") in out
    assert f"without it, a device in every round: {epsilon_for([(1.1, 1.0, 20)], delta):.4g}" in out
    assert f"target epsilon 5 for {who}: 20 rounds need z >= {noise_for_target(5.0, delta, 1.0, 3):.3f}" in out
    assert noise_for_target(5.0, delta, 1.0, 20, most=3) == noise_for_target(5.0, delta, 1.0, 3)


def test_private_simulate_selects_by_the_schema_and_says_so(tmp_path, capsys):
    """max_participations 1 over 10 clients, 5 a round: two disjoint cohorts, then nobody; epsilon of one round."""
    out = tmp_path / "run"
    assert main(["simulate", *COMMON, "--strategy", "fedavg", "--dp", "central", "--dp-noise", "1.0",
                 "--dp-delta", "1e-3", "--max-participations", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rounds = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "round"]
    assert [len(r["selected"]) for r in rounds] == [5, 5]
    assert not set(rounds[0]["selected"]) & set(rounds[1]["selected"])
    assert "participation schema: no client may take part in round 3" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(epsilon_for([(1.0, 1.0, 1)], 1e-3))
    assert f"epsilon {summary['epsilon']:.4g} at delta 0.001 after 2 rounds for a device in at most 1 round" in text
