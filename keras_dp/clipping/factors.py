"""How a norm function describes the per-example gradient of one weight.

A norm function (see `keras_dp.clipping.registry.register_norm_function`)
returns one factor per weight: `OuterProduct` for dense-like maps,
`GatheredRows` for embeddings, `PerExample` for the gradients themselves.
The engine turns factors into per-example norms and the clipped sum
(`keras_dp.clipping.contributions`) without forming the gradients when that
is cheaper. `as_sequence` and `sum_to_shape` bring tensors to a factor's
layout; `at_least_float32` to the precision norms are formed in.
"""

import numpy as np
import tensorflow as tf


class OuterProduct:
    """Per-example gradient `g_i = sum_t inputs[i, t]^T output_grads[i, t]`.

    The weight of a dense-like map `z[i, t] = inputs[i, t] @ W` (convolutions
    through patches, einsums after transposing).

    Args:
        inputs: `[B, T, d]` tensor (T = 1 for plain `[B, d]` inputs).
        output_grads: `[B, T, p]`: gradient of the summed loss w.r.t. z.
        split_shape, perm: optional. The `[d, p]` gradient, reshaped to
            `split_shape`, transposed by `perm` and reshaped to the weight's
            shape, is the weight's gradient; by default it is only reshaped.

    The engine forms each example's norm and its share of the clipped sum
    from the same factor, so the clip bound holds for whatever the factor
    describes.
    """

    def __init__(self, inputs, output_grads, split_shape=None, perm=None):
        # Integer inputs (a lookup's one-hot or counts) are multiplied as the
        # gradient's type, as Keras' layers do.
        self.inputs = inputs if inputs.dtype.is_floating else tf.cast(inputs,
                                                                      output_grads.dtype)
        self.output_grads = output_grads
        self.split_shape = None if split_shape is None else tuple(split_shape)
        self.perm = None if perm is None else tuple(perm)
        # `[B, T, T]` output_grads @ output_grads^T, when given (`with_output_gram`).
        self.output_gram = None


def with_output_gram(factor, output_gram):
    """`factor` (an `OuterProduct`) with its output Gram given, for the Gram formula.

    For keras-dp's own norm functions, each checked against a brute-force
    per-example loop, that form `output_grads @ output_grads^T` more cheaply
    (a GRU's kernels share the Gram of their gate columns). The norms then
    come from `output_gram` and the clipped sum from `output_grads`, so the
    clip bound rests on the two agreeing: a norm function of your own should
    not use it.

    Args:
        factor: an `OuterProduct`.
        output_gram: `[B, T, T]`, exactly the per-example Gram matrices of
            `factor.output_grads`, formed in float64 (the bound on the
            norms' rounding assumes it).

    Returns:
        `factor`.
    """
    factor.output_gram = output_gram
    return factor


class PerExample:
    """The per-example gradients themselves, `[B, *weight.shape]`.

    For small weights (biases, normalization scales, position embeddings).
    """

    def __init__(self, grads):
        self.grads = grads


class GatheredRows:
    """Rows gathered by id: `z[i, t] = W[ids[i, t]]` (embeddings).

    Example i's gradient has row r equal to the sum of `output_grads[i, t]`
    over the positions t with `ids[i, t] == r`.

    Args:
        ids: `[B, T]` integer ids.
        output_grads: `[B, T, p]`.
        num_rows: number of rows of the weight (`[num_rows, p]`).
    """

    def __init__(self, ids, output_grads, num_rows):
        self.ids = ids
        self.output_grads = output_grads
        self.num_rows = int(num_rows)


def at_least_float32(tensor):
    """`tensor` cast to float32 if it is float16 or bfloat16 (mixed precision):
    every norm and clipped sum is formed in float32 at least."""
    return tf.cast(tensor, tf.float32) if tensor.dtype in (tf.float16, tf.bfloat16) else tensor


def as_sequence(tensor):
    """Reshapes `[B, ..., d]` to `[B, T, d]` (T = product of the middle dims)."""
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 2:
        return tf.expand_dims(tensor, 1)
    middle = tensor.shape[1:-1]
    steps = int(np.prod(middle)) if middle.is_fully_defined() else -1
    depth = tensor.shape[-1] if tensor.shape[-1] is not None else tf.shape(tensor)[-1]
    if steps == -1:
        return tf.reshape(tensor, [tf.shape(tensor)[0], -1, depth])
    return tf.reshape(tensor, [-1, steps, depth])


def sum_to_shape(grads, shape):
    """Per-example gradient of a weight of `shape` broadcast-added to `grads` [B, ...]."""
    rank = grads.shape.rank
    if len(shape) > rank - 1:
        raise ValueError(f"A weight of shape {shape} cannot broadcast to {grads.shape}.")
    full = [1] * (rank - 1 - len(shape)) + list(shape)
    axes = [1 + k for k, size in enumerate(full) if size == 1 and grads.shape[1 + k] != 1]
    summed = tf.reduce_sum(grads, axis=axes, keepdims=True) if axes else grads
    return tf.reshape(summed, [-1, *shape])
