"""Ghost clipping: exact per-example clipping without per-example gradients.

DP-SGD needs, for every example i, the norm of its gradient g_i and the sum
of the clipped gradients sum_i c_i g_i with c_i = min(1, C / ||g_i||). The
vectorized engine (`keras_dp.clipping`) materializes every g_i. This module
gets both from ONE forward pass and ONE backward pass of the whole batch, as
proposed by Goodfellow (2015) and Li et al. (2022), with the clipped sum
formed from the same pass ("book-keeping", Bu et al. 2023):

1. The batch runs forward once. Every call of a layer that has a registered
   norm function goes through that function, which records the layer's
   inputs and the tensor(s) that its weights produce (for Dense: the
   pre-activation output z = x W + b).
2. One backward pass of sum_i loss_i gives the gradient of every recorded
   tensor. Examples are independent, so row i of it is example i's gradient.
3. From inputs and output gradients each norm function describes each
   weight's per-example gradient as a *factor* (below); the engine turns
   factors into per-example squared norms without materializing the
   gradients when that is cheaper, e.g. for Dense on [B, d] inputs
   ||g_i||^2 = ||x_i||^2 ||dz_i||^2, and on [B, T, d] sequences
   ||g_i||^2 = <x_i x_i^T, dz_i dz_i^T> (the "ghost" Gram formula) or the
   direct per-example gradient x_i^T dz_i, whichever needs less memory.
4. c_i = min(1, C / norm_i), 0 (and counted) for a non-finite norm.
5. The clipped sum, without a second backward pass: for every factor
   sum_i c_i x_i^T dz_i = x^T (c * dz), one matmul per layer, the same work
   as the weight gradient of ordinary training. (`bookkeeping=False` instead
   differentiates sum_i c_i loss_i again; it is slower, kept to measure.)

Exactness: nothing is approximated. A weight used several times in one
forward pass (a layer called twice, tied weights) has the SUM of its uses as
per-example gradient; the engine groups factors by variable and merges them
before the norm (concatenating the token axis of outer-product factors, which
is exactly the sum), so cross terms are included.

Coverage. `supports(model)` is True when every trainable weight belongs to a
layer with an applicable norm function (built in: Dense, EinsumDense (hence
MultiHeadAttention, whose weights are all in EinsumDense sublayers), Conv1D,
Conv2D, Embedding, ReversibleEmbedding, LayerNormalization,
GroupNormalization, RMSNormalization; Keras Hub's layers in `keras_dp.hub`),
no layer has an activity regularizer, and no layer is quantized. Frozen
layers need no norm function: they are only run forward, and the backward
pass stops at the lowest recorded tensor. Dense, EinsumDense and Embedding
with LoRA (`layer.enable_lora(rank)`) describe the gradients of A and B as
factors of rank-sized tensors (see `_lora_branch`). Under mixed precision the
passes run in half precision and the norms and clipped sum in float32 (see
`_widened`). Otherwise the WHOLE model must use the vectorized engine:
a partial fallback would still run the vectorized per-example forward and
backward pass through the network to reach the uncovered weights, so it
would cost about as much as the vectorized path alone. As a safety net, every
read of a trainable weight during the recorded forward pass that no norm
function accounts for (e.g. a custom layer reading another layer's kernel)
raises `UnsupportedModelError` at trace time instead of clipping with a
wrong norm (as do add_loss() terms, which cannot be split per example).

Choosing the engine (for the train step): use this module when
`num_microbatches` is None (one microbatch per example) and
`supports(model)`; otherwise use `clipping.clipped_gradient_sum`. Ghost
clipping was faster than the vectorized engine on every model measured
(`benchmarks/speed.py --configs=private,vectorized`: the Fashion-MNIST CNN,
a 784-512-512-10 MLP, a 2-block transformer), and it never materializes
more than one per-example gradient of one layer at a time, so no
measurement is needed to choose.
Run it without XLA (Keras' default on CPU): under jit_compile=True on CPU it
was slower on all three models.

Cost. Per layer the engine picks the cheaper exact formula: for a dense-like
weight with T positions, d inputs and p outputs, the direct per-example
gradient (T*d*p multiply-adds, d*p floats per example) unless it is larger
than the layer's activations (d*p > T*(d+p)), then the Gram formula (T^2*(d+p)
multiply-adds, 2*T^2 floats). Convolutions go through patches gathered with a
precomputed index (several times faster than tf.image.extract_patches on
CPU); with oneDNN (TF_ENABLE_ONEDNN_OPTS=1) a convolution with one input
channel uses one depthwise filter-gradient op instead.

Writing a norm function for your own layer: see `register_norm_function`.
"""

import contextlib
import string
import threading

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from keras.src.backend.common.masking import set_keras_mask

from keras_dp.clipping import runs_on_onednn

__all__ = [
    "OuterProduct", "PerExample", "GatheredRows", "UnsupportedModelError",
    "register_norm_function", "supports", "unsupported_layers",
    "clipped_gradient_sum", "per_example_norms", "per_example_loss_fn",
]


# ------------------------------------------------------------------ factors
# How a norm function describes the per-example gradient of one weight.


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
    """

    def __init__(self, inputs, output_grads, split_shape=None, perm=None):
        self.inputs = inputs
        self.output_grads = output_grads
        self.split_shape = None if split_shape is None else tuple(split_shape)
        self.perm = None if perm is None else tuple(perm)


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


class UnsupportedModelError(ValueError):
    """Raised while tracing when ghost clipping cannot be exact for a model.

    (A weight read outside the norm functions, add_loss() terms.) Nothing has
    changed when it is raised: the caller may fall back to the vectorized
    engine in the same trace.
    """


# ----------------------------------------------------------------- registry

_REGISTRY = {}
_PATCH_LOCK = threading.RLock()


def register_norm_function(layer_class, fn, applies_to=None):
    """Registers how ghost clipping handles the weights of `layer_class`.

    The function replaces `layer.call` during the recorded forward pass:

        outputs, watched, gradients_fn = fn(layer, args, kwargs)

    * `args`, `kwargs`: the arguments `layer.call` received.
    * `outputs`: what `layer.call(*args, **kwargs)` returns (same values).
    * `watched`: a tensor or list of tensors computed inside `fn`, whose
      gradients determine the per-example gradients of the layer's weights;
      typically the pre-activation output. Row i of every watched tensor and
      of the outputs must depend on example i only.
    * `gradients_fn(watched_grads)`: given the gradient of the summed
      per-example loss w.r.t. `watched` (same structure; row i of each is
      example i's because examples are independent), returns a list of
      `(variable, factor)` pairs, one factor (`OuterProduct`, `PerExample` or
      `GatheredRows`) describing the per-example gradient of `variable`
      through THIS call. Report every trainable weight `fn` reads: an
      unreported read raises an error. Frozen weights may be reported or not.

    A layer called several times in one forward pass, or a variable reported
    by several layers, is handled by the engine (factors of one variable are
    summed exactly, cross terms included), so `fn` only describes one call.

    Subclasses of `layer_class` use `fn` too unless they override `call`.

    Args:
        layer_class: a `keras.layers.Layer` subclass.
        fn: the norm function described above.
        applies_to: optional `layer -> bool`; False makes the layer (hence a
            model containing it) unsupported, e.g. for a configuration `fn`
            does not handle.

    Example (a layer adding a learned `[T, D]` position embedding):
    ```python
    def position_embedding_norm(layer, args, kwargs):
        outputs = args[0] + layer.position_embeddings[None]
        def gradients(grad):
            return [(layer.position_embeddings, keras_dp.PerExample(grad))]
        return outputs, outputs, gradients

    keras_dp.register_norm_function(PositionEmbedding, position_embedding_norm)
    ```
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"register_norm_function expects a keras.layers.Layer subclass; "
                        f"received {layer_class!r}.")
    if not callable(fn):
        raise TypeError(f"The norm function must be callable; received {fn!r}.")
    _REGISTRY[layer_class] = (fn, applies_to)


