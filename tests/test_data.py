"""slimcomm.train.workloads.data: the IDX reader, the Fashion-MNIST loader, sharding and batching."""

import gzip
import os

import numpy as np
import pytest
import torch

from slimcomm.train.workloads import data as D


def _images(n, rows=4, cols=3, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, rows, cols), dtype=np.uint8)


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_idx_roundtrip(tmp_path, suffix, dtype):
    a = (np.arange(2 * 3 * 5).reshape(2, 3, 5) - 7).astype(dtype)
    if dtype == np.uint8:
        a = np.arange(30, dtype=np.uint8).reshape(2, 3, 5)
    p = str(tmp_path / f"x.idx{suffix}")
    D.write_idx(p, a)
    b = D.read_idx(p)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


def test_idx_header_bytes(tmp_path):
    """The file layout is the documented big-endian header, byte for byte."""
    p = str(tmp_path / "labels")
    D.write_idx(p, np.array([1, 2, 3], dtype=np.uint8))
    raw = open(p, "rb").read()
    assert raw == bytes([0, 0, 0x08, 1, 0, 0, 0, 3, 1, 2, 3])
    p2 = str(tmp_path / "i32")
    D.write_idx(p2, np.array([[258]], dtype=np.int32))
    assert open(p2, "rb").read() == bytes([0, 0, 0x0C, 2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 2])


def test_idx_truncated_payload(tmp_path):
    p = str(tmp_path / "imgs")
    D.write_idx(p, _images(5))
    raw = open(p, "rb").read()
    open(p, "wb").write(raw[:-7])
    with pytest.raises(D.IDXFormatError, match=r"imgs.*truncated"):
        D.read_idx(p)


def test_idx_truncated_header(tmp_path):
    p = str(tmp_path / "short")
    open(p, "wb").write(bytes([0, 0, 8, 3, 0, 0]))
    with pytest.raises(D.IDXFormatError, match=r"short.*truncated header"):
        D.read_idx(p)
    open(p, "wb").write(bytes([0, 0]))
    with pytest.raises(D.IDXFormatError, match=r"short.*shorter than"):
        D.read_idx(p)


