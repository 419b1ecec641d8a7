"""Canaries for the one-run audit: white-box gradient ones, black-box example ones."""

import keras
import numpy as np
from keras import ops


def _draw_inclusion(num_canaries, rng):
    """Each canary in the training set independently with probability 1/2."""
    if not isinstance(num_canaries, (int, np.integer)) or num_canaries < 1:
        raise ValueError(f"num_canaries must be an integer >= 1 (1000 is a good "
                         f"start); received num_canaries={num_canaries!r}.")
    return rng.random(num_canaries) < 0.5


def _per_example_loss(loss):
    """`(y_true, y_pred) -> [B]` losses of a Keras loss (name, function or object)."""
    loss = keras.losses.get(loss)
    fn = loss.call if isinstance(loss, keras.losses.Loss) else loss

    def per_example(y_true, y_pred):
        values = fn(y_true, y_pred)
        if len(values.shape) > 1:  # e.g. per time step: average like Keras does.
            values = ops.mean(values, axis=list(range(1, len(values.shape))))
        return values

    return per_example


class GradientCanaries:
    """White-box canaries: each one's gradient is a fixed direction e_j.

    The model is trained with an extra weight w of m coordinates (a
    `keras.layers.Embedding(m + 1, 1)` that no ordinary example touches).
    Canary j is an example with an all-zero input whose loss is
    `-s * w[j]`, s = 2 * l2_norm_clip: its gradient is `-s * e_j` on w and
    exactly zero on the model's own weights, so the private step clips it to
    norm C like any example: the worst-case canary of DP-SGD. Its score is
    the total update `w[j]` (w starts at zero): about C / B per time it was
    sampled, plus the noise.

    Args:
        num_canaries: m.
        seed: seed (or numpy Generator) of which canaries are included.

    Example:
    ```python
    canaries = keras_dp.audit.GradientCanaries(1000, seed=0)
    result = keras_dp.audit.audit_training(model, x, y, canaries, loss=..., ...)
    ```
    """

    # The name of the canary weight's layer (per-layer clipping gives it a norm).
    layer_name = "canary_weights"

    def __init__(self, num_canaries=1000, seed=None):
        self.included = _draw_inclusion(num_canaries, np.random.default_rng(seed))

    def prepare(self, model, loss, x, y, l2_norm_clip):
        """What to train privately: the data plus the included canaries.

        Args:
            model: the Keras model, taking one array `x` and returning [B, K].
            loss: its loss, per example (a name, function or `keras.losses.Loss`).
            x, y: the training data, numpy arrays.
            l2_norm_clip: the optimizer's clipping norm C.

        Returns:
            `(training_model, training_loss, x, y)`: the model with the canary
            weight, its loss, inputs `{"x": ..., "canary": ...}` (canary index
            j + 1, or 0 for ordinary examples) and labels.
        """
        ids = np.flatnonzero(self.included) + 1
        x, y = np.asarray(x), np.asarray(y)
        inputs = {"x": np.concatenate([x, np.zeros((ids.size,) + x.shape[1:], x.dtype)]),
                  "canary": np.concatenate([np.zeros(len(x), np.int32), ids.astype(np.int32)])}
        labels = np.concatenate([y, np.zeros((ids.size,) + y.shape[1:], y.dtype)])
        return (_CanaryModel(model, self.included.size),
                _CanaryLoss(loss, 2.0 * l2_norm_clip), inputs, labels)

    def scores(self, training_model, loss=None):
        """[m] scores: the total update of each canary's coordinate."""
        return np.asarray(training_model.canary_weights.embeddings)[1:, 0].astype(np.float64)


