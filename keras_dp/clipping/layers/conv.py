"""Norm functions of Conv1D and Conv2D (channels last, one group).

A kernel's per-example gradient is the outer product of the input patches
and the output gradients: patches are gathered with a precomputed index
(several times faster than tf.image.extract_patches on CPU). With oneDNN a
convolution with one input channel uses one depthwise filter-gradient op
instead.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_dp.clipping.factors import OuterProduct
from keras_dp.clipping.factors import PerExample
from keras_dp.clipping.factors import as_sequence
from keras_dp.clipping.onednn import runs_on_onednn
from keras_dp.clipping.registry import first_input
from keras_dp.clipping.registry import register_norm_function
from keras_dp.clipping.registry import unquantized


def _conv_supported(layer):
    # channels_first is left to the vectorized engine: TF cannot run it on
    # CPU, so that path could not be tested here.
    return (unquantized(layer) and layer.rank in (1, 2) and getattr(layer, "groups", 1) == 1
            and layer.data_format == "channels_last")


def _patch_index(spatial, kernel_size, strides, dilation_rate, padding):
    """Flat input position of every (output position, kernel offset) pair.

    Positions in the padding get the index `prod(spatial)` (a zero row).
    Returns an int32 array [T * prod(kernel_size)], kernel-offset-minor,
    matching the row-major layout of a Keras kernel [*kernel_size, C, F].
    """
    per_axis = []
    for size, k, s, r in zip(spatial, kernel_size, strides, dilation_rate):
        extent = (k - 1) * r + 1
        if padding == "same":
            out = -(-size // s)
            before = max((out - 1) * s + extent - size, 0) // 2
        else:
            out = (size - extent) // s + 1
            before = 0
        per_axis.append(np.arange(out)[:, None] * s + np.arange(k)[None, :] * r - before)
    grids = np.meshgrid(*[np.arange(p.shape[0]) for p in per_axis],
                        *[np.arange(p.shape[1]) for p in per_axis], indexing="ij")
    rank = len(per_axis)
    coords = [per_axis[a][grids[a], grids[rank + a]] for a in range(rank)]
    valid = np.all([(c >= 0) & (c < n) for c, n in zip(coords, spatial)], axis=0)
    flat = np.ravel_multi_index([np.clip(c, 0, n - 1) for c, n in zip(coords, spatial)], spatial)
    flat = np.where(valid, flat, int(np.prod(spatial)))
    return flat.reshape(-1).astype(np.int32), bool(valid.all())


def _patches(x, layer, padding):
    """The [B, T, prod(kernel_size) * C] patches of a channels-last input.

    A gather with a precomputed index: on CPU it is several times faster than
    tf.image.extract_patches, and it handles 1D and 2D alike.
    """
    spatial = tuple(x.shape[1:-1])
    channels = x.shape[-1]
    if None in spatial or channels is None:
        if layer.rank == 1:
            x = x[:, None]
        size = (1,) * (2 - layer.rank) + tuple(layer.kernel_size)
        strides = (1,) * (2 - layer.rank) + tuple(layer.strides)
        rates = (1,) * (2 - layer.rank) + tuple(layer.dilation_rate)
        return as_sequence(tf.image.extract_patches(
            x, sizes=[1, *size, 1], strides=[1, *strides, 1], rates=[1, *rates, 1],
            padding=padding.upper()))
    index, no_padding = _patch_index(spatial, layer.kernel_size, layer.strides,
                                     layer.dilation_rate, padding)
    rows = tf.reshape(x, [-1, int(np.prod(spatial)), channels])
    if not no_padding:
        rows = tf.concat([rows, tf.zeros_like(rows[:, :1])], axis=1)
    patches = tf.gather(rows, index, axis=1)
    depth = int(np.prod(layer.kernel_size)) * channels
    return tf.reshape(patches, [-1, len(index) // int(np.prod(layer.kernel_size)), depth])


def _single_channel_conv_gradients(x, grad_z, layer, padding):
    """Per-example kernel gradients of a convolution with one input channel.

    With the examples as channels, one depthwise filter-gradient op yields
    every example's gradient. oneDNN runs it several times faster than
    gathering patches; TensorFlow's own CPU kernel does not (see `_conv`).
    """
    if layer.rank == 1:
        x, grad_z = x[:, None], grad_z[:, None]
    kernel_size = (1,) * (2 - layer.rank) + tuple(layer.kernel_size)
    strides = (1,) * (2 - layer.rank) + tuple(layer.strides)
    batch = tf.shape(x)[0]
    filters = grad_z.shape[-1]
    channels_as_examples = tf.transpose(x, [3, 1, 2, 0])  # [1, H, W, B]
    grads = tf.transpose(grad_z, [1, 2, 0, 3])  # [Ho, Wo, B, F]
    grads = tf.reshape(grads, [1, grads.shape[0], grads.shape[1], -1])
    per_example = tf.nn.depthwise_conv2d_backprop_filter(
        channels_as_examples, tf.stack([*kernel_size, batch, filters]), grads,
        strides=[1, *strides, 1], padding=padding.upper())  # [kh, kw, B, F]
    per_example = tf.transpose(per_example, [2, 0, 1, 3])
    return tf.reshape(per_example, [-1, *layer.kernel.shape])


def _conv(layer, args, kwargs):
    inputs = first_input(args, kwargs)
    padding = layer.padding
    padded = inputs
    if padding == "causal":
        padded = ops.pad(inputs, layer._compute_causal_padding())
        padding = "valid"
    z = ops.conv(padded, layer.kernel, strides=list(layer.strides), padding=padding,
                 dilation_rate=layer.dilation_rate, data_format=layer.data_format)
    if layer.use_bias:  # channels_last (see _conv_supported)
        z = ops.add(z, ops.reshape(layer.bias, (1,) * (layer.rank + 1) + (layer.filters,)))
    outputs = layer.activation(z) if layer.activation is not None else z

    def gradients(grad_z):
        g = as_sequence(grad_z)
        if padded.shape[-1] == 1 and all(r == 1 for r in layer.dilation_rate) and runs_on_onednn():
            kernel = PerExample(_single_channel_conv_gradients(padded, grad_z, layer, padding))
        else:
            kernel = OuterProduct(_patches(padded, layer, padding), g)
        found = [(layer.kernel, kernel)]
        if layer.use_bias:
            found.append((layer.bias, PerExample(tf.reduce_sum(g, axis=1))))
        return found

    return outputs, z, gradients


register_norm_function(keras.layers.Conv1D, _conv, applies_to=_conv_supported)
register_norm_function(keras.layers.Conv2D, _conv, applies_to=_conv_supported)
