"""What a fuzz program is made of: its data, its layers and models, its tf.data pipelines.

Everything here is deterministic given the program: the two sensitivity
runs (D and D + z) and the accounting run build the same objects.
"""

import keras
import numpy as np
import tensorflow as tf

FEATURES = 8
# Targets far from what a tiny model predicts: every example's gradient is
# clipped, so one example can move the clipped sum by the whole of C.
TARGET_SCALE = 50.0


def dataset(program):
    """(x, y) of N + 1 rows: D is the first N, z is row N (the last)."""
    rng = np.random.default_rng(program.seed)
    x = rng.normal(size=(program.n + 1, FEATURES)).astype("float32")
    if program.nan_rows:
        rows = rng.choice(program.n + 1, size=program.nan_rows, replace=False)
        x[rows, rng.integers(0, FEATURES, size=program.nan_rows)] = np.nan
    y = (TARGET_SCALE * rng.normal(size=(program.n + 1, 1))).astype("float32")
    return x, y


# ------------------------------------------------------------------ layers


@keras.saving.register_keras_serializable(package="keras_dp_fuzz")
class Scale(keras.layers.Layer):
    """A custom layer with one weight per feature (no norm function is registered)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


@tf.custom_gradient
def _doubled_gradient(x):
    return tf.identity(x), lambda dy: 2.0 * dy


@keras.saving.register_keras_serializable(package="keras_dp_fuzz")
class CustomGradient(keras.layers.Layer):
    """Identity forward, doubled gradient backward (a tf.custom_gradient)."""

    def call(self, x):
        return _doubled_gradient(x)


@keras.saving.register_keras_serializable(package="keras_dp_fuzz")
class CarriedMax(keras.layers.Layer):
    """Keeps the batch's largest features in a weight when training, and adds
    the kept ones of the batch before: un-noised state (saved, and read by
    the next step), which keras-dp must refuse before any weight changes."""

    def build(self, input_shape):
        self.kept = self.add_weight(shape=(input_shape[-1],), initializer="zeros",
                                    trainable=False)

    def call(self, x, training=None):
        if not training:
            return x
        out = x + self.kept
        self.kept.assign(tf.reduce_max(x, axis=0))
        return out


def _batch_mean_mix(x):
    return x - keras.ops.mean(x, axis=0, keepdims=True)


def _impute_batch_mean(x):
    finite = tf.math.is_finite(x)
    zeroed = tf.where(finite, x, tf.zeros_like(x))
    count = tf.maximum(tf.reduce_sum(tf.cast(finite, x.dtype), 0, keepdims=True), 1.0)
    return tf.where(finite, x, tf.reduce_sum(zeroed, 0, keepdims=True) / count)


LAYERS = {
    "dense": lambda: keras.layers.Dense(4),
    "dense_tanh": lambda: keras.layers.Dense(4, activation="tanh"),
    "scale": Scale,
    "custom_gradient": CustomGradient,
    "layer_norm": lambda: keras.layers.LayerNormalization(),
    "batch_mean_mix": lambda: keras.layers.Lambda(_batch_mean_mix),
    "impute_batch_mean": lambda: keras.layers.Lambda(_impute_batch_mean),
}


# Layers keeping values of the batch beyond the step: a program using one must
# be refused (the refusal oracle). Apart from LAYERS, so that adding one left
# the programs of earlier seeds as they were.
KEEPING_LAYERS = {"carried_max": CarriedMax}


@keras.saving.register_keras_serializable(package="keras_dp_fuzz")
class OwnLoss(keras.Model):
    """A subclassed model whose compute_loss is not the compiled loss: it
    trains towards -y (a private step that ignored it would train towards y)."""

    def __init__(self, inner=None, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x, training=None):
        return self.inner(x, training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, -y, y_pred, sample_weight, training)

    def get_config(self):
        return {"inner": keras.saving.serialize_keras_object(self.inner), "name": self.name}

    @classmethod
    def from_config(cls, config):
        inner = keras.saving.deserialize_keras_object(config.pop("inner"))
        return cls(inner, **config)


def base_model(program, name="a"):
    """The program's plain Keras model (its layers, then Dense(1))."""
    inputs = keras.Input((FEATURES,))
    h = inputs
    for layer in program.layers:
        h = {**LAYERS, **KEEPING_LAYERS}[layer]()(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h), name=f"base_{name}")
    if program.subclass == "compute_loss":
        model = OwnLoss(model, name=f"own_{name}")
        model.build((None, FEATURES))
    return model


CUSTOM_OBJECTS = {"Scale": Scale, "CustomGradient": CustomGradient, "OwnLoss": OwnLoss,
                  "CarriedMax": CarriedMax,
                  "_batch_mean_mix": _batch_mean_mix, "_impute_batch_mean": _impute_batch_mean}


# --------------------------------------------------------------- pipelines


def transform(dataset, name):
    """One transformation of an unbatched (x, y, w) pipeline, by name."""
    kind, _, arg = name.partition(":")
    value = int(arg) if arg else 0
    if kind == "map":
        return dataset.map(lambda x, y, w: (tf.tanh(x) * 2.0, y, w))
    if kind == "filter":  # Keeps about half, by a feature.
        return dataset.filter(lambda x, y, w: x[value % FEATURES] > -0.3)
    if kind == "shuffle":
        return dataset.shuffle(16, seed=value)
    if kind == "batch_unbatch":
        return dataset.batch(max(value, 2)).unbatch()
    if kind == "concatenate_filtered":  # Oversampling: some examples twice.
        return dataset.concatenate(dataset.filter(lambda x, y, w: x[value % FEATURES] > 0.0))
    if kind == "repeat":
        return dataset.repeat(2)
    if kind == "take":
        return dataset.take(value)
    if kind == "skip":
        return dataset.skip(value)
    raise ValueError(f"unknown transformation {name!r}")


def pipeline(x, y, w, transforms):
    """An unbatched pipeline of (x, y, w) examples through `transforms`."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y, w))
    for name in transforms:
        dataset = transform(dataset, name)
    return dataset


# Maps of whole Poisson batches (x, y, w), after poisson_dataset: keras-dp
# must keep the row-wise one and refuse the others, in which one example
# reaches other rows (so moves the clipped sum by more than C).
BATCH_MAPS = {
    "rowwise": lambda x, y, w: (tf.tanh(x) * 2.0, y, w),
    "batch_mean": lambda x, y, w: (x - tf.reduce_mean(x, axis=0), y, w),
    "duplicate": lambda x, y, w: (tf.concat([x, x], 0), tf.concat([y, y], 0),
                                  tf.concat([w, w], 0)),
    "roll": lambda x, y, w: (tf.roll(x, 1, axis=0), y, w),
}
MIXING_BATCH_MAPS = ("batch_mean", "duplicate", "roll")