class _CanaryModel(keras.Model):
    """The model plus the canary weight; outputs [logits, w[canary], is_canary]."""

    def __init__(self, model, num_canaries):
        super().__init__(name=f"{model.name}_with_canaries")
        self.model = model
        self.canary_weights = keras.layers.Embedding(
            num_canaries + 1, 1, embeddings_initializer="zeros",
            name=GradientCanaries.layer_name)

    def call(self, inputs, training=None):
        logits = self.model(inputs["x"], training=training)
        index = inputs["canary"]
        value = ops.cast(self.canary_weights(index), logits.dtype)
        is_canary = ops.cast(ops.expand_dims(index > 0, -1), logits.dtype)
        return ops.concatenate([logits, value, is_canary], axis=-1)


class _CanaryLoss(keras.losses.Loss):
    """The model's loss for ordinary rows, `-strength * w[j]` for canary j."""

    def __init__(self, loss, strength):
        super().__init__(name="canary_loss")
        self._loss = _per_example_loss(loss)
        self._strength = strength

    def call(self, y_true, y_pred):
        ordinary = self._loss(y_true, y_pred[:, :-2])
        canary = -self._strength * y_pred[:, -2]
        # where() sends a zero gradient to the branch it does not pick.
        return ops.where(y_pred[:, -1] > 0, canary, ordinary)


class ExampleCanaries:
    """Black-box canaries: given examples, scored by minus their loss.

    Build them with `mislabeled` (real inputs with a wrong label) or
    `random_inputs` (out-of-distribution inputs), or from examples of your own.

    Args:
        x: [m, ...] canary inputs.
        y: [m, ...] their labels.
        seed: seed (or numpy Generator) of which canaries are included.

    Example:
    ```python
    canaries = keras_dp.audit.ExampleCanaries.mislabeled(x_extra, y_extra, 10)
    ```
    """

    def __init__(self, x, y, seed=None):
        self.x, self.y = np.asarray(x), np.asarray(y)
        if len(self.x) != len(self.y):
            raise ValueError(f"x and y must hold the same number of canaries; received "
                             f"{len(self.x)} inputs and {len(self.y)} labels.")
        self.included = _draw_inclusion(len(self.x), np.random.default_rng(seed))

    @classmethod
    def mislabeled(cls, x, y, num_classes, seed=None):
        """Canaries from examples NOT otherwise trained on, each given a random wrong label.

        Args:
            x, y: the examples (integer labels in [0, num_classes)).
            num_classes: number of classes, >= 2.
            seed: seed of the labels and of the inclusion.

        Returns:
            An `ExampleCanaries`.
        """
        rng = np.random.default_rng(seed)
        y = np.asarray(y)
        shift = rng.integers(1, num_classes, size=y.shape)
        return cls(x, ((y + shift) % num_classes).astype(y.dtype), seed=rng)

    @classmethod
    def random_inputs(cls, num_canaries, input_shape, num_classes, low=0.0, high=1.0,
                      seed=None):
        """Out-of-distribution canaries: uniform random inputs with random labels.

        Args:
            num_canaries: m.
            input_shape: shape of one input, e.g. (784,).
            num_classes: number of classes.
            low, high: range of the uniform input values.
            seed: seed of the inputs, labels and inclusion.

        Returns:
            An `ExampleCanaries`.
        """
        rng = np.random.default_rng(seed)
        x = rng.uniform(low, high, (num_canaries, *input_shape)).astype(np.float32)
        return cls(x, rng.integers(0, num_classes, num_canaries), seed=rng)

    def prepare(self, model, loss, x, y, l2_norm_clip):
        """Returns `(model, loss, x, y)` with the included canaries appended."""
        del l2_norm_clip  # Canaries are clipped like any example.
        chosen = self.included
        return (model, loss, np.concatenate([np.asarray(x), self.x[chosen]]),
                np.concatenate([np.asarray(y), self.y[chosen]]))

    def scores(self, training_model, loss):
        """[m] scores: minus each canary's loss under the trained model."""
        return -model_losses(training_model, loss, self.x, self.y)


def model_losses(model, loss, x, y):
    """Per-example losses of (x, y) under `model`, as float64 numpy."""
    predictions = model.predict(x, batch_size=1024, verbose=0)
    return np.asarray(_per_example_loss(loss)(y, predictions), np.float64)