def _rule_for(layer):
    """The registered norm function that applies to `layer`, or None."""
    layer_type = type(layer)
    if layer_type.__module__.startswith("keras_hub."):
        from keras_dp import hub  # noqa: F401  Registers Keras Hub's layers.
    for cls in layer_type.__mro__:
        entry = _REGISTRY.get(cls)
        if entry is None:
            continue
        if cls is not layer_type and getattr(layer_type, "call") is not getattr(cls, "call"):
            return None  # A subclass that changes call() needs its own rule.
        fn, applies_to = entry
        if applies_to is not None and not applies_to(layer):
            return None
        return fn
    return None


def _key(variable):
    """Identity of a variable (a Keras variable and the tf.Variable it wraps agree)."""
    if isinstance(variable, keras.Variable):
        variable = variable._value
    return id(variable)


def _own_trainable(layer, keys):
    return [v for v in getattr(layer, "_trainable_variables", []) if _key(v) in keys]


def unsupported_layers(model):
    """Reasons why ghost clipping does not apply to `model`, as strings.

    An empty list means `supports(model)`.
    """
    keys = {_key(v) for v in model.trainable_variables}
    reasons = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        name = f"'{layer.name}' ({type(layer).__name__})"
        if getattr(layer, "activity_regularizer", None) is not None:
            reasons.append(f"{name} has an activity regularizer (a batch-level add_loss term)")
        if getattr(layer, "quantization_mode", None) is not None:
            reasons.append(f"{name} is quantized")
        own = _own_trainable(layer, keys)
        if not own:
            continue
        if getattr(layer, "_remat_mode", None) is not None:
            reasons.append(f"{name} uses rematerialization")
        elif _rule_for(layer) is None:
            reasons.append(f"{name} has trainable weights and no applicable norm function "
                           "(see keras_dp.ghost.register_norm_function)")
    return reasons


def supports(model):
    """True when every trainable weight of `model` is covered by a norm function."""
    return not unsupported_layers(model)


# ------------------------------------------------------- built-in functions


def _first_input(args, kwargs):
    return args[0] if args else kwargs["inputs"]


def _unquantized(layer):
    return getattr(layer, "quantization_mode", None) is None


def _as_sequence(tensor):
    """Reshapes `[B, ..., d]` to `[B, T, d]` (T = product of the middle dims)."""
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 2:
        return tensor[:, None, :]
    middle = tensor.shape[1:-1]
    steps = int(np.prod(middle)) if middle.is_fully_defined() else -1
    depth = tensor.shape[-1] if tensor.shape[-1] is not None else tf.shape(tensor)[-1]
    if steps == -1:
        return tf.reshape(tensor, [tf.shape(tensor)[0], -1, depth])
    return tf.reshape(tensor, [-1, steps, depth])


def _sum_to_shape(grads, shape):
    """Per-example gradient of a weight of `shape` broadcast-added to `grads` [B, ...]."""
    rank = grads.shape.rank
    if len(shape) > rank - 1:
        raise ValueError(f"A weight of shape {shape} cannot broadcast to {grads.shape}.")
    full = [1] * (rank - 1 - len(shape)) + list(shape)
    axes = [1 + k for k, size in enumerate(full) if size == 1 and grads.shape[1 + k] != 1]
    summed = tf.reduce_sum(grads, axis=axes, keepdims=True) if axes else grads
    return tf.reshape(summed, [-1, *shape])


def _dense(layer, args, kwargs):
    inputs = _first_input(args, kwargs)
    # The stored kernel: with LoRA it is frozen and `layer.kernel` merges A B.
    z = ops.matmul(inputs, layer._kernel)
    lora = None
    if layer.lora_enabled:
        lora = _lora_branch(inputs, _einsum_plan("...a,ab->...b", inputs.shape.rank),
                            layer.lora_kernel_a, layer.lora_kernel_b, _lora_scale(layer))
        z = ops.add(z, lora[0])
    if layer.bias is not None:
        z = ops.add(z, layer.bias)
    outputs = layer.activation(z) if layer.activation is not None else z

    def gradients(grad_z):
        found = [(layer._kernel, OuterProduct(_as_sequence(inputs), _as_sequence(grad_z)))]
        if lora is not None:
            found += lora[1](grad_z)
        if layer.bias is not None:
            found.append((layer.bias, PerExample(tf.reduce_sum(_as_sequence(grad_z), axis=1))))
        return found

    return outputs, z, gradients


def _einsum_plan(equation, input_rank):
    """Splits an EinsumDense equation into (x, kernel, out) letter strings."""
    lhs, out = equation.split("->")
    x, w = lhs.split(",")
    if "..." in w:
        raise ValueError("ellipsis in the kernel")
    if "..." in x or "..." in out:
        unused = [c for c in string.ascii_letters if c not in equation]
        ellipsis = "".join(unused[:input_rank - (len(x) - 3)])
        x, out = x.replace("...", ellipsis), out.replace("...", ellipsis)
    return x, w, out


def _einsum_letters(layer, input_rank):
    """The layer's equation as (x, kernel, out) letter strings, or None if unsupported."""
    try:
        x, w, out = _einsum_plan(layer.equation, input_rank)
    except ValueError:  # Ellipsis in the kernel.
        return None
    batch = x[0]
    if batch in w or batch not in out:
        return None
    # Every kernel letter must appear in the input or the output.
    return (x, w, out) if all(c in x or c in out for c in w) else None


