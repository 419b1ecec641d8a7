"""Norm functions of Dense and EinsumDense (hence MultiHeadAttention), with LoRA.

A kernel's per-example gradient is an outer product of the layer's inputs
and output gradients (after transposing an einsum's letters); a bias's is
the output gradient summed over positions. LoRA's A and B are outer
products with rank-sized tensors (see `lora_branch`), which embeddings'
LoRA (`keras_dp.clipping.layers.embedding`) shares.
"""

import string

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_dp.clipping.factors import OuterProduct
from keras_dp.clipping.factors import PerExample
from keras_dp.clipping.factors import as_sequence
from keras_dp.clipping.factors import sum_to_shape
from keras_dp.clipping.registry import UnsupportedModelError
from keras_dp.clipping.registry import first_input
from keras_dp.clipping.registry import register_norm_function
from keras_dp.clipping.registry import unquantized


def _dense(layer, args, kwargs):
    inputs = first_input(args, kwargs)
    # The stored kernel: with LoRA it is frozen and `layer.kernel` merges A B.
    z = ops.matmul(inputs, layer._kernel)
    lora = None
    if layer.lora_enabled:
        lora = lora_branch(inputs, einsum_plan("...a,ab->...b", inputs.shape.rank),
                            layer.lora_kernel_a, layer.lora_kernel_b, lora_scale(layer))
        z = ops.add(z, lora[0])
    if layer.bias is not None:
        z = ops.add(z, layer.bias)
    outputs = layer.activation(z) if layer.activation is not None else z

    def gradients(grad_z):
        found = [(layer._kernel, OuterProduct(as_sequence(inputs), as_sequence(grad_z)))]
        if lora is not None:
            found += lora[1](grad_z)
        if layer.bias is not None:
            found.append((layer.bias, PerExample(tf.reduce_sum(as_sequence(grad_z), axis=1))))
        return found

    return outputs, z, gradients


def einsum_plan(equation, input_rank):
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
        x, w, out = einsum_plan(layer.equation, input_rank)
    except ValueError:  # Ellipsis in the kernel.
        return None
    batch = x[0]
    if batch in w or not out.startswith(batch):  # Output rows must be the examples.
        return None
    # Every kernel letter must appear in the input or the output.
    return (x, w, out) if all(c in x or c in out for c in w) else None


def _einsum_supported(layer):
    if not unquantized(layer):
        return False
    # The input rank only matters for an ellipsis: check with one letter for it.
    letters = _einsum_letters(layer, len(layer.equation.split(",")[0].replace("...", "")) + 1)
    if letters is None:
        return False
    return not getattr(layer, "lora_enabled", False) or _lora_equations(*letters) is not None


def einsum_factor(batch, x, w, out, inputs, kernel_shape, grad_z):
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


def lora_scale(layer):
    return layer.lora_alpha / layer.lora_rank


def lora_branch(inputs, letters, a, b, scale):
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
        return [(first, einsum_factor(batch, x, first_letters, mid_letters, inputs,
                                       tuple(first.shape), grad_mid)),
                (second, einsum_factor(batch, mid_letters, second_letters, out, scale * mid,
                                        tuple(second.shape), grad_z))]

    return z, gradients


def _einsum_dense(layer, args, kwargs):
    inputs = first_input(args, kwargs)
    # Support is decided at the input's rank here: an ellipsis may move the
    # batch letter (review round 114: an equation checked at rank 4 and called
    # at rank 3 put the examples on the output's last axis, 8 C).
    letters = _einsum_letters(layer, inputs.shape.rank)
    if letters is None:
        raise UnsupportedModelError(
            f"Layer '{layer.name}' ({type(layer).__name__}) computes "
            f"'{layer.equation}' on inputs of rank {inputs.shape.rank}, whose output does "
            "not keep the examples on its first axis: ghost clipping cannot take its rows "
            "for the examples.")
    x, w, out = letters
    # The stored kernel: with LoRA it is frozen and `layer.kernel` merges A B.
    z = ops.einsum(layer.equation, inputs, layer._kernel)
    lora = None
    if layer.lora_enabled:
        lora = lora_branch(inputs, (x, w, out), layer.lora_kernel_a, layer.lora_kernel_b,
                            lora_scale(layer))
        z = ops.add(z, lora[0])
    if layer.bias is not None:
        z = ops.add(z, layer.bias)
    outputs = layer.activation(z) if layer.activation is not None else z

    def gradients(grad_z):
        found = [(layer._kernel, einsum_factor(x[0], x, w, out, inputs,
                                                tuple(layer._kernel.shape), grad_z))]
        if lora is not None:
            found += lora[1](grad_z)
        if layer.bias is not None:
            found.append((layer.bias, PerExample(sum_to_shape(grad_z, tuple(layer.bias.shape)))))
        return found

    return outputs, z, gradients


register_norm_function(keras.layers.Dense, _dense, applies_to=unquantized)
register_norm_function(keras.layers.EinsumDense, _einsum_dense, applies_to=_einsum_supported)
