"""Private text classification with an Embedding + transformer block, offline.

The task is generated, so it runs anywhere: reviews are sequences of word
ids; a tenth of the vocabulary are positive words and a tenth negative ones,
and a review is positive when it has more positive than negative words. The
model (token embedding, self-attention, layer normalization, a feed-forward
block, pooling) trains with DP-SGD on the ghost clipping engine, with noise
calibrated for the target epsilon.

Usage:
  python examples/text_classification.py
  python examples/text_classification.py --num_examples=2000 --epochs=1   # smoke test
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

_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 20000, "Training reviews.")
_EPOCHS = flags.DEFINE_integer("epochs", 8, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 512, "Expected Poisson batch size.")
_TARGET_EPSILON = flags.DEFINE_float("target_epsilon", 3.0, "Privacy budget.")
_DELTA = flags.DEFINE_float("delta", 1e-5, "delta of the guarantee.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and the weights.")

VOCABULARY = 1000
LENGTH = 32


def make_reviews(count, rng):
    """Random reviews and their labels: more positive than negative words?"""
    words = rng.integers(0, VOCABULARY, size=(count, LENGTH))
    positive = np.sum(words < VOCABULARY // 10, axis=1)
    negative = np.sum(words >= VOCABULARY - VOCABULARY // 10, axis=1)
    keep = positive != negative  # Ties have no label.
    return words[keep].astype("int32"), (positive > negative)[keep].astype("int32")


def build_model(width=32, heads=2):
    tokens = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCABULARY, width)(tokens)
    attended = keras.layers.MultiHeadAttention(heads, width // heads)(h, h)
    h = keras.layers.LayerNormalization()(h + attended)
    feed_forward = keras.layers.Dense(width, activation="gelu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(width)(feed_forward))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(2)(h), name="review_classifier")


def main(argv):
    del argv
    rng = np.random.default_rng(_SEED.value)
    x_train, y_train = make_reviews(_NUM_EXAMPLES.value, rng)
    x_test, y_test = make_reviews(5000, rng)
    noise_multiplier = keras_dp.calibrate_noise_multiplier(
        _TARGET_EPSILON.value, len(x_train), _BATCH_SIZE.value, epochs=_EPOCHS.value,
        delta=_DELTA.value)
    keras.utils.set_random_seed(_SEED.value)
    model = keras_dp.make_private(build_model())
    model.compile(optimizer=keras_dp.DPKerasAdam(l2_norm_clip=1.0,
                                                 noise_multiplier=noise_multiplier,
                                                 learning_rate=1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    print(f"{len(x_train)} reviews, noise multiplier {noise_multiplier:.3f}")
    model.fit(x_train, y_train, batch_size=_BATCH_SIZE.value, epochs=_EPOCHS.value,
              callbacks=[keras_dp.PrivacyCallback(delta=_DELTA.value)], verbose=2)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=1024, verbose=0)
    epsilon, _ = model.privacy_spent(_DELTA.value)
    print(f"test accuracy {accuracy:.4f} at epsilon {epsilon:.4f} (delta {_DELTA.value:g})")


if __name__ == "__main__":
    app.run(main)
