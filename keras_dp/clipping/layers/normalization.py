"""Norm functions of LayerNormalization, GroupNormalization and RMSNormalization.

Each repeats the layer's arithmetic, keeping the normalized input: the
per-example gradient of the scale is the normalized input times the output
gradient, that of the offset the output gradient, both summed to the
weight's shape.
"""

import keras
import tensorflow as tf
from keras import ops

from keras_dp.clipping.factors import PerExample
from keras_dp.clipping.factors import at_least_float32
from keras_dp.clipping.factors import sum_to_shape
from keras_dp.clipping.registry import first_input
from keras_dp.clipping.registry import UnsupportedModelError
from keras_dp.clipping.registry import register_norm_function


def _affine_gradients(layer, normalized, grad, broadcast_shape):
    """Per-example gradients of `gamma` (scale) and `beta` (offset) of a normalization."""
    found = []
    if getattr(layer, "gamma", None) is not None:
        scale = sum_to_shape(normalized * grad, broadcast_shape)
        found.append((layer.gamma, PerExample(tf.reshape(scale, [-1, *layer.gamma.shape]))))
    if getattr(layer, "beta", None) is not None:
        offset = sum_to_shape(grad, broadcast_shape)
        found.append((layer.beta, PerExample(tf.reshape(offset, [-1, *layer.beta.shape]))))
    return found


def _layer_normalization(layer, args, kwargs):
    # Same arithmetic as keras.ops.layer_normalization, with the normalized
    # input kept for the per-example gradient of gamma.
    inputs = first_input(args, kwargs)
    x = at_least_float32(tf.convert_to_tensor(inputs))
    rank = x.shape.rank
    axes = sorted(a % rank for a in layer.axis)
    if 0 in axes:
        raise UnsupportedModelError(
            f"LayerNormalization '{layer.name}' normalizes over the batch axis; its "
            "per-example gradients are undefined.")
    broadcast_shape = [1] * rank
    for a in axes:
        broadcast_shape[a] = x.shape[a]
    broadcast_shape = broadcast_shape[1:]
    def broadcast(weight):
        return None if weight is None else tf.reshape(tf.cast(weight, x.dtype), broadcast_shape)

    gamma, beta = broadcast(layer.gamma), broadcast(getattr(layer, "beta", None))
    if layer.rms_scaling:
        variance = ops.var(x, axis=axes, keepdims=True)
        inv = tf.math.rsqrt(variance + layer.epsilon)
        normalized = x * inv
        outputs = normalized * gamma if gamma is not None else normalized
    else:
        mean, variance = ops.moments(x, axes=axes, keepdims=True)
        inv = tf.math.rsqrt(variance + layer.epsilon)
        normalized = None
        scaled = inv * gamma if gamma is not None else inv
        shift = -mean * scaled
        if beta is not None:
            shift = shift + beta
        outputs = x * scaled + shift
    outputs = ops.cast(outputs, layer.compute_dtype)

    def gradients(grad):
        norm = normalized if normalized is not None else (x - mean) * inv
        return _affine_gradients(layer, norm, tf.cast(grad, norm.dtype), broadcast_shape)

    return outputs, outputs, gradients


def _group_normalization(layer, args, kwargs):
    # Same arithmetic as keras.layers.GroupNormalization.call.
    inputs = tf.convert_to_tensor(first_input(args, kwargs))
    rank = inputs.shape.rank
    axis = layer.axis % rank
    if axis == 0:
        raise UnsupportedModelError(
            f"GroupNormalization '{layer.name}' uses the batch axis as channels.")
    channels = inputs.shape[axis]
    shape = tf.shape(inputs)
    group_shape = [shape[k] if inputs.shape[k] is None else inputs.shape[k] for k in range(rank)]
    group_shape[0] = -1
    group_shape[axis] = channels // layer.groups
    group_shape.insert(axis, layer.groups)
    grouped = at_least_float32(tf.reshape(inputs, group_shape))
    dtype = grouped.dtype
    reduction_axes = [k for k in range(1, rank + 1) if k != axis]
    mean, variance = ops.moments(grouped, axes=reduction_axes, keepdims=True)
    inv = tf.math.rsqrt(variance + layer.epsilon)
    group_broadcast = [1] * rank
    group_broadcast[axis] = channels // layer.groups
    group_broadcast.insert(axis, layer.groups)
    scaled = inv
    if layer.scale:
        scaled = inv * tf.cast(tf.reshape(layer.gamma, group_broadcast), dtype)
    shift = -mean * scaled
    if layer.center:
        shift = shift + tf.cast(tf.reshape(layer.beta, group_broadcast), dtype)
    outputs = tf.cast(grouped * scaled + shift, inputs.dtype)
    outputs = tf.reshape(outputs, shape)
    outputs = ops.cast(outputs, layer.compute_dtype)

    def gradients(grad):
        normalized = tf.reshape((grouped - mean) * inv, shape)
        broadcast_shape = [1] * (rank - 1)
        broadcast_shape[axis - 1] = channels
        return _affine_gradients(layer, normalized, tf.cast(grad, dtype), broadcast_shape)

    return outputs, outputs, gradients


def _rms_normalization(layer, args, kwargs):
    # Same arithmetic as keras.ops.rms_normalization.
    x = at_least_float32(tf.convert_to_tensor(first_input(args, kwargs)))
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    if 0 in [a % x.shape.rank for a in axes]:
        raise UnsupportedModelError(
            f"RMSNormalization '{layer.name}' normalizes over the batch axis; its "
            "per-example gradients are undefined.")
    inv = tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=layer.axis, keepdims=True)
                        + layer.epsilon)
    normalized = x * inv
    outputs = normalized * tf.cast(layer.scale, x.dtype)
    outputs = ops.cast(outputs, layer.compute_dtype)

    def gradients(grad):
        scale = sum_to_shape(normalized * tf.cast(grad, x.dtype), tuple(layer.scale.shape))
        return [(layer.scale, PerExample(scale))]

    return outputs, outputs, gradients


register_norm_function(keras.layers.LayerNormalization, _layer_normalization)
register_norm_function(keras.layers.GroupNormalization, _group_normalization)
register_norm_function(keras.layers.RMSNormalization, _rms_normalization)
