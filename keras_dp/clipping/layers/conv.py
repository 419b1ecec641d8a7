"""Norm functions of Keras' convolutions (channels last, one group).

Covered: Conv1D, Conv2D, Conv3D; Conv1DTranspose, Conv2DTranspose,
Conv3DTranspose; DepthwiseConv1D, DepthwiseConv2D; SeparableConv1D,
SeparableConv2D; with or without bias, any strides, dilation and "same" /
"valid" padding ("causal" for Conv1D). Refused (so "auto" uses the
vectorized engine): channels_first, groups > 1, LoRA, quantized layers.

P(u) below are the patches of u for the layer's geometry: row t holds the
inputs that output position t reads, kernel offsets major and channels
minor (the row-major layout of a Keras kernel [*kernel_size, C, F]). They
are gathered with a precomputed index, several times faster than
tf.image.extract_patches on CPU. Per example i, with dz the gradient of the
summed loss w.r.t. the pre-activation output z:

* Convolution, z = P(x) W: g_W = P(x_i)^T dz_i (an `OuterProduct`).
* Transposed convolution: z = A^T x, where A = conv(., W) is the
  convolution of the same geometry from z's shape to x's, so
  <dz, z> = <A dz, x> and W's gradient is A's with dz as its input and x as
  its output gradient: g_W = P(dz_i)^T x_i (an `OuterProduct`).
* Depthwise, kernel [*k, C, M]: channel c is convolved alone, so
  g_W[k, c, m] = sum_t P(x_i)[t, k, c] dz_i[t, c, m]. The kernel is small
  (K*C*M per example), so the per-example gradients are formed
  (`PerExample`); see `_depthwise_gradients` for how.
* Separable, u = depthwise(x, W_d), z = conv1x1(u, W_p): W_p as a
  convolution on u, W_d as a depthwise one with du = dz W_p^T.
* Biases: g_b = sum_t dz_i[t] (`PerExample`).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_dp.clipping.factors import OuterProduct
from keras_dp.clipping.factors import PerExample
from keras_dp.clipping.factors import as_sequence
from keras_dp.clipping.onednn import runs_on_onednn
from keras_dp.clipping.registry import UnsupportedModelError
from keras_dp.clipping.registry import first_input
from keras_dp.clipping.registry import register_norm_function
from keras_dp.clipping.registry import unquantized


def _supported(layer):
    """The `applies_to` of every convolution here.

    channels_first is left to the vectorized engine: TF cannot run it on
    CPU, so that path could not be tested here. A LoRA kernel is a sum of
    three weights, which these norm functions do not split.
    """
    return (unquantized(layer) and layer.data_format == "channels_last"
            and getattr(layer, "groups", 1) == 1 and not getattr(layer, "lora_enabled", False))


def _dim(tensor, axis):
    """Size of `axis`: static when known, else a scalar tensor."""
    size = tensor.shape[axis]
    return size if size is not None else tf.shape(tensor)[axis]


def _patch_index(spatial, kernel_size, strides, dilation_rate, padding):
    """Flat input position of every (output position, kernel offset) pair.

    Args:
        spatial: the input's spatial shape.
        kernel_size, strides, dilation_rate: the layer's, one entry per axis.
        padding: "same" or "valid".

    Returns:
        `(index, no_padding)`: an int32 array [T * prod(kernel_size)],
        kernel-offset-minor, where positions in the padding get the index
        `prod(spatial)` (a zero row), and whether no position is in it.
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

    Args:
        x: `[B, *spatial, C]`.
        layer: gives the geometry (`rank`, `kernel_size`, `strides`,
            `dilation_rate`).
        padding: "same" or "valid".

    Returns:
        The patches, kernel offsets major and channels minor.
    """
    if all(k == 1 for k in layer.kernel_size):
        # A 1x1 kernel (a pointwise convolution) reads one position: its
        # patches are a strided slice ("same" pads nothing for it).
        return as_sequence(x[(slice(None), *[slice(None, None, s) for s in layer.strides])])
    spatial = tuple(x.shape[1:-1])
    channels = x.shape[-1]
    if None in spatial or channels is None:
        return _patches_of_unknown_shape(x, layer, padding)
    index, no_padding = _patch_index(spatial, layer.kernel_size, layer.strides,
                                     layer.dilation_rate, padding)
    kernel_positions = int(np.prod(layer.kernel_size))
    steps = len(index) // kernel_positions
    if channels == 1:
        return tf.reshape(_single_channel_patches(x, index, no_padding),
                          [-1, steps, kernel_positions])
    rows = tf.reshape(x, [-1, int(np.prod(spatial)), channels])
    if not no_padding:
        rows = tf.concat([rows, tf.zeros_like(rows[:, :1])], axis=1)
    patches = tf.gather(rows, index, axis=1)
    return tf.reshape(patches, [-1, steps, kernel_positions * channels])


def _single_channel_patches(x, index, no_padding):
    """`[B, len(index)]`: the values of a one-channel input `x` at `index`.

    Gathering single floats per example is slow on CPU; with the examples
    last, every index copies a whole row of B floats, and the transposes
    cost less than they save (CNN's first layer, 28x28 inputs, 8x8 kernel,
    batch 256: 15 -> 9 ms of CPU without oneDNN).
    """
    rows = tf.transpose(tf.reshape(x, [-1, int(np.prod(x.shape[1:]))]))
    if not no_padding:
        rows = tf.concat([rows, tf.zeros_like(rows[:1])], axis=0)
    return tf.transpose(tf.gather(rows, index))


def _patches_of_unknown_shape(x, layer, padding):
    """`_patches` when the spatial shape is only known at run time (1D, 2D)."""
    if layer.rank > 2:
        # tf.extract_volume_patches has no dilation; refusing while tracing
        # lets "auto" fall back to the vectorized engine.
        raise UnsupportedModelError(
            f"Layer '{layer.name}' ({type(layer).__name__}) runs on inputs of unknown "
            "spatial shape; ghost clipping needs it for 3D convolutions.")
    if layer.rank == 1:
        x = x[:, None]
    size, strides, rates = [(1,) * (2 - layer.rank) + tuple(v) for v in
                            (layer.kernel_size, layer.strides, layer.dilation_rate)]
    return as_sequence(tf.image.extract_patches(
        x, sizes=[1, *size, 1], strides=[1, *strides, 1], rates=[1, *rates, 1],
        padding=padding.upper()))


def _examples_as_channels(tensor):
    """`[B, H, W, C]` as one image `[1, H, W, B * C]`, example-major channels."""
    tensor = tf.transpose(tensor, [1, 2, 0, 3])
    return tf.reshape(tensor, [1, _dim(tensor, 0), _dim(tensor, 1), -1])


def _depthwise_filter_gradients(x, grad_z, layer, padding, kernel_shape):
    """Per-example gradients of a depthwise kernel by one filter-gradient op.

    With the examples' channels as the channels of one image, the op's
    filter gradient [*k, B * C, M] is every example's. A convolution with
    one input channel is depthwise with M = filters.

    Args:
        x: `[B, *spatial, C]` (1D or 2D), the padded input.
        grad_z: `[B, *out_spatial, C * M]`.
        layer: gives the geometry; its dilation rate must be 1 (the op's
            CPU kernels have none).
        padding: "same" or "valid".
        kernel_shape: the kernel's shape, `[*kernel_size, C, M]`.

    Returns:
        `[B, *kernel_shape]`.
    """
    strides = tuple(layer.strides)
    if layer.rank == 1:
        x, grad_z = x[:, None], grad_z[:, None]
        # The op needs equal strides; the added axis has size 1, so any
        # stride along it gives the same single output row.
        strides = strides * 2
    kernel_size = (1,) * (2 - layer.rank) + tuple(layer.kernel_size)
    channels, multiplier = kernel_shape[-2], kernel_shape[-1]
    per_example = tf.nn.depthwise_conv2d_backprop_filter(
        _examples_as_channels(x),
        tf.stack([*kernel_size, tf.shape(x)[0] * channels, multiplier]),
        _examples_as_channels(grad_z), strides=[1, *strides, 1],
        padding=padding.upper())  # [kh, kw, B * C, M]
    per_example = tf.reshape(per_example, [*kernel_size, -1, channels, multiplier])
    per_example = tf.transpose(per_example, [2, 0, 1, 3, 4])
    return tf.reshape(per_example, [-1, *kernel_shape])


def _depthwise_gradients_from_patches(x, grad_z, layer, padding, kernel_shape):
    """Per-example gradients of a depthwise kernel from the input's patches.

    Args and Returns: as `_depthwise_filter_gradients`, any rank and
    dilation.
    """
    channels, multiplier = kernel_shape[-2], kernel_shape[-1]
    kernel_positions = int(np.prod(layer.kernel_size))
    patches = _patches(x, layer, padding)
    patches = tf.reshape(patches, [-1, _dim(patches, 1), kernel_positions, channels])
    grads = as_sequence(grad_z)
    grads = tf.reshape(grads, [-1, _dim(grads, 1), channels, multiplier])
    if multiplier == 1:  # A product and a sum: 3x faster than einsum's batched matmuls.
        per_example = tf.reduce_sum(patches * grads[:, :, None, :, 0], axis=1)
    else:
        per_example = tf.einsum("btkc,btcm->bkcm", patches, grads)
    return tf.reshape(per_example, [-1, *kernel_shape])


def _filter_gradient_op_fits(x, layer):
    """Whether `_depthwise_filter_gradients` runs, and runs fast, on input `x`.

    It needs a 1D or 2D layer without dilation. On inputs smaller than the
    kernel (the last blocks of MobileNetV2 on 32x32 images) oneDNN's op took
    100-230 ms instead of about 1 ms (batch 64, 144-336 channels); patches
    of such inputs are few, so they take under 1 ms there.
    """
    return (layer.rank <= 2 and all(r == 1 for r in layer.dilation_rate)
            and all(n is None or n >= k for n, k in zip(x.shape[1:-1], layer.kernel_size)))


def _depthwise_gradients(x, grad_z, layer, padding, kernel_shape):
    """Per-example gradients of a depthwise kernel (args as `_depthwise_filter_gradients`).

    The filter-gradient op where it fits (`_filter_gradient_op_fits`), else
    patches: the op was faster on every larger input measured, with oneDNN
    and without (batch 64, 3x3 kernels, 8x8 to 17x17 inputs: 1.1-2.9 ms
    against 3.1-4.3 with oneDNN, 5-8 against 6-11 without).
    """
    if _filter_gradient_op_fits(x, layer):
        return _depthwise_filter_gradients(x, grad_z, layer, padding, kernel_shape)
    return _depthwise_gradients_from_patches(x, grad_z, layer, padding, kernel_shape)


def _with_bias(layer, z):
    """`z` plus the layer's bias, if any (channels last, see `_supported`)."""
    if not layer.use_bias:
        return z
    return ops.add(z, ops.reshape(layer.bias, (1,) * (layer.rank + 1) + (-1,)))


