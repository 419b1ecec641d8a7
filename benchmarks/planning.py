"""Your settings against keras_dp.plan's, on two keras-io-like text programs at epsilon 3.

Issue 46: keras-io text programs made private at epsilon 3 as a new user
would (a 20,000 x 128 embedding trained from scratch, a few thousand
examples, batch 32) ended at chance. This benchmark runs two of them on
generated data of the same layout, each three ways:

  keras    non-private Keras, the program's own settings (is the task learnable?)
  yours    make_private + DPKerasAdam, the program's batch size and epochs,
           noise calibrated for the target epsilon
  plan     keras_dp.plan(model, ..., batch_size, epochs): its batch size,
           epochs, noise multiplier and learning rate

`--notrainable_embedding` freezes the embedding at its random
initialisation, the first fix the warning names (fewer trainable weights).

The programs (keras-io's layers and settings, Adam at learning rate 1e-3):

  bilstm   "Bidirectional LSTM on IMDB": Embedding(20000, 128), two
           Bidirectional(LSTM(64)), Dense(1); 200 tokens; batch 32, 2 epochs
  cnn      "Text classification from scratch": Embedding(20000, 128),
           Dropout(0.5), two Conv1D(128, 7, strides 3), GlobalMaxPooling1D,
           Dense(128), Dropout(0.5), Dense(1); 500 tokens; batch 32, 3 epochs

The data: reviews of word ids drawn from a Zipf law over the vocabulary,
in which a positive review mentions one of 50 positive words about once in
12 tokens and one of 50 negative words once in 64, at random places, and a
negative review the other way round. Printed
per run: batch size, epochs, steps, noise multiplier, noise-to-signal
(sigma * sqrt(d) / B), whether `keras_dp.PrivacyUtilityWarning` was
issued, epsilon (RDP, from the model's ledger), test accuracy and the
training time.

Usage:
  python benchmarks/planning.py
  python benchmarks/planning.py --programs=bilstm --notrainable_embedding
  python benchmarks/planning.py --programs=bilstm --num_examples=256 --num_test=128 \\
      --sequence_length=64 --vocabulary=500       # smoke test
"""

import os
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402

import keras_dp  # noqa: E402
from keras_dp import planning  # noqa: E402

FLAGS = flags.FLAGS

# keras-io's settings of each program: tokens, batch size, epochs.
PROGRAMS = {"bilstm": (200, 32, 2), "cnn": (500, 32, 3)}
RUNS = ("keras", "yours", "plan")
# 50 positive and 50 negative words, from the 10th most frequent on (odd ids
# negative); a review mentions its own about once in 12 tokens (16 in 200) and
# the other once in 64 (3 in 200).
_FIRST_SENTIMENT_WORD, _SENTIMENT_WORDS = 10, 50
_OWN_MENTIONS, _OTHER_MENTIONS = 0.08, 0.015
_LEARNING_RATE = 1e-3
_L2_NORM_CLIP = 1.0


def define_flags():
    """The benchmark's flags (only when run as a program)."""
    flags.DEFINE_list("programs", list(PROGRAMS), "Programs to run: bilstm, cnn.")
    flags.DEFINE_integer("num_examples", 2000, "Training reviews N.")
    flags.DEFINE_integer("num_test", 1000, "Test reviews.")
    flags.DEFINE_integer("vocabulary", 20000, "Vocabulary size (keras-io: 20,000).")
    flags.DEFINE_integer("sequence_length", None,
                         "Tokens per review; default the program's (200, 500).")
    flags.DEFINE_float("target_epsilon", 3.0, "Privacy budget of the private runs.")
    flags.DEFINE_boolean("trainable_embedding", True,
                         "False freezes the embedding at its random initialisation: the "
                         "first fix for a run that drowns, fewer trainable weights.")
    flags.DEFINE_integer("seed", 0, "Seed of the data and the weights.")


def make_reviews(count, length, vocabulary, rng):
    """Reviews of Zipf-distributed filler words with words of their sentiment
    and fewer of the other at random places, and their labels."""
    sentiment = np.arange(_FIRST_SENTIMENT_WORD, _FIRST_SENTIMENT_WORD + 2 * _SENTIMENT_WORDS)
    filler = np.setdiff1d(np.arange(1, vocabulary), sentiment)
    frequency = 1.0 / np.arange(1, len(filler) + 1)
    words = rng.choice(filler, size=(count, length), p=frequency / frequency.sum())
    labels = rng.integers(0, 2, count)
    for review, label in zip(words, labels):
        own, other = sentiment[label::2], sentiment[1 - label::2]
        mentions = rng.poisson((_OWN_MENTIONS * length, _OTHER_MENTIONS * length))
        places = rng.choice(length, min(mentions.sum(), length), replace=False)
        review[places] = np.concatenate([rng.choice(own, mentions[0]),
                                         rng.choice(other, mentions[1])])[:len(places)]
    return words.astype("int32"), labels.astype("float32")