def _einsum_supported(layer):
    if not _unquantized(layer):
        return False
    # The input rank only matters for an ellipsis: check with one letter for it.
    letters = _einsum_letters(layer, len(layer.equation.split(",")[0].replace("...", "")) + 1)
    if letters is None:
        return False
    return not getattr(layer, "lora_enabled", False) or _lora_equations(*letters) is not None


def _einsum_factor(batch, x, w, out, inputs, kernel_shape, grad_z):
    """The per-example gradient of the kernel of `z = einsum(x,w->out)`.

    An OuterProduct when every kernel letter is either contracted with the
    input or free in the output, else the per-example gradients themselves.
    """
    sizes = dict(zip(w, kernel_shape))
    contracted = [c for c in w if c in x and c not in out]
    free = [c for c in w if c in out and c not in x]
    if len(contracted) + len(free) != len(w):  # A letter in input, kernel and output.
        return PerExample(tf.einsum(f"{x},{out}->{batch}{w}", inputs, grad_z))
    steps = "".join(c for c in out if c not in w and c != batch)
    a = tf.einsum(f"{x}->{batch}{steps}{''.join(contracted)}", inputs)
    g = tf.einsum(f"{out}->{batch}{steps}{''.join(free)}", grad_z)
    d = int(np.prod([sizes[c] for c in contracted]))
    p = int(np.prod([sizes[c] for c in free]))
    positions = a.shape[1:1 + len(steps)]
    if positions.is_fully_defined():
        count = int(np.prod(positions))
        a, g = tf.reshape(a, [-1, count, d]), tf.reshape(g, [-1, count, p])
    else:
        a = tf.reshape(a, [tf.shape(a)[0], -1, d])
        g = tf.reshape(g, [tf.shape(g)[0], -1, p])
    order = contracted + free
    return OuterProduct(a, g, [sizes[c] for c in order], [order.index(c) for c in w])


def _lora_equations(x, w, out):
    """Keras' LoRA term of an einsum kernel as two einsums, or None.

    With LoRA the kernel is `W + scale * A B`, A of shape `W.shape[:-1] +
    (rank,)` and B `(rank, W.shape[-1])`. Applied as two einsums, the
    inputs meet the small factor on the side of the kernel's last axis first
    (through A when that axis is an output axis, through B when it is
    contracted), so neither the merged kernel nor a per-example gradient of
    it is ever formed. Returns the letters `(first, mid, second, a_first)`
    of `mid = einsum(x,first->mid)` and `z = einsum(mid,second->out)`.
    """
    last = w[-1]
    rank = next(c for c in string.ascii_letters if c not in x + w + out)
    a = w[:-1] + rank
    if last in out and last not in x:
        return a, out.replace(last, rank), rank + last, True
    # The gradient of `mid` (from out and A) needs every input letter in A or out.
    if last in x and last not in out and all(c in a or c in out for c in x if c != last):
        return rank + last, x.replace(last, rank), a, False
    return None


def _lora_scale(layer):
    return layer.lora_alpha / layer.lora_rank


def _lora_branch(inputs, letters, a, b, scale):
    """The LoRA term `scale * einsum(inputs, A B)` of a dense-like layer.

    Returns `(z_lora, gradients)`; `gradients(grad_z)` gives the factors of
    A and B: outer products with rank-sized tensors (for Dense, grad_B =
    scale (x A)^T dz and grad_A = scale x^T (dz B^T)).
    """
    x, w, out = letters
    first_letters, mid_letters, second_letters, a_first = _lora_equations(x, w, out)
    first, second = (a, b) if a_first else (b, a)
    # Applied in the inputs' dtype, as Keras applies the merged kernel.
    first_value = ops.cast(first, inputs.dtype)
    second_value = ops.cast(second, inputs.dtype)
    mid = ops.einsum(f"{x},{first_letters}->{mid_letters}", inputs, first_value)
    z = scale * ops.einsum(f"{mid_letters},{second_letters}->{out}", mid, second_value)

    def gradients(grad_z):
        batch = x[0]
        grad_mid = scale * tf.einsum(f"{out},{second_letters}->{mid_letters}",
                                     grad_z, second_value)
        return [(first, _einsum_factor(batch, x, first_letters, mid_letters, inputs,
                                       tuple(first.shape), grad_mid)),
                (second, _einsum_factor(batch, mid_letters, second_letters, out, scale * mid,
                                        tuple(second.shape), grad_z))]

    return z, gradients


def _einsum_dense(layer, args, kwargs):
    inputs = _first_input(args, kwargs)
    x, w, out = _einsum_plan(layer.equation, inputs.shape.rank)
    # The stored kernel: with LoRA it is frozen and `layer.kernel` merges A B.
    z = ops.einsum(layer.equation, inputs, layer._kernel)
    lora = None
    if layer.lora_enabled:
        lora = _lora_branch(inputs, (x, w, out), layer.lora_kernel_a, layer.lora_kernel_b,
                            _lora_scale(layer))
        z = ops.add(z, lora[0])
    if layer.bias is not None:
        z = ops.add(z, layer.bias)
    outputs = layer.activation(z) if layer.activation is not None else z

    def gradients(grad_z):
        found = [(layer._kernel, _einsum_factor(x[0], x, w, out, inputs,
                                                tuple(layer._kernel.shape), grad_z))]
        if lora is not None:
            found += lora[1](grad_z)
        if layer.bias is not None:
            found.append((layer.bias, PerExample(_sum_to_shape(grad_z, tuple(layer.bias.shape)))))
        return found

    return outputs, z, gradients