def _bias_gradients(layer, grad_z):
    """`[(bias, factor)]` for a layer with a bias, else `[]`."""
    if not layer.use_bias:
        return []
    return [(layer.bias, PerExample(tf.reduce_sum(as_sequence(grad_z), axis=1)))]


def _activated(layer, z):
    return layer.activation(z) if layer.activation is not None else z


def _conv(layer, args, kwargs):
    inputs = first_input(args, kwargs)
    padding = layer.padding
    padded = inputs
    if padding == "causal":
        padded = ops.pad(inputs, layer._compute_causal_padding())
        padding = "valid"
    z = _with_bias(layer, ops.conv(padded, layer.kernel, strides=list(layer.strides),
                                   padding=padding, dilation_rate=layer.dilation_rate,
                                   data_format=layer.data_format))

    def gradients(grad_z):
        # With one input channel oneDNN runs the depthwise filter-gradient op
        # several times faster than gathering patches; TensorFlow's own CPU
        # kernel does not.
        if padded.shape[-1] == 1 and runs_on_onednn() and _filter_gradient_op_fits(padded, layer):
            kernel = PerExample(_depthwise_filter_gradients(padded, grad_z, layer, padding,
                                                            layer.kernel.shape))
        else:
            kernel = OuterProduct(_patches(padded, layer, padding), as_sequence(grad_z))
        return [(layer.kernel, kernel)] + _bias_gradients(layer, grad_z)

    return _activated(layer, z), z, gradients


