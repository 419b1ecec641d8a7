"""Trains the Fashion-MNIST CNN with DP-SGD and reports accuracy and epsilon.

The data are the IDX files of the Debian package `dataset-fashion-mnist`
(`apt-get install dataset-fashion-mnist`). A random `--validation_fraction`
of the training images is held out: tune hyperparameters on the validation
accuracy, and look at the test accuracy only once, at the end.

Batches are Poisson samples (the private `fit()`'s default), the sampling
that the privacy accountant's amplification assumes. The epsilon covers the
training examples; the validation and test images are never trained on (the
validation accuracy used for tuning is not itself private).

Usage:
  python examples/fashion_mnist.py                          # default run, a few minutes
  python examples/fashion_mnist.py --num_examples=2000 --epochs=1   # smoke test
  python examples/fashion_mnist.py --target_epsilon=3 --epochs=10   # calibrate sigma
"""

import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags

import keras
import numpy as np

_EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _EXAMPLES_DIR)
sys.path.insert(0, os.path.dirname(_EXAMPLES_DIR))  # keras_dp from a checkout.

import datasets  # noqa: E402
import keras_dp  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    """Defines the command-line flags (only when run as a program, so that the
    module can be imported beside other absl programs)."""
    flags.DEFINE_string("data_dir", datasets.DEFAULT_DATA_DIR,
                        "Directory with the four Fashion-MNIST IDX .gz files.")
    flags.DEFINE_integer("epochs", 3, "Training epochs.")
    flags.DEFINE_integer("batch_size", 1024,
                         "Examples per DP-SGD step (expected size with Poisson sampling).")
    flags.DEFINE_enum("sampling", "poisson", ["poisson", "shuffle"],
                      "How batches are drawn. poisson: each example joins each batch "
                      "independently with probability batch_size / num_train, which the "
                      "amplified epsilon assumes. shuffle: fixed-size batches of a shuffled "
                      "pass, reported with the larger unamplified bound.")
    flags.DEFINE_float("noise_multiplier", 1.3,
                       "sigma: the noise on the sum of clipped gradients has std sigma * C. "
                       "Ignored when --target_epsilon is set.")
    flags.DEFINE_float("l2_norm_clip", 1.0, "C: bound on each example's gradient norm.")
    flags.DEFINE_float("learning_rate", 0.6, "SGD learning rate.")
    flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
    flags.DEFINE_float("delta", 1e-5, "delta of the (epsilon, delta) guarantee.")
    flags.DEFINE_float("target_epsilon", None,
                       "If set, calibrate the noise multiplier so that training for "
                       "--epochs reaches this epsilon at --delta.")
    flags.DEFINE_integer("num_examples", None,
                         "If set, train on a random subset of this many training images "
                         "(quick runs). The validation split is taken from it.")
    flags.DEFINE_float("validation_fraction", 0.1,
                       "Fraction of the training images held out for validation.")
    flags.DEFINE_boolean("group_norm", False,
                         "Add GroupNormalization after each convolution.")
    flags.DEFINE_boolean("jit_compile", False, "Compile the training step with XLA.")
    # --log_dir (defined by absl.logging, default empty): if set, the privacy
    # callback writes TensorBoard logs of epsilon there.
    flags.DEFINE_integer("seed", 0, "Seed of the data split and weight initialisation.")
    flags.DEFINE_integer("verbose", 0,
                         "Keras fit verbosity (0, 1 or 2); one line per epoch is printed anyway.")


def build_cnn(group_norm=False):
    """conv16 8x8/2 - maxpool 2/1 - conv32 4x4/2 - maxpool 2/1 - dense32 - dense10, tanh."""
    def normalize():
        # Per-example normalization: safe for DP-SGD (BatchNormalization is not).
        return [keras.layers.GroupNormalization(groups=4)] if group_norm else []

    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 8, strides=2, padding="same"),
        *normalize(),
        keras.layers.Activation("tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Conv2D(32, 4, strides=2, padding="valid"),
        *normalize(),
        keras.layers.Activation("tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(10),
    ], name="fashion_mnist_cnn")


def prepare(images):
    """uint8 [N, 28, 28] to float32 [N, 28, 28, 1] in [-1, 1] (data-independent)."""
    return (images.astype(np.float32) / 127.5 - 1.0)[..., None]


