"""Private text classification: a private vocabulary, a tuned learning rate,
and one epsilon for everything that touched the training reviews.

The reviews are generated, so it runs anywhere: words of a public word list
(some positive, some negative, most neutral) and, in every review, the name
of its writer, which no other review holds. A review is positive when it has
more positive than negative words.

1. The vocabulary: `keras_dp.adapt` releases the words many reviews hold;
   a writer's name, held by one review, is released with probability at
   most delta (`--public_vocabulary` uses the public word list instead).
2. The learning rate: `keras_dp.tuning.RandomSearch` trains a random number
   of models (mean `--mean_trials`) and keeps the best on held-out reviews,
   which stand for public data: the guarantee protects the training reviews.
3. The served model (vectorization + classifier) reports the epsilon of the
   vocabulary and the search composed.

Usage:
  python examples/private_vocabulary.py
  python examples/private_vocabulary.py --num_examples=1000 --epochs=1 --mean_trials=2
"""

import math
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if os.path.exists("/dev/nvidiactl") else "3")

from absl import app
from absl import flags
from absl import logging

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_dp  # noqa: E402
from keras_dp import tuning  # noqa: E402

_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 8000, "Training reviews.")
_EPOCHS = flags.DEFINE_integer("epochs", 4, "Training epochs of each trial.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "Expected Poisson batch size.")
_TRIAL_EPSILON = flags.DEFINE_float("trial_epsilon", 1.0, "Epsilon of one trial's training.")
_VOCABULARY_EPSILON = flags.DEFINE_float("vocabulary_epsilon", 0.5,
                                         "Epsilon of the vocabulary.")
_MEAN_TRIALS = flags.DEFINE_float("mean_trials", 4.0, "Mean number of trials of the search.")
_SHAPE = flags.DEFINE_float("shape", 1.0, "Shape of the number of trials (0, 1, inf).")
_DELTA = flags.DEFINE_float("delta", 1e-5, "Delta of each part, and of the total.")
_PUBLIC_VOCABULARY = flags.DEFINE_bool("public_vocabulary", False,
                                       "Use the public word list as the vocabulary.")
_SEED = flags.DEFINE_integer("seed", 1, "Seed of the data, the weights and the search.")

POSITIVE = [f"good{i}" for i in range(30)]
NEGATIVE = [f"bad{i}" for i in range(30)]
NEUTRAL = [f"word{i}" for i in range(300)]
WORDS = POSITIVE + NEGATIVE + NEUTRAL
LENGTH = 24
MAX_TOKENS = len(WORDS) + 2


def make_reviews(count, rng, first_writer=0):
    """Reviews (strings) and labels: more positive than negative words?

    A word is a sentiment word (positive or negative alike) with probability
    0.3, else a neutral word with Zipf frequencies: a few common, many rare.
    """
    zipf = 1.0 / np.arange(1, len(NEUTRAL) + 1)
    neutral = rng.choice(len(NEUTRAL), size=(count, LENGTH - 1), p=zipf / zipf.sum())
    sentiment = rng.integers(0, len(POSITIVE) + len(NEGATIVE), size=(count, LENGTH - 1))
    is_sentiment = rng.random((count, LENGTH - 1)) < 0.3
    picks = np.where(is_sentiment, sentiment, len(POSITIVE) + len(NEGATIVE) + neutral)
    positive = np.sum(picks < len(POSITIVE), axis=1)
    negative = np.sum(is_sentiment, axis=1) - positive
    keep = positive != negative
    texts = [" ".join([f"writer{first_writer + i}"] + [WORDS[w] for w in row])
             for i, row in enumerate(picks)]
    return np.array(texts)[keep], (positive > negative)[keep].astype("int32")


def vectorizer(texts):
    """The TextVectorization layer: a private or a public vocabulary."""
    if _PUBLIC_VOCABULARY.value:
        return keras.layers.TextVectorization(vocabulary=WORDS,
                                              output_sequence_length=LENGTH)
    layer = keras.layers.TextVectorization(max_tokens=MAX_TOKENS,
                                           output_sequence_length=LENGTH)
    keras_dp.adapt(layer, texts, epsilon=_VOCABULARY_EPSILON.value, delta=_DELTA.value,
                   max_tokens_per_example=LENGTH)
    return layer


def classifier_builder(noise_multiplier):
    """The hypermodel: a private bag of embeddings, its learning rate tuned."""
    def build(hp):
        keras.utils.set_random_seed(_SEED.value)
        ids = keras.Input((LENGTH,), dtype="int64")
        h = keras.layers.Embedding(MAX_TOKENS, 16)(ids)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras_dp.make_private(keras.Model(ids, keras.layers.Dense(2)(h)))
        model.compile(
            optimizer=keras_dp.DPKerasAdam(
                l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
                learning_rate=hp.Float("learning_rate", 1e-3, 3e-1, sampling="log")),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"])
        return model
    return build


def main(argv):
    del argv
    # dp_accounting's RDP warns of orders it skips (the epsilon is still valid).
    logging.set_verbosity(logging.ERROR)
    rng = np.random.default_rng(_SEED.value)
    x_train, y_train = make_reviews(_NUM_EXAMPLES.value, rng)
    x_held_out, y_held_out = make_reviews(2000, rng, first_writer=10 ** 6)
    x_test, y_test = make_reviews(4000, rng, first_writer=2 * 10 ** 6)

    vectorize = vectorizer(x_train)
    released = set(vectorize.get_vocabulary(include_special_tokens=False))
    names = sum(token.startswith("writer") for token in released)
    print(f"vocabulary: {len(released)} tokens, {names} of {len(x_train)} writers' names")

    noise_multiplier = keras_dp.calibrate_noise_multiplier(
        _TRIAL_EPSILON.value, len(x_train), _BATCH_SIZE.value, epochs=_EPOCHS.value,
        delta=_DELTA.value)
    tuner = tuning.RandomSearch(
        classifier_builder(noise_multiplier), objective="val_accuracy",
        mean_trials=_MEAN_TRIALS.value, shape=_SHAPE.value, seed=_SEED.value,
        directory=tempfile.mkdtemp(), project_name="private_vocabulary")
    ids = lambda texts: vectorize(texts).numpy()  # noqa: E731
    tuner.search(ids(x_train), y_train, epochs=_EPOCHS.value, batch_size=_BATCH_SIZE.value,
                 validation_data=(ids(x_held_out), y_held_out), verbose=0)
    best = tuner.get_best_models(1)[0]
    rate = tuner.get_best_hyperparameters(1)[0].get("learning_rate")

    # The served model: strings in, the vocabulary's release with it.
    texts = keras.Input((1,), dtype="string")
    served = keras_dp.make_private(keras.Model(texts, best(vectorize(texts))))
    delta = _DELTA.value
    search_epsilon, _ = tuner.privacy_spent(delta)
    total_epsilon, _ = served.privacy_spent(2 * delta if not _PUBLIC_VOCABULARY.value
                                            else delta)
    accuracy = float(np.mean(np.argmax(best.predict(ids(x_test), verbose=0), 1) == y_test))
    print(f"one trial: epsilon {_TRIAL_EPSILON.value:.2f}, noise multiplier "
          f"{noise_multiplier:.3f}")
    print(f"search: {tuner.num_trials} trials (mean {_MEAN_TRIALS.value:g}, shape "
          f"{_SHAPE.value:g}), best learning rate {rate:.4f}: epsilon {search_epsilon:.2f}")
    vocabulary = "public" if _PUBLIC_VOCABULARY.value else (
        f"private, epsilon {_VOCABULARY_EPSILON.value:.2f}")
    print(f"vocabulary {vocabulary}; everything: epsilon {total_epsilon:.2f} at delta "
          f"{2 * delta if not _PUBLIC_VOCABULARY.value else delta:g}")
    print(f"test accuracy: {accuracy:.4f}")
    if not math.isfinite(total_epsilon) or names:
        raise SystemExit("the guarantee did not hold")


if __name__ == "__main__":
    app.run(main)
