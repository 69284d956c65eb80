"""Edge client pieces without a broker: device.toml, state on disk, the local round and its size check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.publish import model_blob
from edge_client.config import load_device_config
from edge_client.store import DeviceStore, StoredState, UploadRecord
from edge_client.work import (
    EdgeError,
    EntryPointRefused,
    StrategyCache,
    UpdateTooLarge,
    check_data_fits,
    check_entry_point,
    decode_global,
    round_context,
    train_and_encode,
)
from flayer.config import ConfigError
from flayer.engine import client_round, initial_global_state
from flayer.partition import make_partition
from flayer.strategies.base import ClientState
from flayer.train import client_data
from protocol import Plan, UpdateHeader, WireLimits, decode_update


@pytest.fixture(scope="module")
def shard(digits):  # type: ignore[no-untyped-def]
    part = make_partition(digits.y, digits.num_classes, 3, "iid", 0)
    return client_data(digits, part.clients[1])


def _plan(spec_dict: dict, digest: str, **kw: object) -> Plan:
    args: dict[str, object] = dict(round=2, selected=("dev-1",), deadline=1e9, strategy="fedavg", options={},
                                   model=spec_dict, model_digest=digest, model_chunks=1, model_size=1, seed=3,
                                   train={"lr": 0.05, "batch_size": 10, "local_epochs": 1})
    args.update(kw)
    return Plan(**args)  # type: ignore[arg-type]


def test_device_config(tmp_path: Path) -> None:
    p = tmp_path / "device.toml"
    p.write_text('credentials = "creds/dev-1.toml"\n[data]\ndataset = "digits"\npartition_file = "p.npz"\n'
                 'client = 2\n[edge]\nstate_dir = "s"\nretries = 3\n')
    cfg = load_device_config(p, {"edge": {"device": "cpu"}})
    assert cfg.credentials == tmp_path / "creds/dev-1.toml"
    assert (cfg.data.client, cfg.edge.client_index, cfg.edge.retries, cfg.edge.device) == (2, 2, 3, "cpu")
    assert cfg.data.partition_file == str(tmp_path / "p.npz") and cfg.edge.state_dir == str(tmp_path / "s")
    for bad, words in [("retries = 3", "retries = -1"), ("client = 2", "client = 'x'"), ("[edge]", "[edg]")]:
        p.write_text(p.read_text().replace(bad, words))
        with pytest.raises(ConfigError):
            load_device_config(p)
        p.write_text(p.read_text().replace(words, bad))
    p.write_text('[data]\ndataset = "digits"\n')
    with pytest.raises(ConfigError, match="credentials"):
        load_device_config(p)


def test_store_round_trip(tmp_path: Path) -> None:
    store = DeviceStore(tmp_path / "dev")
    assert store.load().state is None and store.load().done_round == 0
    state = ClientState({"personal.fc.weight": torch.randn(2, 3)}, {"acc_val": 0.75})
    store.save_upload(b"upload bytes")
    import hashlib

    rec = UploadRecord(4, hashlib.sha256(b"upload bytes").hexdigest(), 12)
    store.save(StoredState(state, 4, rec))
    got = store.load()
    assert got.done_round == 4 and got.upload == rec and not got.upload.settled
    assert got.state is not None and got.state.scalars == {"acc_val": 0.75}
    assert torch.equal(got.state.tensors["personal.fc.weight"], state.tensors["personal.fc.weight"])
    assert store.load_upload(rec) == b"upload bytes"
    assert store.load_upload(dataclasses.replace(rec, digest="00" * 32)) is None


def test_local_round_is_the_simulators(digits, shard) -> None:  # type: ignore[no-untyped-def]
    spec = digits.model_spec()
    cache = StrategyCache({"device": "cpu"})
    strategy = cache.get(_plan(dataclasses.asdict(spec), "ab" * 32))
    assert cache.get(_plan(dataclasses.asdict(spec), "cd" * 32)) is strategy  # same run settings: reused
    g = initial_global_state(strategy, 3)
    mb = model_blob(g)
    plan = _plan(dataclasses.asdict(spec), mb.digest)
    decoded = decode_global(mb.blob, strategy, WireLimits())
    assert all(torch.equal(decoded[k], g[k]) for k in g)
    ctx = round_context(plan, 1, torch.device("cpu"))
    up = train_and_encode(strategy, plan, decoded, strategy.initial_state(), shard, ctx, federation="fed",
                          sender="dev-1", max_payload=4096, max_update_bytes=0, amp=True)
    assert all(len(p) <= 4096 for p in up.payloads) and len(up.payloads) > 1
    _, direct = client_round(strategy, g, strategy.initial_state(), shard, ctx)
    assert direct is not None
    got = decode_update(up.blob, WireLimits(), expect=UpdateHeader("fed", 2, "dev-1", mb.digest)).update
    for k, d in direct.update.deltas.items():
        np.testing.assert_array_equal(got.deltas[k].values, d.values)
    assert got.info["test_total"] == len(shard.test) and 0 <= got.info["test_correct"] <= len(shard.test)


def test_oversize_update_is_refused_before_sending(digits, shard) -> None:  # type: ignore[no-untyped-def]
    spec = digits.model_spec()
    strategy = StrategyCache({"device": "cpu"}).get(_plan(dataclasses.asdict(spec), "ab" * 32))
    g = initial_global_state(strategy, 3)
    plan = _plan(dataclasses.asdict(spec), model_blob(g).digest)
    with pytest.raises(UpdateTooLarge, match=r"is \d[\d,]* bytes .* the limit is 1,000 bytes. Nothing was sent"):
        train_and_encode(strategy, plan, g, strategy.initial_state(), shard, round_context(plan, 1, torch.device("cpu")),
                         federation="fed", sender="dev-1", max_payload=4096, max_update_bytes=1000, amp=False)


def test_plan_the_device_cannot_follow(digits, shard) -> None:  # type: ignore[no-untyped-def]
    spec = dataclasses.asdict(digits.model_spec())
    with pytest.raises(EdgeError, match="cannot build"):
        StrategyCache({"device": "cpu"}).get(_plan(spec, "ab" * 32, train={"lr": -1.0}))
    wrong = StrategyCache({"device": "cpu"}).get(_plan({**spec, "height": 28, "width": 28}, "ab" * 32))
    with pytest.raises(EdgeError, match="expects 1x28x28 images"):
        check_data_fits(wrong, shard)
    strategy = StrategyCache({"device": "cpu"}).get(_plan(spec, "ab" * 32))
    other = model_blob({"x": torch.zeros(2)})
    with pytest.raises(EdgeError, match="does not fit"):
        decode_global(other.blob, strategy, WireLimits())


def test_a_plan_naming_model_code_the_device_did_not_allow_is_refused_before_any_import(digits, tmp_path: Path,
                                                                                         monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The plan picks the model; the device picks the code: an entry point neither built in nor listed in
    [edge] allow_entry_points is refused, and its module is never imported."""
    import sys

    (tmp_path / "planted_model.py").write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n"
                                               "def build(**kw):\n    raise SystemExit('must not run')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {**dataclasses.asdict(digits.model_spec()), "name": "planted_model:build"}
    for allowed in ((), ("other.models:build",)):
        with pytest.raises(EntryPointRefused) as err:
            StrategyCache({"device": "cpu"}, allowed).get(_plan(spec, "ab" * 32))
        msg = str(err.value)
        assert "'planted_model:build'" in msg and "allow_entry_points" in msg and "--allow-entry-point" in msg, msg
    assert "planted_model" not in sys.modules and not (tmp_path / "ran").exists()
    with pytest.raises(EntryPointRefused, match="'os:system'"):  # a stdlib callable is model code like any other
        StrategyCache({"device": "cpu"}).get(_plan({**spec, "name": "os:system"}, "ab" * 32))
    # the built-ins are always allowed, by name or by their entry point
    builtin = dataclasses.asdict(digits.model_spec())
    assert StrategyCache({"device": "cpu"}).get(_plan(builtin, "ab" * 32)).spec.name == builtin["name"]
    check_entry_point(_plan({**builtin, "name": "flayer.models:fedavg_cnn"}, "ab" * 32), ())


