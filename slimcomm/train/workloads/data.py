"""Datasets for the training command: an IDX reader, Fashion-MNIST, the digits fallback, sharding.

The IDX format (LeCun et al., the MNIST distribution format, also used by
Fashion-MNIST, Xiao et al., arXiv 1708.07747) is a big-endian header

    bytes 0-1   zero
    byte  2     element type code (0x08 uint8, 0x09 int8, 0x0B int16,
                0x0C int32, 0x0D float32, 0x0E float64)
    byte  3     number of dimensions d
    bytes 4..   d big-endian uint32 sizes

followed by ``prod(sizes)`` elements in C order. Files may be gzip-compressed
(``.gz``). :func:`read_idx` validates the magic number, the type code, the
header length and that the payload is exactly the size the header promises;
every failure raises :class:`IDXFormatError` naming the file.

Data is held as ``torch.Tensor``; images are flattened to ``[N, features]``
float32 and standardised with the training set's mean and standard deviation;
labels are int64 ``[N]``.

Sharding (:func:`shard_indices`) gives every rank an equal-sized, disjoint
slice of a seeded permutation, so every rank runs the same number of steps
per epoch (a data-parallel job whose ranks disagree on the step count would
block in a collective).
"""

from __future__ import annotations

import gzip
import logging
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "IDXFormatError",
    "read_idx",
    "write_idx",
    "Dataset",
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_FILES",
    "find_fashion_mnist",
    "load_fashion_mnist",
    "load_digits",
    "load_dataset",
    "shard_indices",
    "epoch_batches",
]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
"""Where the Debian package ``dataset-fashion-mnist`` installs the IDX files."""

FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
"""Base names of the four Fashion-MNIST IDX files (each may carry a ``.gz`` suffix)."""

FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)

# IDX type code -> big-endian numpy dtype.
_IDX_TYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {v.newbyteorder("="): k for k, v in _IDX_TYPES.items()}


class IDXFormatError(ValueError):
    """An IDX file is malformed (bad magic, truncated, sizes that do not match)."""


def _read_bytes(path: str) -> bytes:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"IDX file not found: {path}")
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, gzip.BadGzipFile) as e:  # truncated or corrupt gzip stream
        raise IDXFormatError(f"{path}: cannot decompress/read: {e}") from e


def read_idx(path: str, expect_ndim: Optional[int] = None) -> np.ndarray:
    """Read one IDX file (optionally gzip-compressed) into a numpy array.

    Args:
        path: file path; a name ending in ``.gz`` is decompressed with gzip.
        expect_ndim: if given, the header's dimension count must equal it
            (3 for image files ``[N, rows, cols]``, 1 for label files ``[N]``).

    Returns:
        array of the header's shape and element type (native byte order).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        IDXFormatError: the file is shorter than its header, the first two
            bytes are not zero, the type code is unknown, the dimension count
            is zero or not ``expect_ndim``, or the payload is not exactly
            ``prod(sizes) * itemsize`` bytes (truncated or trailing data).
            The message names ``path``.
    """
    data = _read_bytes(path)
    if len(data) < 4:
        raise IDXFormatError(f"{path}: file is {len(data)} bytes, shorter than the 4-byte IDX magic number")
    if data[0] != 0 or data[1] != 0:
        raise IDXFormatError(
            f"{path}: bad IDX magic number 0x{data[:4].hex()} (first two bytes must be zero); "
            "not an IDX file (or a gzip file without a .gz suffix)"
        )
    code, ndim = data[2], data[3]
    if code not in _IDX_TYPES:
        raise IDXFormatError(f"{path}: unknown IDX element type code 0x{code:02x}")
    if ndim == 0:
        raise IDXFormatError(f"{path}: IDX header declares 0 dimensions")
    if expect_ndim is not None and ndim != expect_ndim:
        raise IDXFormatError(f"{path}: expected a {expect_ndim}-dimensional IDX file, header says {ndim}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IDXFormatError(f"{path}: truncated header ({len(data)} bytes, need {header} for {ndim} dims)")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_TYPES[code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    got = len(data) - header
    if got < expected:
        raise IDXFormatError(
            f"{path}: truncated: header promises shape {dims} ({expected} payload bytes), file has {got}"
        )
    if got > expected:
        raise IDXFormatError(
            f"{path}: {got - expected} trailing bytes after the payload of shape {dims}"
        )
    arr = np.frombuffer(data, dtype=dtype, count=int(np.prod(dims)), offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzip-compressed when ``path`` ends in ``.gz``).

    Used by the tests and to produce small IDX data sets. Raises ``ValueError``
    for a dtype IDX cannot hold or a 0-d array.
    """
    array = np.asarray(array)
    if array.ndim == 0:
        raise ValueError("array: IDX needs at least one dimension")
    dt = array.dtype.newbyteorder("=")
    if dt not in _IDX_CODES:
        raise ValueError(f"array: dtype {array.dtype} has no IDX type code")
    code = _IDX_CODES[dt]
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = array.astype(_IDX_TYPES[code], copy=False).tobytes()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + payload)


@dataclass
class Dataset:
    """A train/test split held in memory.

    Attributes:
        name: ``"fashion-mnist"`` or ``"digits"``.
        x_train: float32 ``[N_train, features]``, standardised.
        y_train: int64 ``[N_train]`` in ``[0, num_classes)``.
        x_test: float32 ``[N_test, features]``, standardised with the
            training statistics.
        y_test: int64 ``[N_test]``.
        num_classes: number of classes.
        source: where the data came from (directory or ``sklearn``).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    source: str

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])


