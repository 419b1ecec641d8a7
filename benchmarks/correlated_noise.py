"""Privacy-utility of correlated noise (banded MF) vs DP-SGD on Fashion-MNIST.

Trains the end-to-end tanh CNN of `examples/fashion_mnist.py` on the 60,000
training images with Poisson batches of expected size B, SGD with momentum,
flat clipping, once per (target epsilon, epochs, bands) in one process; each
run's noise multiplier is calibrated (RDP, delta 1e-5) for its own
accounting (`calibrate_noise_multiplier(..., bands=b)`), so all runs of a row
have the same epsilon and the same number of steps (B divides N into whole
cycles of every b). Fixed hyperparameters, none tuned on the test set; one
seed per run. Prints a Markdown table of test accuracy (docs/correlated_noise.md).

Usage:
  python benchmarks/correlated_noise.py                        # eps 3, 8; 1, 3 epochs
  python benchmarks/correlated_noise.py --epsilons=8 --epochs=1 --bands=1,4
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app
from absl import flags

import keras

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))
sys.path.insert(0, _ROOT)

import datasets  # noqa: E402
import fashion_mnist  # noqa: E402
import keras_dp  # noqa: E402

_EPSILONS = flags.DEFINE_list("epsilons", ["3", "8"], "Target epsilons.")
_EPOCHS = flags.DEFINE_list("epochs", ["1", "3"], "Epochs of each run.")
_BANDS = flags.DEFINE_list("bands", ["1", "2", "4", "8"], "Band counts; 1 is DP-SGD.")
_BATCH = flags.DEFINE_integer("batch_size", 500, "Expected batch size B.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 2.0, "SGD learning rate.")
_MOMENTUM = flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
_CLIP = flags.DEFINE_float("l2_norm_clip", 0.1, "Clipping norm C.")
_SEED = flags.DEFINE_integer("seed", 1, "Seed of the weights and the noise.")
_NO_NOISE = flags.DEFINE_bool("no_noise_row", False,
                              "Also train each number of epochs with clipping and no noise "
                              "(epsilon infinite): what the noise costs at all.")
_DELTA = 1e-5


def train_once(data, epsilon, epochs, bands):
    """Test accuracy, epsilon spent, noise multiplier, steps and wall time of
    one run (no noise for an infinite epsilon)."""
    (x, y), (x_test, y_test) = data
    sigma = 0.0 if epsilon == float("inf") else keras_dp.calibrate_noise_multiplier(
        epsilon, len(x), _BATCH.value, epochs, _DELTA, bands=bands)
    keras.utils.set_random_seed(_SEED.value)
    model = keras_dp.make_private(fashion_mnist.build_cnn())
    model.compile(
        optimizer=keras_dp.DPKerasSGD(
            l2_norm_clip=_CLIP.value, noise_multiplier=sigma, seed=_SEED.value,
            learning_rate=_LEARNING_RATE.value, momentum=_MOMENTUM.value,
            noise_correlation=keras_dp.BandedMF(bands=bands, steps=epochs * len(x)
                                                // _BATCH.value)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    start = time.time()
    model.fit(x, y, batch_size=_BATCH.value, epochs=epochs, verbose=0)
    seconds = time.time() - start
    spent = model.privacy_spent(_DELTA)[0]
    accuracy = model.evaluate(x_test, y_test, batch_size=2000, verbose=0)[1]
    return accuracy, spent, sigma, model.privacy_steps, seconds


def main(argv):
    del argv
    (x, y), (x_test, y_test) = datasets.load_fashion_mnist()
    data = ((fashion_mnist.prepare(x), y), (fashion_mnist.prepare(x_test), y_test))
    print("| target epsilon | epochs | bands | steps | noise multiplier | epsilon spent "
          "| test accuracy | train time |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    epsilons = list(map(float, _EPSILONS.value)) + ([float("inf")] if _NO_NOISE.value else [])
    for epsilon in epsilons:
        for epochs in map(int, _EPOCHS.value):
            for bands in map(int, _BANDS.value) if epsilon < float("inf") else [1]:
                accuracy, spent, sigma, steps, seconds = train_once(data, epsilon, epochs, bands)
                print(f"| {epsilon:g} | {epochs} | {bands} | {steps} | {sigma:.3f} "
                      f"| {spent:.3f} | {accuracy:.4f} | {seconds:.0f} s |", flush=True)


if __name__ == "__main__":
    app.run(main)