def test_an_allowed_entry_point_is_built(digits, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "my_allowed_model.py").write_text(
        "from torch import nn\n"
        "def build(in_channels=1, num_classes=10, size=8):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * size * size, num_classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {**dataclasses.asdict(digits.model_spec()), "name": "my_allowed_model:build", "args": '{"size":8}'}
    strategy = StrategyCache({"device": "cpu"}, ["my_allowed_model:build"]).get(_plan(spec, "ab" * 32))
    assert strategy.spec.name == "my_allowed_model:build" and strategy.new_model() is not None


def test_device_config_allow_entry_points(tmp_path: Path) -> None:
    p = tmp_path / "device.toml"
    base = 'credentials = "c.toml"\n[data]\ndataset = "digits"\npartition_file = "p.npz"\nclient = 0\n[edge]\n'
    p.write_text(base + 'allow_entry_points = ["mypkg.models:build", "other:net"]\n')
    assert load_device_config(p).edge.allow_entry_points == ("mypkg.models:build", "other:net")
    p.write_text(base)
    assert load_device_config(p).edge.allow_entry_points == ()  # default: the built-ins only
    p.write_text(base + 'allow_entry_points = ["mypkg.models"]\n')
    with pytest.raises(ConfigError, match="'mypkg.models' is not an entry point"):
        load_device_config(p)
