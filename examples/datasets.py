"""Loads Fashion-MNIST (or MNIST) from the IDX `.gz` files of the original release.

The Debian package `dataset-fashion-mnist` installs them in
/usr/share/datasets/fashion-mnist. No download happens here.
"""

import gzip
import os

import numpy as np

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"

FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

# IDX type codes (third magic byte) and their big-endian numpy dtypes.
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path, expected_ndim=None):
    """Reads one IDX file (gzip-compressed when it ends in `.gz`) into an array.

    The header is a 4-byte magic number `0x00 0x00 <type> <ndim>` followed by
    `ndim` big-endian uint32 dimensions; the data follow in C order.

    Args:
        path: path of the `.idx*` or `.idx*.gz` file.
        expected_ndim: if given, the number of dimensions the file must have
            (3 for images, 1 for labels).

    Returns:
        A numpy array in native byte order.

    Raises:
        ValueError: the file is not a well-formed IDX file.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number {data[:4].hex()}).")
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX type code 0x{type_code:02x}.")
    if expected_ndim is not None and ndim != expected_ndim:
        raise ValueError(
            f"{path}: expected an IDX file with {expected_ndim} dimensions "
            f"(magic 0x0000{type_code:02x}{expected_ndim:02x}), found {ndim}.")
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise ValueError(f"{path}: truncated IDX header.")
    shape = tuple(int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    count = int(np.prod(shape)) if shape else 1
    if len(data) - header_size != count * dtype.itemsize:
        raise ValueError(
            f"{path}: header announces shape {shape} ({count * dtype.itemsize} bytes) "
            f"but the file holds {len(data) - header_size} bytes of data.")
    array = np.frombuffer(data, dtype, count=count, offset=header_size)
    return array.reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path, array):
    """Writes `array` (uint8) as an IDX file; gzip-compressed if `path` ends in `.gz`."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def load_fashion_mnist(data_dir=DEFAULT_DATA_DIR):
    """Returns `(x_train, y_train), (x_test, y_test)` as uint8 arrays.

    Images have shape `[N, 28, 28]` and labels shape `[N]`.

    Raises:
        FileNotFoundError: the IDX files are not in `data_dir`; the message says
            how to install them.
    """
    missing = [name for name in FILES.values()
               if not os.path.exists(os.path.join(data_dir, name))]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST not found in {data_dir} (missing {', '.join(missing)}). "
            "Install it with `apt-get install dataset-fashion-mnist` (as root; run "
            "`apt-get update` first), or pass --data_dir pointing to a directory "
            f"with the four IDX files {', '.join(FILES.values())}.")
    arrays = {key: read_idx(os.path.join(data_dir, name),
                            expected_ndim=3 if key.endswith("images") else 1)
              for key, name in FILES.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if len(images) != len(labels):
            raise ValueError(f"{data_dir}: {len(images)} {split} images but "
                             f"{len(labels)} {split} labels.")
    return ((arrays["train_images"], arrays["train_labels"]),
            (arrays["test_images"], arrays["test_labels"]))
