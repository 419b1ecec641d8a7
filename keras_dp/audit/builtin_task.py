"""The built-in audit task of `keras-dp audit`: a small MLP on Fashion-MNIST."""

import gzip
import os

import keras
import numpy as np

from keras_dp import optimizers
from keras_dp.audit.audits import audit_training
from keras_dp.audit.canaries import ExampleCanaries
from keras_dp.audit.canaries import GradientCanaries

# Where the Debian package dataset-fashion-mnist installs the IDX files.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
CANARY_KINDS = ("gradient", "mislabeled", "input")


def audit_builtin_task(noise_multiplier=1.0, l2_norm_clip=1.0, epochs=5,
                       num_canaries=1000, canary_kind="gradient", num_examples=10000,
                       batch_size=500, learning_rate=0.5, seed=0,
                       data_dir=FASHION_MNIST_DIR, verbose=1):
    """Audits keras-dp's own training of a small MLP on Fashion-MNIST.

    Uses `num_examples` Fashion-MNIST training images (784 pixels in [0, 1])
    when the IDX files are in `data_dir`, else generated data of the same
    shape; a 784-64-10 ReLU network, DP-SGD with momentum 0.9, Poisson
    batches, delta = `keras_dp.default_delta` of the training set. 1,000
    test images are held out for the membership inference.

    Args:
        noise_multiplier, l2_norm_clip, epochs, batch_size, learning_rate:
            the DP-SGD training run.
        num_canaries: m.
        canary_kind: "gradient" (`GradientCanaries`), "mislabeled" (training
            images not otherwise used, with a wrong label) or "input"
            (uniform random images with random labels).
        num_examples: training images, canaries not included.
        seed: seed of the data subset, canaries, weights and noise.
        data_dir: directory of the Fashion-MNIST IDX `.gz` files.
        verbose: Keras `fit` verbosity (1: progress bar).

    Returns:
        An `AuditResult` (`membership` on training vs held-out images).

    Example:
    ```python
    result = keras_dp.audit.audit_builtin_task(noise_multiplier=1.0)
    ```
    """
    if canary_kind not in CANARY_KINDS:
        raise ValueError(f"canary_kind must be one of {CANARY_KINDS}; received "
                         f"{canary_kind!r}.")
    (x, y), (x_spare, y_spare), holdout = _builtin_data(
        num_examples, num_canaries, data_dir, np.random.default_rng(seed))
    canaries = {
        "gradient": lambda: GradientCanaries(num_canaries, seed=seed),
        "mislabeled": lambda: ExampleCanaries.mislabeled(x_spare, y_spare, 10, seed=seed),
        "input": lambda: ExampleCanaries.random_inputs(num_canaries, (784,), 10, seed=seed),
    }[canary_kind]()
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)], name="audit_mlp")
    optimizer = optimizers.DPKerasSGD(
        l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
        learning_rate=learning_rate, momentum=0.9)
    return audit_training(
        model, x, y, canaries,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=optimizer, batch_size=batch_size, epochs=epochs, holdout=holdout,
        verbose=verbose)


def _builtin_data(num_examples, num_spare, data_dir, rng):
    """(train, spare, held-out) (x, y) pairs: Fashion-MNIST or generated."""
    if all(os.path.exists(os.path.join(data_dir, name)) for name in _IDX_FILES.values()):
        arrays = {key: _read_idx(os.path.join(data_dir, name))
                  for key, name in _IDX_FILES.items()}
        x_pool, y_pool = arrays["train_images"], arrays["train_labels"]
        x_test, y_test = arrays["test_images"][:1000], arrays["test_labels"][:1000]
    else:  # Ten noisy prototypes, one per class.
        prototypes = rng.random((10, 784))
        y_all = rng.integers(0, 10, num_examples + num_spare + 1000)
        x_all = np.clip(prototypes[y_all] + rng.normal(0, 0.5, (len(y_all), 784)), 0, 1)
        x_pool, y_pool = x_all[:-1000], y_all[:-1000]
        x_test, y_test = x_all[-1000:], y_all[-1000:]
    if not 0 < num_examples <= len(x_pool) - num_spare:
        raise ValueError(f"num_examples must be in [1, {len(x_pool) - num_spare}] "
                         f"(the pool minus the canaries); received {num_examples!r}.")
    order = rng.permutation(len(x_pool))
    train, spare = order[:num_examples], order[num_examples:num_examples + num_spare]

    def prepare(images, labels):
        return (images.reshape(len(images), -1) / 255.0 if images.dtype == np.uint8
                else images).astype(np.float32), labels.astype(np.int32)

    return (prepare(x_pool[train], y_pool[train]), prepare(x_pool[spare], y_pool[spare]),
            prepare(x_test, y_test))


_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


def _read_idx(path):
    """A gzipped IDX file of unsigned bytes (magic 0x00 0x00 0x08 ndim)."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    if data[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path} is not an IDX file of unsigned bytes.")
    ndim = data[3]
    shape = np.frombuffer(data, ">u4", count=ndim, offset=4)
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)