def _conv_transpose(layer, args, kwargs):
    inputs = first_input(args, kwargs)
    z = _with_bias(layer, ops.conv_transpose(
        inputs, layer.kernel, strides=list(layer.strides), padding=layer.padding,
        output_padding=layer.output_padding, dilation_rate=layer.dilation_rate,
        data_format=layer.data_format))

    def gradients(grad_z):
        # The patches of dz for the convolution from z's shape to x's (see
        # the module docstring); its kernel [*k, filters, C] is this one's.
        kernel = OuterProduct(_patches(grad_z, layer, layer.padding), as_sequence(inputs))
        return [(layer.kernel, kernel)] + _bias_gradients(layer, grad_z)

    return _activated(layer, z), z, gradients


def _depthwise_conv(layer, args, kwargs):
    inputs = first_input(args, kwargs)
    z = _with_bias(layer, ops.depthwise_conv(
        inputs, layer.kernel, strides=layer.strides, padding=layer.padding,
        dilation_rate=layer.dilation_rate, data_format=layer.data_format))

    def gradients(grad_z):
        kernel = _depthwise_gradients(inputs, grad_z, layer, layer.padding, layer.kernel.shape)
        return [(layer.kernel, PerExample(kernel))] + _bias_gradients(layer, grad_z)

    return _activated(layer, z), z, gradients


