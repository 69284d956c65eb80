"""Every loader on small files generated in the real on-disk formats, good and broken."""

import gzip
import pickle
import struct

import numpy as np
import pytest

from flayer.data import DataError, load_dataset


def write_idx(path, array, gz=True, dtype_code=0x08):
    header = struct.pack(">HBB", 0, dtype_code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def make_idx_dir(tmp_path, n_train=30, n_test=10, gz=True):
    rng = np.random.default_rng(0)
    files = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        files[f"{split}_x"] = write_idx(tmp_path / f"{split}-images-idx3-ubyte",
                                        rng.integers(0, 256, (n, 28, 28)), gz)
        files[f"{split}_y"] = write_idx(tmp_path / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, n), gz)
    return files


@pytest.mark.parametrize("gz", [True, False])
def test_idx_loader_reads_both_compressions(tmp_path, gz):
    make_idx_dir(tmp_path, gz=gz)
    ds = load_dataset("mnist", tmp_path)
    assert ds.x.shape == (40, 1, 28, 28) and ds.x.dtype == np.uint8
    assert ds.y.shape == (40,) and ds.y.dtype == np.int64 and ds.num_classes == 10


def test_idx_truncated_file_names_the_path(tmp_path):
    files = make_idx_dir(tmp_path, gz=False)
    p = files["train_x"]
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DataError, match="truncated") as exc:
        load_dataset("fmnist", tmp_path)
    assert str(p) in str(exc.value)


def test_idx_truncated_gzip(tmp_path):
    files = make_idx_dir(tmp_path, gz=True)
    p = files["train_y"]
    p.write_bytes(p.read_bytes()[:20])
    with pytest.raises(DataError, match="gzip"):
        load_dataset("fmnist", tmp_path)


def test_idx_wrong_format(tmp_path):
    files = make_idx_dir(tmp_path, gz=False)
    files["t10k_x"].write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 100)
    with pytest.raises(DataError, match="not an IDX file|magic"):
        load_dataset("fmnist", tmp_path)


def test_idx_wrong_dtype_and_dims(tmp_path):
    files = make_idx_dir(tmp_path, gz=False)
    write_idx(files["train_x"], np.zeros((3, 28, 28)), gz=False, dtype_code=0x0D)
    with pytest.raises(DataError, match="type code"):
        load_dataset("fmnist", tmp_path)
    write_idx(files["train_x"], np.zeros((30, 784)), gz=False)
    with pytest.raises(DataError, match="dimensions"):
        load_dataset("fmnist", tmp_path)


def test_idx_missing_files_say_how_to_get_them(tmp_path):
    with pytest.raises(DataError, match="dataset-fashion-mnist"):
        load_dataset("fmnist", tmp_path / "nowhere")
    make_idx_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        load_dataset("fmnist", tmp_path)


def test_idx_label_count_mismatch(tmp_path):
    files = make_idx_dir(tmp_path)
    write_idx(files["train_y"].with_suffix(""), np.zeros(29))
    with pytest.raises(DataError, match="labels"):
        load_dataset("fmnist", tmp_path)


def _cifar_batch(n, label_key, classes, rng):
    return {b"batch_label": b"x", label_key.encode(): rng.integers(0, classes, n).tolist(),
            b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8), b"filenames": [b"f"] * n}


def test_cifar10_loader(tmp_path):
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (tmp_path / name).write_bytes(pickle.dumps(_cifar_batch(4, "labels", 10, rng)))
    ds = load_dataset("cifar10", tmp_path)
    assert ds.x.shape == (24, 3, 32, 32) and ds.num_classes == 10 and ds.mean == (0.5, 0.5, 0.5)
    assert ds.model_spec().height == 32 and ds.model_spec().in_channels == 3


def test_cifar100_loader_and_bad_files(tmp_path):
    rng = np.random.default_rng(2)
    for name in ("train", "test"):
        (tmp_path / name).write_bytes(pickle.dumps(_cifar_batch(5, "fine_labels", 100, rng)))
    ds = load_dataset("cifar100", tmp_path)
    assert ds.x.shape == (10, 3, 32, 32) and ds.num_classes == 100
    (tmp_path / "test").write_bytes(pickle.dumps(_cifar_batch(5, "fine_labels", 100, rng))[:50])
    with pytest.raises(DataError, match="not a readable CIFAR"):
        load_dataset("cifar100", tmp_path)
    (tmp_path / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"fine_labels": [0, 1]}))
    with pytest.raises(DataError, match="3072"):
        load_dataset("cifar100", tmp_path)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_cifar_unpickler_refuses_arbitrary_globals(tmp_path):
    for name in ("train", "test"):
        (tmp_path / name).write_bytes(pickle.dumps({b"data": _Evil(), b"fine_labels": []}))
    with pytest.raises(DataError, match="not allowed"):
        load_dataset("cifar100", tmp_path)