def _conv_supported(layer):
    # channels_first is left to the vectorized engine: TF cannot run it on
    # CPU, so that path could not be tested here.
    return (_unquantized(layer) and layer.rank in (1, 2) and getattr(layer, "groups", 1) == 1
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
        return _as_sequence(tf.image.extract_patches(
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
    inputs = _first_input(args, kwargs)
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
        g = _as_sequence(grad_z)
        if padded.shape[-1] == 1 and all(r == 1 for r in layer.dilation_rate) and runs_on_onednn():
            kernel = PerExample(_single_channel_conv_gradients(padded, grad_z, layer, padding))
        else:
            kernel = OuterProduct(_patches(padded, layer, padding), g)
        found = [(layer.kernel, kernel)]
        if layer.use_bias:
            found.append((layer.bias, PerExample(tf.reduce_sum(g, axis=1))))
        return found

    return outputs, z, gradients


def _embedding(layer, args, kwargs):
    inputs = _first_input(args, kwargs)
    if inputs.dtype not in ("int32", "int64"):
        inputs = ops.cast(inputs, "int32")
    # The stored table: with LoRA it is frozen and `layer.embeddings` merges A B.
    outputs = ops.take(layer._embeddings, inputs, axis=0)
    if layer.lora_enabled:
        scale = _lora_scale(layer)
        rows_a = ops.take(layer.lora_embeddings_a, inputs, axis=0)
        b = ops.convert_to_tensor(layer.lora_embeddings_b)
        outputs = ops.add(outputs, scale * ops.matmul(rows_a, b))
    outputs = ops.cast(outputs, layer.compute_dtype)

    def gradients(grad):
        grad = _as_sequence(grad)  # [B, T, p]
        ids = tf.reshape(inputs, [-1, grad.shape[1]] if grad.shape[1] is not None
                         else [tf.shape(inputs)[0], -1])
        # ops.take reads id -k as row input_dim - k: so must the gradient.
        ids = tf.where(ids < 0, ids + tf.cast(layer.input_dim, ids.dtype), ids)
        found = [(layer._embeddings, GatheredRows(ids, grad, layer.input_dim))]
        if layer.lora_enabled:
            # out = E[ids] + scale * A[ids] B: grad_A gathers scale * dz B^T by
            # id, grad_B = scale * A[ids]^T dz.
            grad = tf.cast(grad, b.dtype)
            found += [(layer.lora_embeddings_a,
                       GatheredRows(ids, scale * tf.matmul(grad, b, transpose_b=True),
                                    layer.input_dim)),
                      (layer.lora_embeddings_b,
                       OuterProduct(scale * _as_sequence(rows_a), grad))]
        return found

    return outputs, outputs, gradients


def _reversible_embedding(layer, args, kwargs):
    reverse = kwargs.get("reverse", args[1] if len(args) > 1 else False)
    inputs = _first_input(args, kwargs)
    if not reverse:
        outputs, watched, gradients = _embedding(layer, (inputs,), {})
        # As ReversibleEmbedding.call: its compute_mask returns None.
        mask = keras.layers.Embedding.compute_mask(layer, inputs)
        if mask is not None:
            set_keras_mask(outputs, mask)
        return outputs, watched, gradients
    # Logits x W^T with W the (tied) table [V, D], or x W with the separate
    # reverse table [D, V]: a dense-like layer, with the tied table's LoRA.
    dtype = layer.reverse_dtype or layer.compute_dtype
    inputs = ops.cast(inputs, dtype)
    if layer.tie_weights:
        kernel, letters = layer._embeddings, _einsum_plan("...a,ba->...b", inputs.shape.rank)
    else:
        kernel, letters = layer.reverse_embeddings, _einsum_plan("...a,ab->...b",
                                                                 inputs.shape.rank)
    x, w, out = letters
    logits = ops.einsum(f"{x},{w}->{out}", inputs, ops.cast(kernel, dtype))
    lora = None
    if layer.tie_weights and layer.lora_enabled:
        lora = _lora_branch(inputs, letters, layer.lora_embeddings_a, layer.lora_embeddings_b,
                            _lora_scale(layer))
        logits = ops.add(logits, lora[0])
    outputs = logits
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        outputs = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)

    def gradients(grad):
        found = [(kernel, _einsum_factor(x[0], x, w, out, inputs, tuple(kernel.shape), grad))]
        return found + (lora[1](grad) if lora is not None else [])

    return outputs, logits, gradients


def _affine_gradients(layer, normalized, grad, broadcast_shape):
    """Per-example gradients of `gamma` (scale) and `beta` (offset) of a normalization."""
    found = []
    if getattr(layer, "gamma", None) is not None:
        scale = _sum_to_shape(normalized * grad, broadcast_shape)
        found.append((layer.gamma, PerExample(tf.reshape(scale, [-1, *layer.gamma.shape]))))
    if getattr(layer, "beta", None) is not None:
        offset = _sum_to_shape(grad, broadcast_shape)
        found.append((layer.beta, PerExample(tf.reshape(offset, [-1, *layer.beta.shape]))))
    return found


def _layer_normalization(layer, args, kwargs):
    # Same arithmetic as keras.ops.layer_normalization, with the normalized
    # input kept for the per-example gradient of gamma.
    inputs = _first_input(args, kwargs)
    x = tf.convert_to_tensor(inputs)
    x = tf.cast(x, tf.float32) if x.dtype in (tf.float16, tf.bfloat16) else x
    rank = x.shape.rank
    axes = sorted(a % rank for a in layer.axis)
    if 0 in axes:
        raise ValueError(f"LayerNormalization '{layer.name}' normalizes over the batch axis; "
                         "its per-example gradients are undefined.")
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
    inputs = tf.convert_to_tensor(_first_input(args, kwargs))
    rank = inputs.shape.rank
    axis = layer.axis % rank
    if axis == 0:
        raise ValueError(f"GroupNormalization '{layer.name}' uses the batch axis as channels.")
    channels = inputs.shape[axis]
    shape = tf.shape(inputs)
    group_shape = [shape[k] if inputs.shape[k] is None else inputs.shape[k] for k in range(rank)]
    group_shape[0] = -1
    group_shape[axis] = channels // layer.groups
    group_shape.insert(axis, layer.groups)
    grouped = tf.reshape(inputs, group_shape)
    dtype = tf.float32 if grouped.dtype in (tf.float16, tf.bfloat16) else grouped.dtype
    grouped = tf.cast(grouped, dtype)
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
    x = tf.convert_to_tensor(_first_input(args, kwargs))
    x = tf.cast(x, tf.float32) if x.dtype in (tf.float16, tf.bfloat16) else x
    inv = tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=layer.axis, keepdims=True)
                        + layer.epsilon)
    normalized = x * inv
    outputs = normalized * tf.cast(layer.scale, x.dtype)
    outputs = ops.cast(outputs, layer.compute_dtype)

    def gradients(grad):
        scale = _sum_to_shape(normalized * tf.cast(grad, x.dtype), tuple(layer.scale.shape))
        return [(layer.scale, PerExample(scale))]

    return outputs, outputs, gradients


register_norm_function(keras.layers.Dense, _dense, applies_to=_unquantized)
register_norm_function(keras.layers.EinsumDense, _einsum_dense, applies_to=_einsum_supported)
register_norm_function(keras.layers.Conv1D, _conv, applies_to=_conv_supported)
register_norm_function(keras.layers.Conv2D, _conv, applies_to=_conv_supported)
register_norm_function(keras.layers.Embedding, _embedding, applies_to=_unquantized)
if hasattr(keras.layers, "ReversibleEmbedding"):  # Not in older Keras 3 releases.
    register_norm_function(keras.layers.ReversibleEmbedding, _reversible_embedding,
                           applies_to=_unquantized)
register_norm_function(keras.layers.LayerNormalization, _layer_normalization)
register_norm_function(keras.layers.GroupNormalization, _group_normalization)
register_norm_function(keras.layers.RMSNormalization, _rms_normalization)


# --------------------------------------------------- norms and clipped sums

