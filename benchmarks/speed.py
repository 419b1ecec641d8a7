"""Training speed of private vs. non-private Keras, side by side in one run.

For one model, measures examples/second of:
  * non-private Keras training, with jit_compile=False and jit_compile=True;
  * the private model (keras_dp.make_private + DPKerasSGD, noise 1.1, clip 1.0),
    with jit_compile=False and jit_compile=True;
and prints each one's ratio to the best non-private configuration.

Data are random, of the model's input shape, and fixed across steps: only the
training step is timed (train_on_batch in a loop, after warm-up steps). The
configurations are timed in interleaved rounds and each keeps its best round,
so that load from other processes skews the ratios less.

Usage:
  python benchmarks/speed.py --model=cnn --batch_size=256 --steps=50
"""

import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_dp  # noqa: E402  (after the path set-up, to run from a checkout)

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "cnn", ["cnn", "mlp", "transformer"], "Model to time.")
flags.DEFINE_integer("batch_size", 256, "Examples per training step.")
flags.DEFINE_integer("steps", 50, "Timed training steps per configuration.")
flags.DEFINE_integer("warmup_steps", 3, "Untimed steps first (tracing, compilation).")
flags.DEFINE_integer("repeats", 3,
                     "Timed rounds; the configurations are interleaved in each round "
                     "and each one's best round is reported (robust to other load).")
flags.DEFINE_list("configs", "keras,keras_xla,private,private_xla",
                  "Configurations to time, among keras, keras_xla, private, private_xla.")
flags.DEFINE_float("noise_multiplier", 1.1, "Noise multiplier of the private runs.")
flags.DEFINE_float("l2_norm_clip", 1.0, "Clipping norm of the private runs.")
flags.DEFINE_integer("seed", 0, "Seed of the random data and weights.")

NUM_CLASSES = {"cnn": 10, "mlp": 10, "transformer": 2}
VOCAB_SIZE = 10000
SEQUENCE_LENGTH = 64


# ---------------------------------------------------------------- models


def cnn():
    """The Fashion-MNIST CNN of the DP-SGD literature (tanh activations)."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(10),
    ], name="cnn")


def mlp():
    """A 784-512-512-10 multilayer perceptron."""
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ], name="mlp")


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a `[B, T, D]` sequence."""

    def __init__(self, sequence_length, width, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = sequence_length
        self.width = width

    def build(self, input_shape):
        self.position_embeddings = self.add_weight(
            shape=(self.sequence_length, self.width), initializer="glorot_uniform",
            name="position_embeddings")

    def call(self, inputs):
        return inputs + self.position_embeddings[None, : keras.ops.shape(inputs)[1]]

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length,
                "width": self.width}


def transformer(num_blocks=2, width=64, num_heads=4, vocab_size=VOCAB_SIZE,
                sequence_length=SEQUENCE_LENGTH, num_classes=2):
    """A small pre-norm transformer text classifier (token ids to class logits)."""
    tokens = keras.Input((sequence_length,), dtype="int32")
    x = keras.layers.Embedding(vocab_size, width)(tokens)
    x = PositionEmbedding(sequence_length, width)(x)
    for _ in range(num_blocks):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.MultiHeadAttention(num_heads, key_dim=width // num_heads)(h, h)
        x = x + h
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(4 * width, activation="gelu")(h)
        h = keras.layers.Dense(width)(h)
        x = x + h
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Dense(num_classes)(x)
    return keras.Model(tokens, logits, name="transformer")


MODELS = {"cnn": cnn, "mlp": mlp, "transformer": transformer}


def random_batch(model_name, batch_size, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES[model_name], size=batch_size).astype("int32")
    if model_name == "cnn":
        return rng.random((batch_size, 28, 28, 1), dtype=np.float32), labels
    if model_name == "mlp":
        return rng.random((batch_size, 784), dtype=np.float32), labels
    tokens = rng.integers(0, VOCAB_SIZE, size=(batch_size, SEQUENCE_LENGTH))
    return tokens.astype("int32"), labels


# ---------------------------------------------------------------- timing


def build(model_name, config):
    """Returns the compiled model of one configuration."""
    keras.utils.set_random_seed(FLAGS.seed)
    model = MODELS[model_name]()
    private = config.startswith("private")
    if private:
        model = keras_dp.make_private(model)
        optimizer = keras_dp.DPKerasSGD(
            l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=FLAGS.noise_multiplier,
            learning_rate=0.01, seed=FLAGS.seed)
    else:
        optimizer = keras.optimizers.SGD(learning_rate=0.01)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=config.endswith("_xla"))
    return model


