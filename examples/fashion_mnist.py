"""Trains a private Fashion-MNIST classifier with DP-SGD: accuracy and epsilon.

The default recipe (`make demo`) is ScatterNet features + a linear model:

1. A 2-D scattering transform (J = 2 scales, L = 8 orientations, fixed Morlet
   wavelets; `scattering.py`) turns each 28x28 image into 81 x 7 x 7
   features. It is data-independent, so it costs no privacy.
2. GroupNormalization (27 groups; per example, so no statistic of the
   training set is used) and one Dense layer are trained with DP-SGD:
   Poisson batches of expected size 8,192, clipping norm 0.1, noise
   calibrated with the PLD accountant for epsilon = 3 at delta = 1e-5 over
   40 epochs, SGD with
   learning rate 16 and momentum 0.9 (Tramer & Boneh, ICLR 2021).
3. The final weights are an exponential moving average (momentum 0.9) of
   the private iterates: post-processing, so it costs no privacy.

The data are the IDX files of the Debian package `dataset-fashion-mnist`
(`apt-get install dataset-fashion-mnist`). A random `--validation_fraction`
of the training images is held out (2% by default, to show progress; the
hyperparameters were chosen on a 10% split); the test images are evaluated
once, at the end. `--model=cnn` trains the end-to-end tanh CNN
instead (Tramer & Boneh's, 86% at epsilon 3 with their hyperparameters).

The last line printed is `test accuracy A at epsilon E (delta D)`.

Usage:
  python examples/fashion_mnist.py                                   # the recipe
  # A smoke test:
  python examples/fashion_mnist.py --num_examples=2000 --num_test_examples=1000 --epochs=1
  python examples/fashion_mnist.py --target_epsilon=1 --results=out.json --log_dir=logs
"""

import json
import os
import sys
import time

# TensorFlow's C++ log level: 2 hides its INFO and WARNING lines; on a machine
# without an NVIDIA GPU, 3 also hides the one ERROR it prints there, the GPU
# probe's "failed call to cuInit". Python warnings and exceptions still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if os.path.exists("/dev/nvidiactl") else "3")

from absl import app
from absl import flags

import keras
import numpy as np

_EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _EXAMPLES_DIR)
sys.path.insert(0, os.path.dirname(_EXAMPLES_DIR))  # keras_dp from a checkout.