def test_idx_truncated_gzip(tmp_path):
    p = str(tmp_path / "imgs.gz")
    D.write_idx(p, _images(50))
    raw = open(p, "rb").read()
    open(p, "wb").write(raw[: len(raw) // 2])
    with pytest.raises(D.IDXFormatError, match=r"imgs\.gz"):
        D.read_idx(p)


def test_idx_trailing_bytes(tmp_path):
    p = str(tmp_path / "imgs")
    D.write_idx(p, _images(2))
    with open(p, "ab") as f:
        f.write(b"\x00\x01")
    with pytest.raises(D.IDXFormatError, match=r"imgs.*2 trailing bytes"):
        D.read_idx(p)


def test_idx_wrong_magic(tmp_path):
    p = str(tmp_path / "notidx")
    open(p, "wb").write(b"\x1f\x8b\x08\x03" + bytes(40))
    with pytest.raises(D.IDXFormatError, match=r"notidx.*bad IDX magic"):
        D.read_idx(p)
    # a gzip file without the .gz suffix is also caught by the magic check
    p2 = str(tmp_path / "zipped")
    with gzip.open(p2, "wb") as f:
        f.write(bytes([0, 0, 8, 1, 0, 0, 0, 1, 7]))
    with pytest.raises(D.IDXFormatError, match="zipped.*magic"):
        D.read_idx(p2)


def test_idx_bad_type_and_dims(tmp_path):
    p = str(tmp_path / "badtype")
    open(p, "wb").write(bytes([0, 0, 0x07, 1, 0, 0, 0, 1, 5]))
    with pytest.raises(D.IDXFormatError, match=r"badtype.*type code 0x07"):
        D.read_idx(p)
    p = str(tmp_path / "zerodim")
    open(p, "wb").write(bytes([0, 0, 0x08, 0]))
    with pytest.raises(D.IDXFormatError, match=r"zerodim.*0 dimensions"):
        D.read_idx(p)
    p = str(tmp_path / "labels")
    D.write_idx(p, np.zeros(3, np.uint8))
    with pytest.raises(D.IDXFormatError, match=r"labels.*expected a 3-dimensional"):
        D.read_idx(p, expect_ndim=3)


def test_idx_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere"):
        D.read_idx(str(tmp_path / "nothere"))


def write_fashion(dirpath, n_train=40, n_test=12, gz=True, seed=0):
    """A tiny but well-formed Fashion-MNIST directory (28x28 images, labels 0..9)."""
    rng = np.random.default_rng(seed)
    os.makedirs(dirpath, exist_ok=True)
    sfx = ".gz" if gz else ""
    ytr = (np.arange(n_train) % 10).astype(np.uint8)
    yte = (np.arange(n_test) % 10).astype(np.uint8)
    # noise plus a bright class-specific band of rows, so a model can learn the labels
    xtr = rng.integers(0, 100, size=(n_train, 28, 28)).astype(np.uint8)
    xte = rng.integers(0, 100, size=(n_test, 28, 28)).astype(np.uint8)
    for x, y in ((xtr, ytr), (xte, yte)):
        for i, c in enumerate(y):
            x[i, 2 * c:2 * c + 3, :] = 255
    D.write_idx(os.path.join(dirpath, "train-images-idx3-ubyte" + sfx), xtr)
    D.write_idx(os.path.join(dirpath, "train-labels-idx1-ubyte" + sfx), ytr)
    D.write_idx(os.path.join(dirpath, "t10k-images-idx3-ubyte" + sfx), xte)
    D.write_idx(os.path.join(dirpath, "t10k-labels-idx1-ubyte" + sfx), yte)
    return xtr, ytr, xte, yte


@pytest.mark.parametrize("gz", [True, False])
def test_load_fashion_mnist(tmp_path, gz):
    xtr, ytr, xte, yte = write_fashion(str(tmp_path), gz=gz)
    ds = D.load_dataset("auto", str(tmp_path))
    assert ds.name == "fashion-mnist" and ds.num_classes == 10 and ds.num_features == 784
    assert ds.x_train.shape == (40, 784) and ds.x_train.dtype == torch.float32
    assert ds.y_train.dtype == torch.int64
    assert torch.equal(ds.y_train, torch.from_numpy(ytr.astype(np.int64)))
    assert torch.equal(ds.y_test, torch.from_numpy(yte.astype(np.int64)))
    # standardised with the training statistics, applied identically to test
    m, s = xtr.astype(np.float64).mean(), xtr.astype(np.float32).std(ddof=1)
    np.testing.assert_allclose(ds.x_test.numpy(), (xte.reshape(12, -1) - m) / s, rtol=1e-4, atol=1e-4)
    assert abs(float(ds.x_train.mean())) < 1e-5


def test_fashion_mnist_errors(tmp_path):
    write_fashion(str(tmp_path))
    os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(FileNotFoundError, match="t10k-labels"):
        D.load_fashion_mnist(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        D.load_dataset("auto", str(tmp_path))
    # labels/images count mismatch
    D.write_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"), np.zeros(5, np.uint8))
    with pytest.raises(D.IDXFormatError, match="12 images but .*5 labels"):
        D.load_fashion_mnist(str(tmp_path))
    # out-of-range label
    D.write_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"), np.full(12, 11, np.uint8))
    with pytest.raises(D.IDXFormatError, match=r"labels must lie in \[0, 10\)"):
        D.load_fashion_mnist(str(tmp_path))
    # labels file where images belong
    D.write_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"), np.zeros(12, np.uint8))
    D.write_idx(str(tmp_path / "t10k-images-idx3-ubyte.gz"), np.zeros(12, np.uint8))
    with pytest.raises(D.IDXFormatError, match="t10k-images.*3-dimensional"):
        D.load_fashion_mnist(str(tmp_path))


def test_digits_fallback_notice(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "FASHION_MNIST_DIR", str(tmp_path / "absent"))
    msgs = []
    ds = D.load_dataset("auto", None, log=msgs.append)
    assert ds.name == "digits" and ds.num_features == 64
    assert len(msgs) == 1 and "digits" in msgs[0] and "\n" not in msgs[0]
    assert ds.x_train.shape[0] + ds.x_test.shape[0] == 1797
    with pytest.raises(FileNotFoundError, match="Fashion-MNIST"):
        D.load_dataset("fashion-mnist", None)
    with pytest.raises(ValueError, match="--dataset"):
        D.load_dataset("cifar")


@pytest.mark.parametrize("n,w,subset", [(100, 2, None), (101, 3, None), (1000, 4, 37), (10, 1, 10)])
def test_shard_indices_disjoint_equal(n, w, subset):
    shards = [D.shard_indices(n, r, w, seed=3, subset=subset) for r in range(w)]
    total = n if subset is None else min(subset, n)
    sizes = {s.numel() for s in shards}
    assert sizes == {total // w}
    allidx = torch.cat(shards)
    assert allidx.unique().numel() == allidx.numel()
    assert int(allidx.min()) >= 0 and int(allidx.max()) < n
    # same call, same answer; different seed, different shard
    assert torch.equal(shards[0], D.shard_indices(n, 0, w, seed=3, subset=subset))
    if total // w > 3:
        assert not torch.equal(shards[0], D.shard_indices(n, 0, w, seed=4, subset=subset))


def test_shard_indices_errors():
    with pytest.raises(ValueError, match="rank"):
        D.shard_indices(10, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        D.shard_indices(10, 0, 0)
    with pytest.raises(ValueError, match="cannot be split"):
        D.shard_indices(10, 0, 4, subset=3)
    with pytest.raises(ValueError, match="--train-subset"):
        D.shard_indices(10, 0, 1, subset=0)


def test_epoch_batches():
    b = D.epoch_batches(103, 10, epoch=0, seed=1, rank=0)
    assert len(b) == 10 and all(x.numel() == 10 for x in b)
    flat = torch.cat(b)
    assert flat.unique().numel() == 100 and int(flat.max()) < 103
    b2 = D.epoch_batches(103, 10, epoch=1, seed=1, rank=0)
    assert not torch.equal(torch.cat(b2), flat)
    assert torch.equal(torch.cat(D.epoch_batches(103, 10, epoch=0, seed=1, rank=0)), flat)
    with pytest.raises(ValueError, match="--batch-size"):
        D.epoch_batches(5, 6, 0, 0, 0)
    with pytest.raises(ValueError, match="--batch-size"):
        D.epoch_batches(5, 0, 0, 0, 0)