# Outer-product factors: "auto" picks per layer (see _outer_method); "gram"
# and "direct" force one formula (used by the tests to check both).
_OUTER_METHODS = ("auto", "gram", "direct")
# Embeddings with at most this many positions per example use the masked
# Gram formula (XLA-compatible); longer ones group ids with tf.unique.
_MAX_ROWS_GRAM_STEPS = 512


def _mask_rows(tensor, mask):
    """Zeroes the examples (leading rows) where `mask` is False."""
    if mask is None:
        return tensor
    shape = [-1] + [1] * (tensor.shape.rank - 1)
    return tf.where(tf.reshape(mask, shape), tensor, tf.zeros_like(tensor))


def _scale_rows(tensor, scale):
    shape = [-1] + [1] * (tensor.shape.rank - 1)
    return tensor * tf.reshape(tf.cast(scale, tensor.dtype), shape)


def _outer_to_variable(matrix, factor, shape, batched=False):
    """Maps a [(B,) d, p] outer-product gradient to the weight's layout."""
    lead = [-1] if batched else []
    if factor.split_shape is None:
        return tf.reshape(matrix, lead + list(shape))
    matrix = tf.reshape(matrix, lead + list(factor.split_shape))
    if factor.perm is not None and list(factor.perm) != list(range(len(factor.perm))):
        offset = len(lead)
        matrix = tf.transpose(matrix, list(range(offset)) + [offset + k for k in factor.perm])
    return tf.reshape(matrix, lead + list(shape))


def _outer_method(factor, method):
    if method != "auto":
        return method
    steps = factor.inputs.shape[1]
    d, p = factor.inputs.shape[-1], factor.output_grads.shape[-1]
    if d is None or p is None:
        return "direct"
    if steps is None:  # Unknown length: bound the per-example gradients' memory.
        return "gram" if d * p > 2 ** 16 else "direct"
    # The direct per-example gradient takes d*p floats per example, the Gram
    # matrices 2*T^2 and the inputs/output gradients already held T*(d+p):
    # materialize per-example gradients only when they are not larger than
    # what the layer already keeps, else use the Gram formula. Direct is
    # never more arithmetic (its clipped sum is a [B]-weighted sum of the
    # per-example gradients, the Gram one a matmul over all B*T rows).
    return "gram" if d * p > steps * (d + p) else "direct"


class _Contribution:
    """Per-example squared norms and clipped sum of one variable."""

    def __init__(self, sq_norms, weighted_sum):
        self.sq_norms = sq_norms
        self._weighted_sum = weighted_sum

    def weighted_sum(self, scale, mask):
        return self._weighted_sum(scale, mask)


def _outer_contribution(factor, shape, method):
    a, g = factor.inputs, factor.output_grads
    method = _outer_method(factor, method)
    if method == "direct":
        # TF's CPU batched matmul is markedly faster with the longer
        # dimension last, so the [B, p, d] transpose is formed when d >= p.
        d, p = a.shape[-1], g.shape[-1]
        transposed = d is not None and p is not None and d >= p
        if transposed:
            per_example = tf.linalg.matmul(g, a, transpose_a=True)  # [B, p, d]
        else:
            per_example = tf.linalg.matmul(a, g, transpose_a=True)  # [B, d, p]
        sq_norms = tf.reduce_sum(tf.square(per_example), axis=[1, 2])

        def weighted(scale, mask):
            total = tf.tensordot(tf.cast(scale, per_example.dtype),
                                 _mask_rows(per_example, mask), axes=1)
            if transposed:
                total = tf.transpose(total)
            return _outer_to_variable(total, factor, shape)

        return _Contribution(sq_norms, weighted)

    if a.shape[1] == 1:  # ||x_i^T g_i||^2 = ||x_i||^2 ||g_i||^2
        sq_norms = (tf.reduce_sum(tf.square(a), axis=[1, 2])
                    * tf.reduce_sum(tf.square(g), axis=[1, 2]))
    else:
        gram_a = tf.linalg.matmul(a, a, transpose_b=True)
        gram_g = tf.linalg.matmul(g, g, transpose_b=True)
        sq_norms = tf.reduce_sum(gram_a * gram_g, axis=[1, 2])

    def weighted(scale, mask):
        d, p = a.shape[-1], g.shape[-1]
        flat_a = tf.reshape(_mask_rows(a, mask), [-1, d])
        flat_g = tf.reshape(_scale_rows(_mask_rows(g, mask), scale), [-1, p])
        return _outer_to_variable(tf.linalg.matmul(flat_a, flat_g, transpose_a=True),
                                  factor, shape)

    return _Contribution(sq_norms, weighted)


def _per_example_contribution(factor, shape):
    grads = factor.grads
    sq_norms = tf.reduce_sum(tf.reshape(tf.square(grads), [tf.shape(grads)[0], -1]), axis=1)

    def weighted(scale, mask):
        total = tf.tensordot(tf.cast(scale, grads.dtype), _mask_rows(grads, mask), axes=1)
        return tf.reshape(total, shape)

    return _Contribution(sq_norms, weighted)


def _rows_contribution(factor, shape):
    ids, g = factor.ids, factor.output_grads
    steps = g.shape[1]
    if steps == 1:
        sq_norms = tf.reduce_sum(tf.square(g), axis=[1, 2])
    elif steps is not None and steps <= _MAX_ROWS_GRAM_STEPS:
        # sum over position pairs with the same id of <g_t, g_s>.
        same = tf.equal(ids[:, :, None], ids[:, None, :])
        gram = tf.linalg.matmul(g, g, transpose_b=True)
        sq_norms = tf.reduce_sum(tf.where(same, gram, tf.zeros_like(gram)), axis=[1, 2])
    else:
        sq_norms = _rows_sq_norms_by_unique(ids, g, factor.num_rows)

    def weighted(scale, mask):
        values = _scale_rows(_mask_rows(g, mask), scale)
        total = tf.math.unsorted_segment_sum(
            tf.reshape(values, [-1, g.shape[-1]]), tf.reshape(ids, [-1]), factor.num_rows)
        return tf.reshape(total, shape)

    return _Contribution(sq_norms, weighted)