def _find_file(directory: str, base: str) -> Optional[str]:
    for name in (base, base + ".gz"):
        p = os.path.join(directory, name)
        if os.path.isfile(p):
            return p
    return None


def find_fashion_mnist(data_dir: Optional[str] = None) -> Optional[str]:
    """Directory holding all four Fashion-MNIST IDX files, or ``None``.

    Looks in ``data_dir`` when given (and only there), else in
    :data:`FASHION_MNIST_DIR`.
    """
    for d in ([data_dir] if data_dir else [FASHION_MNIST_DIR]):
        if d and all(_find_file(d, b) is not None for b in FASHION_MNIST_FILES.values()):
            return d
    return None


def _standardise(x_train: np.ndarray, x_test: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
    xtr = torch.from_numpy(x_train.reshape(x_train.shape[0], -1).astype(np.float32))
    xte = torch.from_numpy(x_test.reshape(x_test.shape[0], -1).astype(np.float32))
    mean = xtr.mean()
    std = xtr.std().clamp_min(1e-6)
    return (xtr - mean) / std, (xte - mean) / std


def load_fashion_mnist(data_dir: str) -> Dataset:
    """Load Fashion-MNIST from the four IDX files in ``data_dir``.

    Returns a :class:`Dataset` with ``[60000, 784]`` / ``[10000, 784]``
    images (for the official files; any consistent sizes are accepted).

    Raises:
        FileNotFoundError: one of the files is missing (named).
        IDXFormatError: a file is malformed, image files are not 3-D, label
            files not 1-D, image and label counts differ, train and test image
            sizes differ, or a label is outside ``[0, 10)``.
    """
    paths = {}
    for key, base in FASHION_MNIST_FILES.items():
        p = _find_file(data_dir, base)
        if p is None:
            raise FileNotFoundError(f"--data-dir {data_dir}: missing {base} (or {base}.gz)")
        paths[key] = p
    xtr = read_idx(paths["train_images"], expect_ndim=3)
    ytr = read_idx(paths["train_labels"], expect_ndim=1)
    xte = read_idx(paths["test_images"], expect_ndim=3)
    yte = read_idx(paths["test_labels"], expect_ndim=1)
    for xi, yi, kx, ky in ((xtr, ytr, "train_images", "train_labels"), (xte, yte, "test_images", "test_labels")):
        if xi.shape[0] != yi.shape[0]:
            raise IDXFormatError(
                f"{paths[kx]} has {xi.shape[0]} images but {paths[ky]} has {yi.shape[0]} labels"
            )
        if yi.size and (yi.min() < 0 or yi.max() >= 10):
            raise IDXFormatError(f"{paths[ky]}: labels must lie in [0, 10), got [{yi.min()}, {yi.max()}]")
    if xtr.shape[1:] != xte.shape[1:]:
        raise IDXFormatError(
            f"{paths['train_images']} images are {xtr.shape[1:]} but {paths['test_images']} are {xte.shape[1:]}"
        )
    x_train, x_test = _standardise(xtr, xte)
    return Dataset(
        name="fashion-mnist",
        x_train=x_train,
        y_train=torch.from_numpy(ytr.astype(np.int64)),
        x_test=x_test,
        y_test=torch.from_numpy(yte.astype(np.int64)),
        num_classes=10,
        source=data_dir,
    )


def load_digits(test_fraction: float = 1 / 6, seed: int = 0) -> Dataset:
    """scikit-learn's bundled UCI handwritten digits (1797 x 64, 10 classes), split train/test.

    The split is a fixed permutation drawn from ``seed`` (identical on every
    rank); ``test_fraction`` of the samples go to the test set.
    """
    from sklearn.datasets import load_digits as _sk_load_digits

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    d = _sk_load_digits()
    x = np.asarray(d.data, dtype=np.float32)
    y = np.asarray(d.target, dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    te, tr = perm[:n_test], perm[n_test:]
    x_train, x_test = _standardise(x[tr], x[te])
    return Dataset("digits", x_train, torch.from_numpy(y[tr]), x_test, torch.from_numpy(y[te]), 10, "sklearn")


def load_dataset(name: str = "auto", data_dir: Optional[str] = None, log=logger.warning) -> Dataset:
    """Load the data set the training command asked for.

    Args:
        name: ``"fashion-mnist"`` (error if the files are not found),
            ``"digits"``, or ``"auto"``: Fashion-MNIST from ``data_dir`` or
            :data:`FASHION_MNIST_DIR` if present, else the digits set with a
            one-line notice through ``log``.
        data_dir: directory with the Fashion-MNIST IDX files.
        log: callable for the fallback notice (default: a warning on this module's
            :mod:`logging` logger; ``None`` to stay silent).

    Raises:
        ValueError: unknown ``name``.
        FileNotFoundError: ``name="fashion-mnist"`` (or an explicit
            ``data_dir``) and the files are not there.
    """
    if name not in ("auto", "fashion-mnist", "digits"):
        raise ValueError(f"--dataset must be auto, fashion-mnist or digits, got {name!r}")
    if name == "digits":
        return load_digits()
    found = find_fashion_mnist(data_dir)
    if found is not None:
        return load_fashion_mnist(found)
    if name == "fashion-mnist" or data_dir:
        where = data_dir or FASHION_MNIST_DIR
        raise FileNotFoundError(
            f"--data-dir {where}: Fashion-MNIST IDX files not found "
            f"(need {', '.join(FASHION_MNIST_FILES.values())}, optionally .gz; "
            "`apt-get install dataset-fashion-mnist` installs them in " + FASHION_MNIST_DIR + ")"
        )
    if log is not None:
        log(
            f"Fashion-MNIST not found in {FASHION_MNIST_DIR} "
            "(apt-get install dataset-fashion-mnist); using scikit-learn's digits set instead"
        )
    return load_digits()


def shard_indices(n: int, rank: int, world_size: int, seed: int = 0, subset: Optional[int] = None) -> torch.Tensor:
    """Indices of rank ``rank``'s training shard.

    A permutation of ``[0, n)`` drawn from ``seed`` (the same on every rank)
    is cut to ``subset`` samples (all when ``None``), then truncated to a
    multiple of ``world_size`` and dealt round-robin: rank r gets positions
    ``r, r + W, r + 2W, ...``. Shards are disjoint and of equal size
    ``floor(min(subset, n) / W)``.

    Returns:
        int64 ``[shard_size]``.

    Raises:
        ValueError: ``world_size < 1``, ``rank`` outside ``[0, world_size)``,
            ``subset < world_size`` or the shard would be empty.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    total = n if subset is None else min(int(subset), n)
    if subset is not None and subset < 1:
        raise ValueError(f"--train-subset must be >= 1, got {subset}")
    per_rank = total // world_size
    if per_rank == 0:
        raise ValueError(f"{total} training samples cannot be split over {world_size} ranks")
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=g)[: per_rank * world_size]
    return perm[rank::world_size].clone()


def epoch_batches(shard_size: int, batch_size: int, epoch: int, seed: int, rank: int):
    """Mini-batch index lists (into the shard) for one epoch.

    The shard is reshuffled each epoch from ``(seed, rank, epoch)``; the last
    partial batch is dropped, so every rank gets ``shard_size // batch_size``
    batches when shards are of equal size.

    Returns:
        list of int64 tensors ``[batch_size]``.

    Raises:
        ValueError: ``batch_size`` is not positive or exceeds ``shard_size``.
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if batch_size > shard_size:
        raise ValueError(f"--batch-size {batch_size} is larger than the per-rank shard ({shard_size} samples)")
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + rank * 7919 + epoch)
    perm = torch.randperm(shard_size, generator=g)
    steps = shard_size // batch_size
    return [perm[i * batch_size:(i + 1) * batch_size] for i in range(steps)]