def split_data(x, y, num_examples, validation_fraction, seed):
    """Optionally subsamples, then holds out a random validation split."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    if num_examples is not None:
        if not 0 < num_examples <= len(x):
            raise app.UsageError(
                f"--num_examples must be in [1, {len(x)}]; got {num_examples}.")
        order = order[:num_examples]
    num_validation = int(round(validation_fraction * len(order)))
    validation, train = order[:num_validation], order[num_validation:]
    return (x[train], y[train]), (x[validation], y[validation])


class EpochPrinter(keras.callbacks.Callback):
    """Prints one line per epoch: accuracies and epsilon so far."""

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.time()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        parts = [f"epoch {epoch + 1}/{self.params.get('epochs', '?')}"]
        for key, name in (("loss", "loss"),
                          ("accuracy", "train accuracy"),
                          ("val_accuracy", "validation accuracy"),
                          ("epsilon", "epsilon")):
            if key in logs:
                parts.append(f"{name} {float(logs[key]):.4f}")
        parts.append(f"{time.time() - self._start:.1f} s")
        print(", ".join(parts), flush=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    start = time.time()
    try:
        (x_train, y_train), (x_test, y_test) = datasets.load_fashion_mnist(FLAGS.data_dir)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    (x_train, y_train), (x_val, y_val) = split_data(
        x_train, y_train, FLAGS.num_examples, FLAGS.validation_fraction, FLAGS.seed)
    x_train, x_val, x_test = prepare(x_train), prepare(x_val), prepare(x_test)
    num_train = len(x_train)

    noise_multiplier = FLAGS.noise_multiplier
    if FLAGS.target_epsilon is not None:
        # fit(epochs=E) runs E * ceil(N / B) steps: calibrate for exactly those.
        noise_multiplier = keras_dp.calibrate_noise_multiplier(
            target_epsilon=FLAGS.target_epsilon, num_examples=num_train,
            batch_size=FLAGS.batch_size, epochs=None, delta=FLAGS.delta,
            sampling=FLAGS.sampling,
            steps=FLAGS.epochs * math.ceil(num_train / FLAGS.batch_size))
        print(f"calibrated noise multiplier {noise_multiplier:.4f} for epsilon "
              f"{FLAGS.target_epsilon} at delta {FLAGS.delta:g} over {FLAGS.epochs} "
              "epochs")
    print(f"training on {num_train} examples, validating on {len(x_val)}, "
          f"testing on {len(x_test)}; {FLAGS.sampling} batches of "
          f"{FLAGS.batch_size}, noise multiplier {noise_multiplier:.4f}, "
          f"clip {FLAGS.l2_norm_clip}, lr {FLAGS.learning_rate}, "
          f"momentum {FLAGS.momentum}", flush=True)

    keras.utils.set_random_seed(FLAGS.seed)
    model = keras_dp.make_private(build_cnn(FLAGS.group_norm))
    optimizer = keras_dp.DPKerasSGD(
        l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=noise_multiplier,
        learning_rate=FLAGS.learning_rate, momentum=FLAGS.momentum)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  # Weighted, so that the zero-weight padding rows of Poisson
                  # batches do not count in the training accuracy.
                  weighted_metrics=["accuracy"], jit_compile=FLAGS.jit_compile)

    # First in the list, so that `epsilon` is in the logs the printer sees.
    privacy = keras_dp.PrivacyCallback(
        delta=FLAGS.delta, num_examples=num_train, target_epsilon=FLAGS.target_epsilon,
        log_dir=FLAGS.log_dir or None)
    callbacks = [privacy, EpochPrinter()]
    validation = dict(validation_data=(x_val, y_val) if len(x_val) else None,
                      validation_batch_size=1024)
    # In-memory data: the private fit() draws Poisson batches (or shuffles).
    model.fit(x_train, y_train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
              sampling=FLAGS.sampling, callbacks=callbacks, verbose=FLAGS.verbose,
              **validation)

    _, test_accuracy = model.evaluate(x_test, y_test, batch_size=1024, verbose=0)
    print(f"final: test accuracy {test_accuracy:.4f}, epsilon {privacy.epsilon:.4f} "
          f"(delta {FLAGS.delta:g}, {FLAGS.sampling} sampling), "
          f"wall time {time.time() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