def _rows_sq_norms_by_unique(ids, g, num_rows):
    batch = tf.shape(ids)[0]
    example = tf.broadcast_to(tf.range(tf.cast(batch, tf.int64))[:, None], tf.shape(ids))
    keys = tf.reshape(example * num_rows + tf.cast(ids, tf.int64), [-1])
    unique, index = tf.unique(keys)
    sums = tf.math.unsorted_segment_sum(tf.reshape(g, [-1, g.shape[-1]]), index,
                                        tf.shape(unique)[0])
    return tf.math.unsorted_segment_sum(tf.reduce_sum(tf.square(sums), axis=1),
                                        unique // num_rows, batch)


def _to_per_example(factor, shape):
    """Materializes any factor as per-example gradients [B, *shape]."""
    if isinstance(factor, PerExample):
        return factor.grads
    if isinstance(factor, OuterProduct):
        per_example = tf.linalg.matmul(factor.inputs, factor.output_grads, transpose_a=True)
        return _outer_to_variable(per_example, factor, shape, batched=True)
    batch = tf.shape(factor.ids)[0]
    example = tf.broadcast_to(tf.range(batch)[:, None], tf.shape(factor.ids))
    keys = tf.reshape(example * factor.num_rows + tf.cast(factor.ids, tf.int32), [-1])
    rows = tf.math.unsorted_segment_sum(
        tf.reshape(factor.output_grads, [-1, factor.output_grads.shape[-1]]), keys,
        batch * factor.num_rows)
    return tf.reshape(rows, [-1, *shape])


def _widened(factor):
    """`factor` with its float16 / bfloat16 tensors cast to float32.

    Under mixed precision the forward and backward passes run in half
    precision, but every norm and the clipped sum are computed in float32
    from the same factor values, so the clip bound holds on the float32
    gradient that is applied.
    """
    def widen(t):
        return tf.cast(t, tf.float32) if t.dtype in (tf.float16, tf.bfloat16) else t

    if isinstance(factor, OuterProduct):
        return OuterProduct(widen(factor.inputs), widen(factor.output_grads),
                            factor.split_shape, factor.perm)
    if isinstance(factor, GatheredRows):
        return GatheredRows(factor.ids, widen(factor.output_grads), factor.num_rows)
    if isinstance(factor, PerExample):
        return PerExample(widen(factor.grads))
    return factor  # Refused by _contribution.


def _merge(factors, shape):
    """One factor equal to the sum of `factors` (all for the same variable)."""
    if len(factors) == 1:
        return factors[0]
    first = factors[0]
    if all(isinstance(f, OuterProduct) for f in factors):
        layouts = {(f.inputs.shape[-1], f.output_grads.shape[-1], f.split_shape, f.perm)
                   for f in factors}
        if len(layouts) == 1:  # Concatenating positions sums the outer products.
            return OuterProduct(tf.concat([f.inputs for f in factors], axis=1),
                                tf.concat([f.output_grads for f in factors], axis=1),
                                first.split_shape, first.perm)
    if all(isinstance(f, GatheredRows) for f in factors):
        if len({f.num_rows for f in factors}) == 1:
            return GatheredRows(tf.concat([tf.cast(f.ids, tf.int64) for f in factors], axis=1),
                                tf.concat([f.output_grads for f in factors], axis=1),
                                first.num_rows)
    return PerExample(tf.add_n([_to_per_example(f, shape) for f in factors]))


def _contribution(factor, shape, method):
    if isinstance(factor, OuterProduct):
        return _outer_contribution(factor, shape, method)
    if isinstance(factor, GatheredRows):
        return _rows_contribution(factor, shape)
    if isinstance(factor, PerExample):
        return _per_example_contribution(factor, shape)
    raise TypeError(f"A norm function returned {factor!r}; expected an OuterProduct, "
                    "PerExample or GatheredRows factor.")


# ------------------------------------------------------- recorded forward


class _Call:
    def __init__(self, layer, watched, gradients_fn, reads):
        self.layer = layer
        self.watched = watched
        self.gradients_fn = gradients_fn
        self.reads = reads


_MISSING = object()


class _Recorder:
    """Routes layer calls through norm functions during one forward pass."""

    def __init__(self, variables):
        self.index = {_key(v): i for i, v in enumerate(variables)}
        self.calls = []
        self.guards = []
        self._active_guards = []
        self._tape = None

    @contextlib.contextmanager
    def patched(self, model, tape):
        self._tape = tape
        patched = []
        with _PATCH_LOCK:
            try:
                for layer in model._flatten_layers(include_self=True, recursive=True):
                    rule = _rule_for(layer) if _own_trainable(layer, self.index) else None
                    original = layer.call
                    wrapper = (self._rule_call(layer, rule) if rule is not None
                               else self._guarded_call(layer, original))
                    patched.append((layer, layer.__dict__.get("call", _MISSING)))
                    object.__setattr__(layer, "call", wrapper)
                yield
            finally:
                for layer, previous in reversed(patched):
                    if previous is _MISSING:
                        layer.__dict__.pop("call", None)
                    else:
                        object.__setattr__(layer, "call", previous)

    def _rule_call(self, layer, rule):
        def call(*args, **kwargs):
            # Recording from the inputs on makes every tensor the norm function
            # computes differentiable, also one that no trainable weight feeds.
            self._tape.watch([t for t in tf.nest.flatten((args, kwargs))
                              if tf.is_tensor(t) and t.dtype.is_floating])
            with contextlib.ExitStack() as paused:
                # Reads inside the norm function are accounted for by it.
                for guard in self._active_guards:
                    paused.enter_context(guard.stop_recording())
                with tf.GradientTape() as reads:
                    outputs, watched, gradients_fn = rule(layer, args, kwargs)
            self._tape.watch(watched)
            self.calls.append(_Call(layer, watched, gradients_fn, reads.watched_variables()))
            return outputs
        return call

    def _guarded_call(self, layer, original):
        def call(*args, **kwargs):
            guard = tf.GradientTape()
            with guard:
                self._active_guards.append(guard)
                try:
                    outputs = original(*args, **kwargs)
                finally:
                    self._active_guards.pop()
            self.guards.append((layer, guard))
            return outputs
        return call

    def check_guards(self):
        for layer, guard in self.guards:
            stray = [v for v in guard.watched_variables() if _key(v) in self.index]
            if stray:
                raise UnsupportedModelError(
                    f"Layer '{layer.name}' ({type(layer).__name__}) reads trainable weights "
                    f"{sorted({v.name for v in stray})} outside any registered norm function, so "
                    "ghost clipping cannot compute exact per-example norms. Register a norm "
                    "function for it (keras_dp.ghost.register_norm_function) or use the "
                    "vectorized engine (keras_dp.clipping.clipped_gradient_sum).")

    def factors(self, grads):
        """Factors of every covered variable: {variable index: [factor, ...]}."""
        found = {}
        for call, grad in zip(self.calls, grads):
            reported = set()
            for variable, factor in call.gradients_fn(grad):
                key = _key(variable)
                if key in self.index:
                    found.setdefault(self.index[key], []).append(factor)
                    reported.add(key)
            missing = [v.name for v in call.reads
                       if _key(v) in self.index and _key(v) not in reported]
            if missing:
                raise UnsupportedModelError(
                    f"The norm function of layer '{call.layer.name}' "
                    f"({type(call.layer).__name__}) reads trainable weights {sorted(missing)} "
                    "but reports no per-example gradient for them.")
        return found


def _refuse_data_losses(model):
    data_losses = [l for layer in model._flatten_layers() for l in layer._get_own_losses()]
    if data_losses:
        raise UnsupportedModelError(
            "Ghost clipping cannot split add_loss() terms (e.g. activity regularizers) "
            "per example; use the vectorized engine (keras_dp.clipping) for this model.")


def _norm_dtype(variables):
    return tf.float64 if any(v.dtype == "float64" for v in variables) else tf.float32


def _ghost_pass(model, batch, variables, per_example_loss_fn, outer_method, keep_tape):
    """The recorded forward pass, its backward pass and the per-variable contributions."""
    if outer_method not in _OUTER_METHODS:
        raise ValueError(f"outer_method must be one of {_OUTER_METHODS}; got {outer_method!r}.")
    recorder = _Recorder(variables)
    with tf.GradientTape(persistent=keep_tape) as tape:
        with recorder.patched(model, tape):
            y_pred = model(batch["x"], training=True)
        _refuse_data_losses(model)
        losses = per_example_loss_fn(batch, y_pred)
        if losses.shape.rank != 1:
            raise ValueError("per_example_loss_fn must return a [batch_size] vector; "
                             f"got shape {losses.shape}.")
        total = tf.reduce_sum(losses)
    recorder.check_guards()
    grads = tape.gradient(total, [call.watched for call in recorder.calls],
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    # Some gradients (a concatenation's slices) lose static dims when the
    # batch size is unknown, as for bucketed Poisson batches; the norm
    # functions need them, and they are the watched tensors' shapes.
    grads = [tf.ensure_shape(grad, call.watched.shape)
             for grad, call in zip(grads, recorder.calls)]
    contributions = {}
    for index, factors in recorder.factors(grads).items():
        shape = tuple(variables[index].shape)
        factors = [_widened(f) for f in factors]
        contributions[index] = _contribution(_merge(factors, shape), shape, outer_method)
    dtype = _norm_dtype(variables)
    sq_norms = tf.zeros(tf.shape(losses)[:1], dtype)
    for contribution in contributions.values():
        sq_norms += tf.cast(contribution.sq_norms, dtype)
    return y_pred, losses, tape, contributions, sq_norms


def per_example_norms(model, batch, variables, per_example_loss_fn, outer_method="auto"):
    """The `[B]` L2 norms of the per-example gradients w.r.t. `variables`."""
    variables = list(variables)
    _, _, _, _, sq_norms = _ghost_pass(model, batch, variables, per_example_loss_fn,
                                       outer_method, keep_tape=False)
    return tf.sqrt(sq_norms)


def clipped_gradient_sum(model, batch, variables, l2_norm_clip, per_example_loss_fn,
                         outer_method="auto", bookkeeping=True, jit_compile=False):
    """Sums per-example gradients, each clipped to `l2_norm_clip`, by ghost clipping.

    Same result and contract as `keras_dp.clipping.clipped_gradient_sum` with
    one microbatch per example, for models where `supports(model)`.

    Args:
        model: the Keras model; it is called once as
            `model(batch["x"], training=True)`.
        batch: dict with "x" (any structure the model takes) and whatever
            `per_example_loss_fn` reads ("y", "sample_weight").
        variables: the trainable variables to differentiate.
        l2_norm_clip: the clipping bound C.
        per_example_loss_fn: `(batch, y_pred) -> [B]` per-example losses
            (see `per_example_loss_fn` below for one built from compile()).
        outer_method: "auto" (per layer), or force "gram" / "direct".
        bookkeeping: True forms the clipped sum from the recorded pass; False
            runs a second backward pass of sum_i c_i loss_i (for comparison).
        jit_compile: True compiles this computation (forward, backward,
            norms, clipped sum) with XLA as one cluster inside the caller's
            graph, leaving the rest of the train step (e.g. noise
            generation, which XLA on CPU makes many times slower) to
            TensorFlow. Call it from a traced function (a train step).

    Returns:
        `(grad_sum, losses, outputs, num_nonfinite)`: the clipped sums (one
        per variable), the `[B]` per-example losses, the model outputs, and
        how many examples had a non-finite gradient norm (they contribute 0).
    """
    variables = list(variables)
    if jit_compile:
        compiled = tf.function(
            lambda batch, clip: clipped_gradient_sum(
                model, batch, variables, clip, per_example_loss_fn, outer_method, bookkeeping),
            jit_compile=True, autograph=False)
        return compiled(batch, tf.convert_to_tensor(l2_norm_clip, dtype_hint=tf.float32))
    y_pred, losses, tape, contributions, sq_norms = _ghost_pass(
        model, batch, variables, per_example_loss_fn, outer_method,
        keep_tape=not bookkeeping)
    norms = tf.sqrt(sq_norms)
    finite = tf.math.is_finite(norms)
    clip = tf.cast(tf.convert_to_tensor(l2_norm_clip, dtype_hint=norms.dtype), norms.dtype)
    scale = tf.where(finite, tf.minimum(tf.ones_like(norms), clip / tf.maximum(norms, 1e-12)),
                     tf.zeros_like(norms))
    scale = tf.stop_gradient(scale)

    def bookkept(mask):
        def run():
            return [contributions[i].weighted_sum(scale, mask) if i in contributions
                    else tf.zeros(v.shape, v.dtype) for i, v in enumerate(variables)]
        return run

    if bookkeeping:
        fast = bookkept(None)
    else:
        with tape:  # Record the reweighted loss on the same (persistent) tape.
            target = tf.reduce_sum(tf.cast(scale, losses.dtype) * losses)

        def fast():
            grads = tape.gradient(target, variables)
            return [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
                    for g, v in zip(grads, variables)]
    # A non-finite example would turn 0 * inf into NaN in the shared matmuls:
    # only then are its rows zeroed first.
    grad_sum = tf.cond(tf.reduce_all(finite), fast, bookkept(finite))
    grad_sum = [tf.cast(g, v.dtype) for g, v in zip(grad_sum, variables)]
    num_nonfinite = tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.int64))
    return grad_sum, losses, y_pred, num_nonfinite


