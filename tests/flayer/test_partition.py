import numpy as np
import pytest

from flayer.partition import (
    PartitionError,
    PartitionSpec,
    format_partition,
    load_partition,
    make_partition,
    save_partition,
    stratified_subsample,
)


@pytest.fixture(scope="module")
def labels():
    rng = np.random.default_rng(123)
    return rng.permutation(np.repeat(np.arange(10), 600))  # 6,000 balanced labels


def all_indices(p):
    return np.concatenate([np.concatenate([c.train, c.val, c.test]) for c in p.clients])


@pytest.mark.parametrize("scheme", ["dir0.1", "dir1", "pat2", "iid"])
def test_disjoint_complete_and_minimum(labels, scheme):
    p = make_partition(labels, 10, 20, scheme, seed=0)
    idx = all_indices(p)
    assert np.unique(idx).size == idx.size, "clients overlap"
    # complete: pat2 with 20 clients x 2 classes also covers all 10 classes (each owned by 4 clients)
    assert np.array_equal(np.sort(idx), np.arange(labels.size))
    least = int(min(10 / 0.25, labels.size / 20 / 2))
    if scheme.startswith("dir"):
        assert min(c.size for c in p.clients) >= least
    for c in p.clients:
        assert c.test.size == round(c.size * 0.25)
        assert abs(c.val.size - round((c.size - c.test.size) * 0.1)) <= 1


def test_same_seed_same_partition_different_seed_different(labels):
    a = make_partition(labels, 10, 20, "dir0.1", seed=7)
    b = make_partition(labels, 10, 20, "dir0.1", seed=7)
    c = make_partition(labels, 10, 20, "dir0.1", seed=8)
    for x, y in zip(a.clients, b.clients):
        assert np.array_equal(x.train, y.train) and np.array_equal(x.test, y.test) and np.array_equal(x.val, y.val)
    assert any(not np.array_equal(x.train, y.train) for x, y in zip(a.clients, c.clients))


def test_dirichlet_is_visibly_skewed(labels):
    skew_dir = make_partition(labels, 10, 20, "dir0.1", seed=0).summary["skew"]
    skew_iid = make_partition(labels, 10, 20, "iid", seed=0).summary["skew"]
    skew_pat = make_partition(labels, 10, 20, "pat2", seed=0).summary["skew"]
    # measured here: Dir(0.1) ~0.7 mean TV distance, iid ~0.05, pat2 = 0.8 exactly
    assert skew_dir["mean_tv_distance"] > 0.5 > 0.1 > skew_iid["mean_tv_distance"]
    assert skew_pat["mean_tv_distance"] == pytest.approx(0.8)
    assert skew_pat["mean_classes_per_client"] == 2
    assert skew_dir["mean_classes_per_client"] < 8


def test_stratified_subsample_keeps_class_shares(labels):
    rng = np.random.default_rng(0)
    idx = stratified_subsample(labels, 1000, rng)
    assert idx.size == 1000 and np.unique(idx).size == 1000
    assert np.bincount(labels[idx]).tolist() == [100] * 10
    p = make_partition(labels, 10, 10, "iid", seed=0, samples=1000)
    assert all_indices(p).size == 1000 and p.summary["samples"] == 1000


def test_save_load_round_trip(labels, tmp_path):
    p = make_partition(labels, 10, 5, "dir0.5", seed=3, meta={"dataset": "x", "dataset_fingerprint": "abc"})
    path = save_partition(p, tmp_path / "p.npz")
    q = load_partition(path, dataset_size=labels.size, fingerprint="abc")
    assert q.summary == p.summary
    for x, y in zip(p.clients, q.clients):
        assert np.array_equal(x.train, y.train) and np.array_equal(x.val, y.val) and np.array_equal(x.test, y.test)
    assert "client" in format_partition(q)
    with pytest.raises(PartitionError, match="another data set"):
        load_partition(path, fingerprint="zzz")
    with pytest.raises(PartitionError, match="outside"):
        load_partition(path, dataset_size=10)


def test_load_rejects_garbage(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(PartitionError, match="not a readable"):
        load_partition(bad)
    with pytest.raises(PartitionError, match="does not exist"):
        load_partition(tmp_path / "missing.npz")
    np.savez(tmp_path / "nosummary.npz", c0_train=np.arange(3))
    with pytest.raises(PartitionError, match="malformed"):
        load_partition(tmp_path / "nosummary.npz")


@pytest.mark.parametrize("text", ["dir", "dir0", "pat0", "foo", "dir-1", "patx"])
def test_spec_parse_rejects(text):
    with pytest.raises(PartitionError):
        PartitionSpec.parse(text)


def test_spec_parse_accepts():
    assert PartitionSpec.parse("dir0.1") == PartitionSpec("dir", alpha=0.1)
    assert str(PartitionSpec.parse("PAT3")) == "pat3"
    assert str(PartitionSpec.parse("iid")) == "iid"


def test_impossible_requests(labels):
    with pytest.raises(PartitionError, match="too few"):
        make_partition(labels[:30], 10, 20, "iid", seed=0)
    with pytest.raises(PartitionError, match="only 10 classes"):
        make_partition(labels, 10, 5, "pat11", seed=0)
