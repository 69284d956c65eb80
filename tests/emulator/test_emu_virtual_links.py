"""``flayer emulate --virtual`` honours what crosses the links and refuses what does not apply: the value
codec sizes the uploads, link-fitted uploads reach the round a plain fp32 upload misses, delta downloads
shrink the downloads, asynchronous "auto" settings are resolved for the fleet as the emulator resolves
them; flags of the other mode are refused with the mode they need, config keys it does not simulate are
named in a warning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from emulator.thinsim import ThinLinks, ThinOptions
from emulator.availability import device_timeline
from emulator.options import federation_table, load_emulate_config
from emulator.profiles import DeviceProfile
from emulator.virtual import FleetTiming, run_virtual
from flayer.config import TrainConfig
from flayer.engine import initial_global_state
from flayer.partition import make_partition
from flayer.strategies import make_strategy
from flayer.train import client_data

FAST = DeviceProfile("fast", slowdown=1.0, up_mbps=50.0, down_mbps=50.0)
THIN = DeviceProfile("thin", slowdown=1.0, up_mbps=5.0, down_mbps=50.0, up_latency_ms=300.0)
PROFILES = [FAST] * 4 + [THIN] * 2


@pytest.fixture(scope="module")
def fleet(digits):  # type: ignore[no-untyped-def]
    part = make_partition(digits.y, digits.num_classes, 6, "iid", 0)
    clients = [client_data(digits, c) for c in part.clients]
    strategy = make_strategy("fedavg", digits.model_spec(None), TrainConfig(lr=0.05, batch_size=10, local_epochs=1))
    return strategy, clients


def _run(fleet, opts: ThinOptions, rounds: int = 3, **kw):  # type: ignore[no-untyped-def]
    strategy, clients = fleet
    ids = [f"dev-{i}" for i in range(len(clients))]
    base = {"mode": "sync", "quorum": 3, "over_selection": 2.0, "min_devices": 3, "deadline_s": 20.0,
            "grace_s": 0.5, "sample_cost_s": 0.001}
    timing = FleetTiming(**{**base, **kw})  # type: ignore[arg-type]
    timelines = [device_timeline(p, 0, d) for p, d in zip(PROFILES, ids)]
    links = ThinLinks(opts, initial_global_state(strategy, 0))
    return run_virtual(strategy, clients, PROFILES, ids, timelines, rounds, 0, timing, links=links)


def _per_update(res, name: str) -> float:  # type: ignore[no-untyped-def]
    c = res.profiles[name]
    return c["bytes_up"] / (c["trained"] - c.get("lost", 0))


def test_the_value_codec_sizes_the_uploads(fleet) -> None:  # type: ignore[no-untyped-def]
    fp32, int8 = _run(fleet, ThinOptions()), _run(fleet, ThinOptions(value_codec="int8"))
    assert _per_update(int8, "fast") < 0.4 * _per_update(fp32, "fast")
    assert int8.profiles["fast"]["accepted"] > 0


def test_fitted_uploads_reach_the_round_a_plain_upload_misses(fleet) -> None:  # type: ignore[no-untyped-def]
    plain = _run(fleet, ThinOptions(), uplink_kbps=5000.0)
    fitted = _run(fleet, ThinOptions(fit=True, error_feedback=True), uplink_kbps=5000.0)
    assert plain.profiles["thin"].get("accepted", 0) == 0 and plain.profiles["thin"]["late"] > 0
    assert fitted.profiles["thin"].get("accepted", 0) > 0  # fitted to the plans' expected close
    assert _per_update(fitted, "thin") < 0.5 * _per_update(plain, "thin")


def test_delta_downloads_shrink_the_downloads(fleet) -> None:  # type: ignore[no-untyped-def]
    full, delta = _run(fleet, ThinOptions()), _run(fleet, ThinOptions(delta_downloads="int8"))
    down = {k: sum(c["bytes_down"] for c in r.profiles.values()) for k, r in (("full", full), ("delta", delta))}
    # round 1 moves the whole model to every device, rounds 2 and 3 int8 deltas (about a quarter of it)
    assert down["delta"] < 0.65 * down["full"]


def test_async_auto_settings_are_resolved_for_the_fleet() -> None:
    cfg = load_emulate_config(None, {"data": {"dataset": "digits", "clients": 5},
                                     "federation": {"mode": "async", "buffer": 2, "concurrency": 0,
                                                    "quorum": 2, "min_devices": 2}})
    fed = federation_table(cfg, 5)
    # concurrency 0 is the whole fleet: ceil(24 x 5 / 2), not the fleet-blind ceil(24 x ceil(1.3 x 2) / 2) = 36
    assert fed["max_staleness"] == 60 and fed["concurrency"] == 0


CONFIG = ("[run]\nstrategy = \"fedavg\"\nrounds = 2\nseed = 0\n[data]\ndataset = \"digits\"\npartition = \"iid\"\n"
          "clients = 5\n[train]\nlr = 0.05\n[federation]\nquorum = 2\nmin_devices = 2\n"
          "[emulator]\nmix = \"jetson-orin=0.6,flaky-field=0.4\"\n")


def test_flags_of_the_other_mode_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    cfg = tmp_path / "fleet.toml"
    cfg.write_text(CONFIG)
    out = str(tmp_path / "out")
    # without --virtual (and a fleet too big to start, so nothing runs whatever the check)
    assert main(["emulate", "--config", str(cfg), "--budget", "100", "--min-devices", "99", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "--budget applies to --virtual only" in err
    assert main(["emulate", "--config", str(cfg), "--sample-cost", "0.001", "--min-devices", "99",
                 "--out", out]) == 2
    assert "--sample-cost applies to --virtual only" in capsys.readouterr().err
    for flag in (["--workers", "2"], ["--dashboard"], ["--shard", "1/2"], ["--timeout", "60"]):
        assert main(["emulate", "--config", str(cfg), "--virtual", "--sample-cost", "0.001", *flag,
                     "--out", out]) == 2, flag
        err = capsys.readouterr().err
        assert f"{flag[0]} does not apply to --virtual" in err and "without --virtual" in err, err


def test_config_keys_it_does_not_simulate_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    cfg = tmp_path / "fleet.toml"
    cfg.write_text(CONFIG + "workers = 2\n[edge]\nheartbeat_s = 5.0\nupload = \"fit\"\nerror_feedback = true\n")
    out = tmp_path / "out"
    assert main(["emulate", "--config", str(cfg), "--virtual", "--sample-cost", "0.001", "--value-codec", "int8",
                 "--delta-downloads", "int8", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "--virtual does not simulate [emulator] workers, [edge] heartbeat_s" in err
    links = json.loads((out / "summary.json").read_text())["links"]
    assert links["value_codec"] == "int8" and links["fit"] and links["error_feedback"]
    assert links["delta_downloads"] == "int8"


def test_a_device_far_behind_downloads_the_model_when_the_deltas_cost_more() -> None:
    """ThinLinks counts what a device fetches as the device does (edge_client.delta_fetch, rule 4): the walk
    of chain deltas from the model it holds, or the full model when that walk is not smaller."""
    import torch

    gen = torch.Generator().manual_seed(0)
    model = {"w": torch.zeros(64, 64)}
    links = ThinLinks(ThinOptions(delta_downloads="exact"), model)
    links.download(0, 0)  # clients 0 and 1 hold the initial model
    links.download(0, 1)
    state, sizes = model, []
    for r in range(1, 6):  # a third of the weights change each version: each delta about 0.4 of the model
        change = torch.randn(64, 64, generator=gen) * (torch.rand(64, 64, generator=gen) < 0.3)
        state = links.publish(r, state, {"w": state["w"] + change})
        sizes.append(links.chain.links[-1].blob.size)
        if r == 2:
            assert links.download(r, 1) == sum(sizes)  # two versions behind: the deltas cost less than the model
    assert len(links.chain.links) == 5 and sum(sizes) > links.model.size > sizes[0] + sizes[1]
    assert links.download(6, 0) == links.model.size  # five versions behind: the model, not five deltas
    assert links.download(6, 1) == sum(sizes[2:]) < links.model.size  # three behind: still the deltas


def test_an_unmeasured_fitted_link_sends_the_lowest_codec_as_a_device_does() -> None:
    """edge_client.thin.ThinUploads: before its first measured upload a fitting device sends with the plan's
    lowest codec, all of its coordinates; the simulated links do the same (else --virtual's first uploads
    were fp32 and late where the real fleet's were int8)."""
    import numpy as np

    from flayer.update import TensorDelta, Update

    update = Update({"w": TensorDelta((64,), np.linspace(-1, 1, 64).astype(np.float32))}, 10)
    links = ThinLinks(ThinOptions(fit=True), {"w": __import__("torch").zeros(64)})
    _, blind = links.upload(1, 0, update, 0, unmeasured=True)
    assert links.last_fit.codec == "int8" and links.last_fit.keep == 1.0
    _, plain = links.upload(1, 0, update, 0)  # no budget, link measured elsewhere: nothing fitted
    assert links.last_fit.codec == "fp32" and blind < plain