def build(program, length, vocabulary):
    """The keras-io program's model (see the module docstring)."""
    keras.utils.set_random_seed(FLAGS.seed)
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, 128, trainable=FLAGS.trainable_embedding)(tokens)
    if program == "bilstm":
        h = keras.layers.Bidirectional(keras.layers.LSTM(64, return_sequences=True))(h)
        h = keras.layers.Bidirectional(keras.layers.LSTM(64))(h)
    else:
        h = keras.layers.Dropout(0.5)(h)
        for _ in range(2):
            h = keras.layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(h)
        h = keras.layers.GlobalMaxPooling1D()(h)
        h = keras.layers.Dense(128, activation="relu")(h)
        h = keras.layers.Dropout(0.5)(h)
    return keras.Model(tokens, keras.layers.Dense(1, activation="sigmoid")(h))


def settings(program, model, num_examples, delta):
    """{run: (batch size, epochs, noise multiplier, learning rate)}."""
    _, batch_size, epochs = PROGRAMS[program]
    sigma = keras_dp.calibrate_noise_multiplier(FLAGS.target_epsilon, num_examples,
                                                batch_size, epochs, delta)
    private = make_private(model, sigma, _LEARNING_RATE)
    plan = keras_dp.plan(private, num_examples=num_examples,
                         target_epsilon=FLAGS.target_epsilon, delta=delta,
                         batch_size=batch_size, epochs=epochs)
    print(plan, flush=True)
    return {"keras": (batch_size, epochs, 0.0, _LEARNING_RATE),
            "yours": (batch_size, epochs, sigma, _LEARNING_RATE),
            "plan": (plan.batch_size, plan.epochs, plan.noise_multiplier, plan.learning_rate)}


def make_private(model, noise_multiplier, learning_rate):
    private = keras_dp.make_private(model)
    private.compile(optimizer=keras_dp.DPKerasAdam(
        l2_norm_clip=_L2_NORM_CLIP, noise_multiplier=noise_multiplier,
        learning_rate=learning_rate), loss="binary_crossentropy", metrics=["accuracy"])
    return private


def run(program, name, setting, train, test, delta):
    """Trains one run; returns its row of the table."""
    batch_size, epochs, sigma, learning_rate = setting
    length = train[0].shape[1]
    model = build(program, length, FLAGS.vocabulary)
    if name == "keras":
        model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                      loss="binary_crossentropy", metrics=["accuracy"])
    else:
        model = make_private(model, sigma, learning_rate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", keras_dp.PrivacyUtilityWarning)
        start = time.perf_counter()
        model.fit(*train, batch_size=batch_size, epochs=epochs, verbose=0)
        seconds = time.perf_counter() - start
    warned = any(issubclass(w.category, keras_dp.PrivacyUtilityWarning) for w in caught)
    _, accuracy = model.evaluate(*test, batch_size=256, verbose=0)
    if name == "keras":
        return (name, batch_size, epochs, "", "", "", "", "", accuracy, seconds)
    ratio = planning.model_noise_to_signal(model, batch_size)
    epsilon, _ = model.privacy_spent(delta)
    return (name, batch_size, epochs, model.privacy_steps, f"{sigma:.3f}", f"{ratio:.1f}",
            "yes" if warned else "no", f"{epsilon:.3f}", accuracy, seconds)


def main(argv):
    del argv
    # dp_accounting logs each RDP order it cannot evaluate; the epsilon is sound without them.
    logging.set_verbosity(logging.ERROR)
    unknown = set(FLAGS.programs) - set(PROGRAMS)
    if unknown:
        raise app.UsageError(f"--programs takes {', '.join(PROGRAMS)}; got {FLAGS.programs}.")
    rng = np.random.default_rng(FLAGS.seed)
    num_examples = FLAGS.num_examples
    delta = keras_dp.default_delta(num_examples)
    header = ("| program | run | batch | epochs | steps | sigma | noise-to-signal | warned | "
              "epsilon | test accuracy | time (s) |")
    rows = []
    for program in FLAGS.programs:
        length = FLAGS.sequence_length or PROGRAMS[program][0]
        x, y = make_reviews(num_examples + FLAGS.num_test, length, FLAGS.vocabulary, rng)
        train = (x[:num_examples], y[:num_examples])
        test = (x[num_examples:], y[num_examples:])
        model = build(program, length, FLAGS.vocabulary)
        for name, setting in settings(program, model, num_examples, delta).items():
            row = run(program, name, setting, train, test, delta)
            rows.append((program, *row))
            print(_row_text(rows[-1]), flush=True)
    print(f"\nepsilon {FLAGS.target_epsilon:g}, delta {delta:.3g}, {num_examples} training "
          f"and {len(test[0])} test reviews, vocabulary {FLAGS.vocabulary}, embedding "
          f"{'trained' if FLAGS.trainable_embedding else 'frozen'}")
    print(header)
    print("|" + " --- |" * header.count(" | ") + " --- |")
    for row in rows:
        print(_row_text(row))


def _row_text(row):
    *head, accuracy, seconds = row
    return "| " + " | ".join(str(v) for v in head) + f" | {accuracy:.4f} | {seconds:.0f} |"


if __name__ == "__main__":
    define_flags()
    app.run(main)