# ------------------------------------------------ per-example compiled loss


# Keras loss functions whose value for row i depends on row i alone, as long
# as they reduce over no axis but the last (see `_is_row_wise`). Any other loss
# (Circle, Dice and Tversky with axis=None, a user's function or Loss
# subclass) may compare the rows of a batch, so it is evaluated on each
# example alone: exactly what the vectorized engine differentiates.
_ROW_WISE_FUNCTIONS = frozenset([
    keras.losses.binary_crossentropy, keras.losses.binary_focal_crossentropy,
    keras.losses.categorical_crossentropy, keras.losses.categorical_focal_crossentropy,
    keras.losses.categorical_hinge, keras.losses.cosine_similarity, keras.losses.ctc,
    keras.losses.hinge, keras.losses.huber, keras.losses.kl_divergence,
    keras.losses.log_cosh, keras.losses.mean_absolute_error,
    keras.losses.mean_absolute_percentage_error, keras.losses.mean_squared_error,
    keras.losses.mean_squared_logarithmic_error, keras.losses.poisson,
    keras.losses.sparse_categorical_crossentropy, keras.losses.squared_hinge,
])


def _is_row_wise(loss, y_pred):
    """True when `loss.call` on a batch gives row i's value from row i alone."""
    if getattr(loss, "fn", None) not in _ROW_WISE_FUNCTIONS:
        return False
    # Rank-1 predictions: the last axis IS the batch axis.
    rank = min(len(t.shape) for t in tf.nest.flatten(y_pred))
    axis = getattr(loss, "_fn_kwargs", {}).get("axis", -1)
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    return rank >= 2 and all(a is not None and a % rank != 0 for a in axes)


