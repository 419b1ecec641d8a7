"""Private text classification with an LSTM, offline.

The task is generated, so it runs anywhere, and it needs the order of the
words: a review is a padded sequence of 8 to 32 word ids (id 0 is padding,
masked by the embedding); a twentieth of the vocabulary are positive words
and a twentieth negative ones, and the review's verdict is its LAST opinion
word (as in "bad acting, but a wonderful film"). The model (Embedding with
mask_zero, LSTM, Dense) trains with DP-SGD on the ghost clipping engine:
each example's gradient is clipped exactly, through time, in one forward and
one backward pass of the batch. The noise is calibrated for the target
epsilon. On 2 cores (2026-12-02, a loaded machine) the defaults reach test
accuracy 0.9899 at epsilon 2.99 (delta 1e-5) in under two minutes.

Usage:
  python examples/private_lstm.py
  python examples/private_lstm.py --num_examples=2000 --epochs=1   # smoke test
"""

import os
import sys

# TensorFlow's C++ log level: 2 hides its INFO and WARNING lines; on a machine
# without an NVIDIA GPU, 3 also hides the one ERROR it prints there, the GPU
# probe's "failed call to cuInit". Python warnings and exceptions still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if os.path.exists("/dev/nvidiactl") else "3")

from absl import app
from absl import flags

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_dp  # noqa: E402

_NUM_EXAMPLES = flags.DEFINE_integer(
    "num_examples", 50000, "Generated reviews (those with an opinion word train).")
_EPOCHS = flags.DEFINE_integer("epochs", 15, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 512, "Expected Poisson batch size.")
_UNITS = flags.DEFINE_integer("units", 32, "LSTM units.")
_TARGET_EPSILON = flags.DEFINE_float("target_epsilon", 3.0, "Privacy budget.")
_DELTA = flags.DEFINE_float("delta", 1e-5, "delta of the guarantee.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and the weights.")

VOCABULARY = 1000
LENGTH = 32
OPINIONS = VOCABULARY // 20  # Positive words: 1 .. 50; negative: the last 50 ids.


def make_reviews(count, rng):
    """Padded random reviews with at least one opinion word, and their verdicts."""
    words = rng.integers(1, VOCABULARY, size=(count, LENGTH))
    lengths = rng.integers(8, LENGTH + 1, size=count)
    words[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    positive = (words >= 1) & (words <= OPINIONS)
    negative = words >= VOCABULARY - OPINIONS
    opinion = positive | negative
    keep = opinion.any(axis=1)
    last = LENGTH - 1 - np.argmax(opinion[:, ::-1], axis=1)  # Position of the last opinion.
    verdict = positive[np.arange(count), last]
    return words[keep].astype("int32"), verdict[keep].astype("int32")


def build_model(units):
    tokens = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCABULARY, 32, mask_zero=True)(tokens)
    h = keras.layers.LSTM(units)(h)
    return keras.Model(tokens, keras.layers.Dense(2)(h), name="lstm_review_classifier")


def main(argv):
    del argv
    rng = np.random.default_rng(_SEED.value)
    x_train, y_train = make_reviews(_NUM_EXAMPLES.value, rng)
    x_test, y_test = make_reviews(5000, rng)
    noise_multiplier = keras_dp.calibrate_noise_multiplier(
        _TARGET_EPSILON.value, len(x_train), _BATCH_SIZE.value, epochs=_EPOCHS.value,
        delta=_DELTA.value)
    keras.utils.set_random_seed(_SEED.value)
    model = keras_dp.make_private(build_model(_UNITS.value))
    model.compile(optimizer=keras_dp.DPKerasAdam(l2_norm_clip=1.0,
                                                 noise_multiplier=noise_multiplier,
                                                 learning_rate=1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    print(f"{len(x_train)} reviews, noise multiplier {noise_multiplier:.3f}")
    model.fit(x_train, y_train, batch_size=_BATCH_SIZE.value, epochs=_EPOCHS.value,
              callbacks=[keras_dp.PrivacyCallback(delta=_DELTA.value)], verbose=2)
    print(f"clipping engine: {model.clipping_engine_in_use}")
    _, accuracy = model.evaluate(x_test, y_test, batch_size=1024, verbose=0)
    epsilon, _ = model.privacy_spent(_DELTA.value)
    print(f"test accuracy {accuracy:.4f} at epsilon {epsilon:.4f} (delta {_DELTA.value:g})")


if __name__ == "__main__":
    app.run(main)
