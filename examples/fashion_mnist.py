"""Trains the Fashion-MNIST CNN with DP-SGD and reports accuracy and epsilon.

The data are the IDX files of the Debian package `dataset-fashion-mnist`
(`apt-get install dataset-fashion-mnist`). The last `--validation_size`
training images are held out: tune hyperparameters on the validation
accuracy, and look at the test accuracy only once, at the end.

The epsilon counts the training examples only; the validation images are not
trained on, and the test images are never touched by training.

Usage:
  python examples/fashion_mnist.py                          # default run, a few minutes
  python examples/fashion_mnist.py --num_examples=2000 --epochs=1   # smoke test
  python examples/fashion_mnist.py --target_epsilon=3 --epochs=10   # calibrate sigma
"""

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
flags.DEFINE_string("data_dir", datasets.DEFAULT_DATA_DIR,
                    "Directory with the four Fashion-MNIST IDX .gz files.")
flags.DEFINE_integer("epochs", 3, "Training epochs.")
flags.DEFINE_integer("batch_size", 256, "Examples per DP-SGD step.")
flags.DEFINE_float("noise_multiplier", 1.1,
                   "sigma: the noise on the sum of clipped gradients has std sigma * C. "
                   "Ignored when --target_epsilon is set.")
flags.DEFINE_float("l2_norm_clip", 1.0, "C: bound on each example's gradient norm.")
flags.DEFINE_float("learning_rate", 0.5, "SGD learning rate.")
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
flags.DEFINE_integer("verbose", 2, "Keras fit verbosity (0, 1 or 2).")


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
        for key, name in (("accuracy", "train accuracy"),
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
        noise_multiplier = keras_dp.calibrate_noise_multiplier(
            target_epsilon=FLAGS.target_epsilon, num_examples=num_train,
            batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, delta=FLAGS.delta)
        print(f"calibrated noise multiplier {noise_multiplier:.4f} for epsilon "
              f"{FLAGS.target_epsilon} at delta {FLAGS.delta} over {FLAGS.epochs} epochs")
    print(f"training on {num_train} examples, validating on {len(x_val)}, "
          f"testing on {len(x_test)}; batch {FLAGS.batch_size}, "
          f"noise multiplier {noise_multiplier:.4f}, clip {FLAGS.l2_norm_clip}, "
          f"lr {FLAGS.learning_rate}, momentum {FLAGS.momentum}", flush=True)

    keras.utils.set_random_seed(FLAGS.seed)
    model = keras_dp.make_private(build_cnn(FLAGS.group_norm))
    optimizer = keras_dp.DPKerasSGD(
        l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=noise_multiplier,
        learning_rate=FLAGS.learning_rate, momentum=FLAGS.momentum)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=FLAGS.jit_compile)

    privacy = keras_dp.PrivacyCallback(
        delta=FLAGS.delta, num_examples=num_train, target_epsilon=FLAGS.target_epsilon,
        log_dir=FLAGS.log_dir or None)
    validation_data = (x_val, y_val) if len(x_val) else None
    # The privacy callback comes first so that `epsilon` is in the logs printed.
    history = model.fit(x_train, y_train, batch_size=FLAGS.batch_size,
                        epochs=FLAGS.epochs, validation_data=validation_data,
                        callbacks=[privacy, EpochPrinter()], verbose=FLAGS.verbose)

    epsilons = history.history.get("epsilon")
    epsilon = float(epsilons[-1]) if epsilons else keras_dp.compute_epsilon(
        num_examples=num_train, batch_size=FLAGS.batch_size,
        noise_multiplier=noise_multiplier, delta=FLAGS.delta, epochs=FLAGS.epochs)
    _, test_accuracy = model.evaluate(x_test, y_test, batch_size=1024, verbose=0)
    print(f"final: test accuracy {test_accuracy:.4f}, epsilon {epsilon:.4f} "
          f"(delta {FLAGS.delta:g}), wall time {time.time() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    app.run(main)
