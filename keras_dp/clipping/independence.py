"""Checks that a model computes each example's output from that example alone.

Ghost clipping takes row i of every recorded tensor as example i's. A
weightless operation that mixes the rows of a batch (a Lambda subtracting
the batch mean, a custom layer normalizing over the batch) breaks that
silently: one example would move the clipped sum by more than C. The
vectorized engine runs each example alone, so it needs no such check.

`rows_are_independent` runs the model in training mode, as the private
step does, on a small batch of generated inputs (never the private data)
and on each of its rows alone, and compares. Layers whose randomness is
drawn for each entry on its own (dropout, Gaussian noise) pass their input
through during the probe, so that equal rows give equal outputs; any other
randomness (augmentation, MixUp) makes the probe fail, and "auto" then uses
the vectorized engine. It is a probe, not a proof: it catches operations that
mix rows in the forward pass for generic inputs, which is what the known
failures do. Its cost is one call of the model on `_PROBE_ROWS` rows and
`_PROBE_ROWS` calls on one row, once per input signature traced.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

# Rows of the probe batch, and the length given to unknown non-batch axes.
_PROBE_ROWS = 3
_UNKNOWN_LENGTH = 4


def rows_are_independent(model, x):
    """Whether `model`'s output for each row depends on that row alone.

    Args:
        model: a Keras model.
        x: the model's inputs as traced (tensors or specs: only their
            structure, shapes and dtypes are used).

    Returns:
        True when the outputs of a generated batch equal, row by row, those
        of each row alone (to a tolerance fit for the compute dtype); False
        when they differ, or when no probe input can be made or run.
    """
    leaves = tf.nest.flatten(x)
    if not leaves or any(not _probe_dtype(leaf.dtype) for leaf in leaves):
        return False
    rng = np.random.default_rng(0)
    try:
        with tf.init_scope(), _still(model):  # Eager, also while the step is traced.
            batch = tf.nest.pack_sequence_as(x, [_probe_input(leaf, rng) for leaf in leaves])
            together = _outputs(model, batch)
            alone = [_outputs(model, tf.nest.map_structure(lambda t: t[i:i + 1], batch))
                     for i in range(_PROBE_ROWS)]
    except (tf.errors.OpError, ValueError, TypeError):
        return False
    tolerance = 1e-3 if model.compute_dtype in ("float32", "float64") else 5e-2
    for index, whole in enumerate(together):
        rows = np.concatenate([outputs[index] for outputs in alone])
        if whole.shape != rows.shape or not np.allclose(
                whole, rows, rtol=tolerance, atol=tolerance * (1 + np.abs(whole).max())):
            return False
    return True


def _probe_dtype(dtype):
    dtype = tf.as_dtype(dtype)
    return dtype.is_floating or dtype.is_integer or dtype.is_bool


def _probe_input(leaf, rng):
    """A generated batch shaped like `leaf`: normal floats, ids in {1, 2}
    (valid for any embedding of three or more rows, never a mask value)."""
    shape = [_PROBE_ROWS] + [d if d is not None else _UNKNOWN_LENGTH
                             for d in leaf.shape[1:]]
    dtype = tf.as_dtype(leaf.dtype)
    if dtype.is_floating:
        values = rng.normal(size=shape)
    elif dtype.is_bool:
        values = rng.integers(0, 2, size=shape).astype(bool)
    else:
        values = rng.integers(1, 3, size=shape)
    return tf.constant(values, dtype=dtype)


def _outputs(model, batch):
    return [np.asarray(t, np.float64) for t in tf.nest.flatten(model(batch, training=True))]


# Random layers that draw for each entry independently of the other rows.
_ENTRYWISE_RANDOM = (keras.layers.Dropout, keras.layers.GaussianNoise,
                     keras.layers.GaussianDropout, keras.layers.AlphaDropout,
                     keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D,
                     keras.layers.SpatialDropout3D)


@contextlib.contextmanager
def _still(model):
    """Within: the model's entry-wise random layers return their inputs."""
    layers = [layer for layer in model._flatten_layers()
              if type(layer) in _ENTRYWISE_RANDOM]
    for layer in layers:
        object.__setattr__(layer, "call", lambda inputs, *args, **kwargs: inputs)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("call", None)