def _values_per_row(loss, y_true, y_pred):
    """`loss.call` evaluated on each example alone, stacked: `[B, ...]`."""
    def one_example(row):
        row_true, row_pred = tf.nest.map_structure(lambda t: t[None], row)
        values = ops.convert_to_tensor(loss.call(row_true, row_pred))
        # A leading axis of one is that example's batch axis.
        return values[0] if values.shape.rank and values.shape[0] == 1 else values
    return tf.vectorized_map(one_example, (y_true, y_pred))


class _PerExampleLoss:
    """Wraps a Keras `Loss`: returns the [B] vector whose entry i is the loss's
    value on the batch made of example i alone (its reduction, sample weight
    and Keras mask included). Row-wise Keras losses are evaluated once on the
    whole batch; any other loss on each example alone, so that no example's
    loss (hence gradient) can depend on the other examples of the batch."""

    _REDUCTIONS = ("sum_over_batch_size", "mean", "sum", "mean_with_sample_weight")

    def __init__(self, loss):
        if loss.reduction not in self._REDUCTIONS:
            raise ValueError(
                f"Loss '{loss.name}' has reduction={loss.reduction!r}; per-example losses "
                f"are defined for reductions {self._REDUCTIONS}.")
        self.loss = loss

    def __call__(self, y_true, y_pred, sample_weight=None):
        from keras.src.backend.common.masking import get_keras_mask
        from keras.src.losses import loss as loss_module

        loss = self.loss
        in_mask = get_keras_mask(y_pred)
        y_pred = tf.nest.map_structure(lambda t: ops.convert_to_tensor(t, dtype=loss.dtype), y_pred)
        y_true = tf.nest.map_structure(lambda t: ops.convert_to_tensor(t, dtype=loss.dtype), y_true)
        if _is_row_wise(loss, y_pred):
            values = loss.call(y_true, y_pred)
        else:
            values = _values_per_row(loss, y_true, y_pred)
        out_mask = get_keras_mask(values)
        masks = [m for m in (in_mask, out_mask) if m is not None]
        mask = None if not masks else (masks[0] if len(masks) == 1 else masks[0] & masks[1])
        values = ops.convert_to_tensor(values, dtype=loss.dtype)
        weights = (None if sample_weight is None
                   else ops.convert_to_tensor(sample_weight, values.dtype))
        # Merge the mask as 0/1 weights; the per-example rescaling follows.
        weights = loss_module.apply_mask(weights, mask, dtype=values.dtype, reduction="sum")
        if weights is not None:
            values, weights = loss_module.squeeze_or_expand_to_same_rank(values, weights)
            # A weight per example (the padding weights of Poisson batches)
            # applies to all of its loss values, e.g. every token of a sequence.
            while len(weights.shape) < len(values.shape):
                weights = ops.expand_dims(weights, -1)
            values = values * ops.cast(weights, values.dtype)
        rank = len(values.shape)
        per_example = ops.sum(values, axis=list(range(1, rank))) if rank > 1 else values
        count = float(np.prod(values.shape[1:])) if rank > 1 else 1.0
        if loss.reduction in ("sum_over_batch_size", "mean"):
            if mask is None:
                per_example = per_example / count
            else:  # Keras divides by the number of unmasked entries.
                mask = ops.cast(mask, values.dtype)
                valid = (ops.sum(mask, axis=list(range(1, len(mask.shape))))
                         if len(mask.shape) > 1 else mask)
                total = float(np.prod(mask.shape[1:])) if len(mask.shape) > 1 else 1.0
                per_example = ops.divide_no_nan(per_example * total / count, valid)
        elif loss.reduction == "mean_with_sample_weight":
            if weights is None:
                per_example = per_example / count
            else:
                w_rank = len(weights.shape)
                divisor = ops.sum(weights, axis=list(range(1, w_rank))) if w_rank > 1 else weights
                per_example = ops.divide_no_nan(per_example, ops.cast(divisor, values.dtype))
        return loss_module.scale_loss_for_distribution(per_example)


def per_example_loss_fn(model):
    """Builds `(batch, y_pred) -> [B]` per-example losses from `model.compile(loss=...)`.

    Entry i equals the compiled loss (`model._compile_loss`) of the batch made
    of example i alone, which is what `keras_dp.clipping` differentiates with
    one microbatch per example: loss names, multiple outputs (list or dict),
    `loss_weights`, sample weights (also per output) and Keras masks are
    handled by Keras' own CompileLoss, whose losses are swapped for their
    per-example versions during the call.

    Unsupported (raises): losses with reduction "none" or a custom reduction,
    losses that are not `keras.losses.Loss` objects or functions. The
    per-output loss trackers of a multi-output model are updated with the
    [B] vector of per-example losses (their mean per batch is the batch loss).
    """
    compile_loss = model._compile_loss
    if compile_loss is None:
        raise ValueError("The model has no compiled loss; call compile(loss=...) first.")

    def fn(batch, y_pred):
        with _per_example_losses(compile_loss):
            losses = compile_loss.call(batch.get("y"), y_pred, batch.get("sample_weight"))
        return tf.reshape(losses, [-1])

    return fn


@contextlib.contextmanager
def _per_example_losses(compile_loss):
    with _PATCH_LOCK:
        original_build = compile_loss.build
        state = {"flat": compile_loss._flat_losses}

        def swap():
            state["flat"] = compile_loss._flat_losses
            compile_loss._flat_losses = [
                entry._replace(loss=_PerExampleLoss(entry.loss)) for entry in state["flat"]]

        def build(y_true, y_pred):
            original_build(y_true, y_pred)
            swap()

        if compile_loss.built:
            swap()
        object.__setattr__(compile_loss, "build", build)
        try:
            yield
        finally:
            compile_loss.__dict__.pop("build", None)
            compile_loss._flat_losses = state["flat"]