def test_cifar_missing_batch(tmp_path):
    with pytest.raises(DataError, match="data_batch_1"):
        (tmp_path / "c").mkdir()
        load_dataset("cifar10", tmp_path / "c")


def make_tiny_imagenet(root, classes=("n01", "n02"), per_class=3, size=64):
    from PIL import Image

    rng = np.random.default_rng(3)
    (root / "wnids.txt").write_text("\n".join(classes) + "\n")
    for w in classes:
        d = root / "train" / w / "images"
        d.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(d / f"{w}_{i}.JPEG")
    v = root / "val" / "images"
    v.mkdir(parents=True)
    lines = []
    for i, w in enumerate(classes):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(v / f"val_{i}.JPEG")
        lines.append(f"val_{i}.JPEG\t{w}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")


def test_tiny_imagenet_loader(tmp_path):
    make_tiny_imagenet(tmp_path)
    ds = load_dataset("tiny-imagenet", tmp_path)
    assert ds.x.shape == (8, 3, 64, 64) and ds.num_classes == 2
    assert sorted(np.bincount(ds.y).tolist()) == [4, 4]
    assert ds.model_spec().height == 64


def test_tiny_imagenet_errors(tmp_path):
    make_tiny_imagenet(tmp_path)
    (tmp_path / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn99\n")
    with pytest.raises(DataError, match="wnid"):
        load_dataset("tiny-imagenet", tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    make_tiny_imagenet(other, size=32)
    with pytest.raises(DataError, match="expected 64x64"):
        load_dataset("tiny-imagenet", other)
    broken = tmp_path / "broken"
    broken.mkdir()
    make_tiny_imagenet(broken)
    (broken / "train" / "n01" / "images" / "n01_0.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(DataError, match="cannot decode"):
        load_dataset("tiny-imagenet", broken)


def test_agnews_loader(tmp_path):
    (tmp_path / "train.csv").write_text('"3","Wall St. Bears","Short-sellers, Wall Street\'s dwindling band"\n'
                                        '"2","Team wins","The team won the cup again"\n')
    (tmp_path / "test.csv").write_text('"4","New chip","A brand new chip from the lab"\n')
    ds = load_dataset("agnews", tmp_path)
    assert ds.is_text and ds.x.shape == (3, 200) and ds.x.dtype == np.int64
    assert ds.y.tolist() == [2, 1, 3] and ds.num_classes == 4
    assert ds.vocab_size > 10 and ds.x.max() < ds.vocab_size
    assert (ds.x[2] == 1).any()  # unseen test words map to <unk>
    assert ds.model_spec().name == "fasttext"


def test_agnews_bad_rows(tmp_path):
    (tmp_path / "train.csv").write_text('"7","bad class","x"\n')
    (tmp_path / "test.csv").write_text('"1","a","b"\n')
    with pytest.raises(DataError, match="train.csv:1"):
        load_dataset("agnews", tmp_path)
    (tmp_path / "train.csv").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DataError, match="UTF-8"):
        load_dataset("agnews", tmp_path)


def test_digits_and_unknown(digits):
    assert digits.x.shape == (1797, 1, 16, 16) and digits.x.max() <= 255
    with pytest.raises(DataError, match="unknown data set"):
        load_dataset("imagenet")


def test_digits_read_from_the_wheels_file_equal_sklearns_loader(digits, monkeypatch):
    """The file read directly (no sklearn import) and sklearn's own loader give the same data set."""
    from flayer.data import digits as digits_module

    assert digits_module._digits_csv() is not None  # the direct read is what ran
    monkeypatch.setattr(digits_module, "_digits_csv", lambda: None)
    via_sklearn = load_dataset("digits")
    assert np.array_equal(digits.x, via_sklearn.x) and np.array_equal(digits.y, via_sklearn.y)
    assert digits.fingerprint() == via_sklearn.fingerprint()


def test_real_fashion_mnist_if_installed():
    import os

    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        pytest.skip("dataset-fashion-mnist is not installed")
    ds = load_dataset("fmnist")
    assert ds.x.shape == (70000, 1, 28, 28)
    assert np.bincount(ds.y).tolist() == [7000] * 10