def _separable_conv(layer, args, kwargs):
    inputs = first_input(args, kwargs)
    # ops.separable_conv's two steps, keeping the depthwise output u.
    depthwise = ops.depthwise_conv(
        inputs, layer.depthwise_kernel, strides=layer.strides, padding=layer.padding,
        dilation_rate=layer.dilation_rate, data_format=layer.data_format)
    z = _with_bias(layer, ops.conv(depthwise, layer.pointwise_kernel, strides=1,
                                   padding="valid", data_format=layer.data_format))

    def gradients(grad_z):
        pointwise = layer.pointwise_kernel
        # du = dz W_p^T: the backward pass forms it too, but only z is watched.
        grad_u = tf.tensordot(
            grad_z, tf.cast(tf.reshape(pointwise, pointwise.shape[-2:]), grad_z.dtype),
            [[layer.rank + 1], [1]])
        depthwise_kernel = _depthwise_gradients(inputs, grad_u, layer, layer.padding,
                                                layer.depthwise_kernel.shape)
        return ([(layer.depthwise_kernel, PerExample(depthwise_kernel)),
                 (pointwise, OuterProduct(as_sequence(depthwise), as_sequence(grad_z)))]
                + _bias_gradients(layer, grad_z))

    return _activated(layer, z), z, gradients


for _layer_class, _norm_function in [
        (keras.layers.Conv1D, _conv), (keras.layers.Conv2D, _conv),
        (keras.layers.Conv3D, _conv),
        (keras.layers.Conv1DTranspose, _conv_transpose),
        (keras.layers.Conv2DTranspose, _conv_transpose),
        (keras.layers.Conv3DTranspose, _conv_transpose),
        (keras.layers.DepthwiseConv1D, _depthwise_conv),
        (keras.layers.DepthwiseConv2D, _depthwise_conv),
        (keras.layers.SeparableConv1D, _separable_conv),
        (keras.layers.SeparableConv2D, _separable_conv)]:
    register_norm_function(_layer_class, _norm_function, applies_to=_supported)