import datasets  # noqa: E402
import keras_dp  # noqa: E402
import scattering  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    """Defines the command-line flags (only when run as a program, so that the
    module can be imported beside other absl programs)."""
    flags.DEFINE_string("data_dir", datasets.DEFAULT_DATA_DIR,
                        "Directory with the four Fashion-MNIST IDX .gz files.")
    flags.DEFINE_enum("model", "scatter_linear", ["scatter_linear", "cnn"],
                      "scatter_linear: GroupNorm + linear on scattering features; "
                      "cnn: the end-to-end tanh CNN on pixels.")
    flags.DEFINE_integer("epochs", 40, "Training epochs.")
    flags.DEFINE_integer("batch_size", 8192,
                         "Examples per DP-SGD step (expected size with Poisson sampling).")
    flags.DEFINE_enum("sampling", "poisson", ["poisson", "shuffle"],
                      "How batches are drawn. poisson: each example joins each batch "
                      "independently with probability batch_size / num_train, which the "
                      "amplified epsilon assumes. shuffle: fixed-size batches of a shuffled "
                      "pass, reported with the larger unamplified bound.")
    flags.DEFINE_float("target_epsilon", 3.0,
                       "Calibrate the noise multiplier so that training for --epochs "
                       "reaches this epsilon at --delta. Set to 0 to use "
                       "--noise_multiplier instead.")
    flags.DEFINE_float("noise_multiplier", None,
                       "sigma: the noise on the sum of clipped gradients has std sigma * C "
                       "(with --target_epsilon=0).")
    flags.DEFINE_float("l2_norm_clip", 0.1, "C: bound on each example's gradient norm "
                       "(the initial C with --clipping=adaptive).")
    flags.DEFINE_enum("clipping", "flat", ["flat", "adaptive", "normalize"],
                      "flat: clip to C; adaptive: keras_dp.AdaptiveClipping, C moves to "
                      "--target_quantile of the gradient norms, privately; normalize: "
                      "scale every gradient to C / (norm + 0.01).")
    flags.DEFINE_float("target_quantile", 0.5, "--clipping=adaptive: the quantile C tracks.")
    flags.DEFINE_float("normalize_gamma", 0.01,
                       "--clipping=normalize: gamma of C / (norm + gamma).")
    flags.DEFINE_float("learning_rate", 16.0, "SGD learning rate.")
    flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
    flags.DEFINE_float("ema", 0.9,
                       "If > 0, the final model is an exponential moving average of the "
                       "weights with this momentum (post-processing: no privacy cost); "
                       "0 keeps the last iterate.")
    flags.DEFINE_enum("accountant", "pld", ["rdp", "pld"],
                      "dp_accounting accountant for calibration and the reported epsilon.")
    flags.DEFINE_float("delta", 1e-5, "delta of the (epsilon, delta) guarantee.")
    flags.DEFINE_integer("num_examples", None,
                         "If set, train on a random subset of this many training images "
                         "(quick runs). The validation split is taken from it.")
    flags.DEFINE_integer("num_test_examples", None,
                         "If set, evaluate on the first this many test images (quick runs; "
                         "the reported test accuracy is then of those only).")
    flags.DEFINE_float("validation_fraction", 0.02,
                       "Fraction of the training images held out for validation (the "
                       "hyperparameters were chosen with 0.1).")
    flags.DEFINE_boolean("group_norm", False,
                         "cnn: add GroupNormalization after each convolution.")
    flags.DEFINE_string("results", None, "If set, write a JSON summary of the run here.")
    # --log_dir (defined by absl.logging, default empty): if set, TensorBoard
    # logs of the loss, accuracies and the privacy curve are written there.
    flags.DEFINE_integer("seed", 0, "Seed of the data split and weight initialisation.")
    flags.DEFINE_integer("verbose", 0,
                         "Keras fit verbosity (0, 1 or 2); one line per epoch is printed anyway.")


def build_scatter_linear(feature_shape):
    """GroupNorm (27 groups of 3 scattering channels) + a linear layer."""
    return keras.Sequential([
        keras.Input(feature_shape),
        keras.layers.GroupNormalization(groups=27, epsilon=1e-5),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ], name="scatter_linear")


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


def scattering_features(*image_sets):
    """Scattering features of each set of uint8 images, [N, 7, 7, 81]."""
    transform = scattering.Scattering2D(28)
    return [transform(images.astype(np.float32) / 255.0) for images in image_sets]


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
        if "l2_norm_clip" in logs:  # Adaptive clipping's C.
            parts.append(f"C {float(logs['l2_norm_clip']):.4g}")
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
    if FLAGS.num_test_examples is not None and not 0 < FLAGS.num_test_examples <= len(x_test):
        raise app.UsageError(f"--num_test_examples must be in [1, {len(x_test)}]; "
                             f"got {FLAGS.num_test_examples}.")
    x_test, y_test = x_test[:FLAGS.num_test_examples], y_test[:FLAGS.num_test_examples]
    if FLAGS.model == "cnn":
        x_train, x_val, x_test = prepare(x_train), prepare(x_val), prepare(x_test)
        build = lambda: build_cnn(FLAGS.group_norm)  # noqa: E731
    else:
        x_train, x_val, x_test = scattering_features(x_train, x_val, x_test)
        print(f"scattering features {x_train.shape[1:]} in {time.time() - start:.0f} s",
              flush=True)
        build = lambda: build_scatter_linear(x_train.shape[1:])  # noqa: E731
    num_train = len(x_train)
    noise_multiplier = choose_noise_multiplier(num_train)

    keras.utils.set_random_seed(FLAGS.seed)
    model = keras_dp.make_private(build())
    model.compile(optimizer=make_optimizer(noise_multiplier),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  # Weighted, so that the zero-weight padding rows of Poisson
                  # batches do not count in the training accuracy.
                  weighted_metrics=["accuracy"])
    privacy = keras_dp.PrivacyCallback(delta=FLAGS.delta, accountant=FLAGS.accountant,
                                       log_dir=FLAGS.log_dir or None)
    # PrivacyCallback first, so that `epsilon` is in the logs the others see.
    callbacks = [privacy, EpochPrinter()]
    if FLAGS.log_dir:
        callbacks.append(keras.callbacks.TensorBoard(FLAGS.log_dir))
    validation = dict(validation_data=(x_val, y_val) if len(x_val) else None,
                      validation_batch_size=2048)
    # In-memory data: the private fit() draws Poisson batches (or shuffles).
    model.fit(x_train, y_train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
              sampling=FLAGS.sampling, callbacks=callbacks, verbose=FLAGS.verbose,
              **validation)

    _, test_accuracy = model.evaluate(x_test, y_test, batch_size=2048, verbose=0)
    epsilon, _ = model.privacy_spent(FLAGS.delta, FLAGS.accountant)
    seconds = time.time() - start
    if FLAGS.results:
        write_results(FLAGS.results, model, test_accuracy, epsilon, noise_multiplier,
                      num_train, len(x_val), seconds)
    print(f"{FLAGS.sampling} sampling, {FLAGS.accountant} accountant, wall time "
          f"{seconds:.1f} s", flush=True)
    print(f"test accuracy {test_accuracy:.4f} at epsilon {epsilon:.4f} "
          f"(delta {FLAGS.delta:g})", flush=True)
    return 0