def timed_steps(model, x, y, steps):
    """Examples/second of `steps` train_on_batch calls on one fixed batch."""
    start = time.perf_counter()
    for _ in range(steps):
        logs = model.train_on_batch(x, y, return_dict=True)
    # Reading a value waits for the last step to finish.
    float(np.asarray(logs["loss"]))
    return steps * len(y) / (time.perf_counter() - start)


def report_failure(config, error):
    first_line = (str(error).strip().splitlines() or [""])[0]
    print(f"[{config}] failed: {type(error).__name__}: {first_line[:300]}",
          file=sys.stderr)


def machine_description():
    return (f"{os.cpu_count()} logical CPUs, "
            f"{'GPU' if tf.config.list_physical_devices('GPU') else 'no GPU'}, "
            f"{platform.machine()}, Python {platform.python_version()}, "
            f"TensorFlow {tf.__version__}, Keras {keras.__version__}")


def main(argv):
    del argv
    for config in FLAGS.configs:
        if config not in ("keras", "keras_xla", "private", "private_xla"):
            raise app.UsageError(f"unknown configuration {config!r} in --configs")
    x, y = random_batch(FLAGS.model, FLAGS.batch_size, FLAGS.seed)
    x, y = tf.constant(x), tf.constant(y)

    # Build and warm up every configuration first (tracing, XLA compilation).
    models = {}
    for config in FLAGS.configs:
        try:
            model = build(FLAGS.model, config)
            for _ in range(FLAGS.warmup_steps):
                model.train_on_batch(x, y)
            models[config] = model
        except Exception as error:  # Report and go on with the other configurations.
            report_failure(config, error)

    # Interleaved rounds: a burst of load from elsewhere hits one round, not
    # one configuration; each configuration keeps its best round.
    results = {config: None for config in FLAGS.configs}
    for _ in range(FLAGS.repeats):
        for config, model in models.items():
            try:
                speed = timed_steps(model, x, y, FLAGS.steps)
            except Exception as error:
                report_failure(config, error)
                continue
            results[config] = max(results[config] or 0.0, speed)

    non_private = [results.get(c) for c in ("keras", "keras_xla") if results.get(c)]
    best = max(non_private) if non_private else None

    print(f"\nmodel={FLAGS.model} batch_size={FLAGS.batch_size} steps={FLAGS.steps} "
          f"repeats={FLAGS.repeats} "
          f"({machine_description()})")
    print(f"{'configuration':<40} {'examples/s':>12} {'ratio to best non-private':>26}")
    labels = {
        "keras": "non-private Keras, jit_compile=False",
        "keras_xla": "non-private Keras, jit_compile=True",
        "private": "keras-dp private, jit_compile=False",
        "private_xla": "keras-dp private, jit_compile=True",
    }
    for config in FLAGS.configs:
        speed = results[config]
        speed_text = f"{speed:,.0f}" if speed else "failed"
        ratio_text = f"{speed / best:.3f}" if speed and best else "-"
        print(f"{labels[config]:<40} {speed_text:>12} {ratio_text:>26}")
    private = [results.get(c) for c in ("private", "private_xla") if results.get(c)]
    if private and best:
        print(f"best private / best non-private: {max(private) / best:.3f}")


if __name__ == "__main__":
    app.run(main)