def choose_noise_multiplier(num_train):
    """sigma from --noise_multiplier, or calibrated for the steps fit will run."""
    if not FLAGS.target_epsilon:
        if FLAGS.noise_multiplier is None:
            raise app.UsageError("Give --target_epsilon or --noise_multiplier.")
        noise_multiplier = FLAGS.noise_multiplier
    else:
        noise_multiplier = keras_dp.calibrate_noise_multiplier(
            target_epsilon=FLAGS.target_epsilon, num_examples=num_train,
            batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, delta=FLAGS.delta,
            accountant=FLAGS.accountant, sampling=FLAGS.sampling)
    print(f"training on {num_train} examples; {FLAGS.sampling} batches of "
          f"{FLAGS.batch_size}, noise multiplier {noise_multiplier:.4f}, clip "
          f"{FLAGS.l2_norm_clip} ({FLAGS.clipping}), lr {FLAGS.learning_rate}, "
          f"momentum {FLAGS.momentum}, {FLAGS.epochs} epochs", flush=True)
    return noise_multiplier


def make_optimizer(noise_multiplier):
    ema = dict(use_ema=True, ema_momentum=FLAGS.ema) if FLAGS.ema else {}
    l2_norm_clip = FLAGS.l2_norm_clip
    if FLAGS.clipping == "adaptive":
        l2_norm_clip = keras_dp.AdaptiveClipping(l2_norm_clip,
                                                 target_quantile=FLAGS.target_quantile)
    return keras_dp.DPKerasSGD(
        l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
        clipping="normalize" if FLAGS.clipping == "normalize" else "flat",
        normalize_gamma=FLAGS.normalize_gamma,
        learning_rate=FLAGS.learning_rate, momentum=FLAGS.momentum, **ema)


def write_results(path, model, test_accuracy, epsilon, noise_multiplier, num_train,
                  num_validation, seconds):
    hyperparameters = {name: FLAGS[name].value for name in (
        "model", "epochs", "batch_size", "sampling", "target_epsilon", "l2_norm_clip",
        "clipping", "target_quantile", "normalize_gamma", "learning_rate", "momentum", "ema",
        "seed", "validation_fraction")}
    results = dict(test_accuracy=test_accuracy, epsilon=epsilon, delta=FLAGS.delta,
                   accountant=FLAGS.accountant, noise_multiplier=noise_multiplier,
                   num_train=num_train, num_validation=num_validation,
                   final_l2_norm_clip=model.optimizer.l2_norm_clip,
                   hyperparameters=hyperparameters, wall_time_seconds=seconds)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
