"""Norm functions of Embedding and ReversibleEmbedding, with LoRA.

A table's per-example gradient gathers the output gradients by id
(`GatheredRows`). The reverse direction of a ReversibleEmbedding (logits
against the tied or separate table) is a dense-like map, handled with the
einsum and LoRA helpers of `keras_dp.clipping.layers.dense`; the engine sums
the two uses of a tied table exactly.
"""

import keras
import tensorflow as tf
from keras import ops
from keras.src.backend.common.masking import set_keras_mask

from keras_dp.clipping.factors import GatheredRows
from keras_dp.clipping.factors import OuterProduct
from keras_dp.clipping.factors import as_sequence
from keras_dp.clipping.layers.dense import einsum_factor
from keras_dp.clipping.layers.dense import einsum_plan
from keras_dp.clipping.layers.dense import lora_branch
from keras_dp.clipping.layers.dense import lora_scale
from keras_dp.clipping.registry import first_input
from keras_dp.clipping.registry import register_norm_function
from keras_dp.clipping.registry import unquantized


def _embedding(layer, args, kwargs):
    inputs = first_input(args, kwargs)
    if inputs.dtype not in ("int32", "int64"):
        inputs = ops.cast(inputs, "int32")
    # The stored table: with LoRA it is frozen and `layer.embeddings` merges A B.
    outputs = ops.take(layer._embeddings, inputs, axis=0)
    if layer.lora_enabled:
        scale = lora_scale(layer)
        rows_a = ops.take(layer.lora_embeddings_a, inputs, axis=0)
        b = ops.convert_to_tensor(layer.lora_embeddings_b)
        outputs = ops.add(outputs, scale * ops.matmul(rows_a, b))
    outputs = ops.cast(outputs, layer.compute_dtype)

    def gradients(grad):
        grad = as_sequence(grad)  # [B, T, p]
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
                       OuterProduct(scale * as_sequence(rows_a), grad))]
        return found

    return outputs, outputs, gradients


def _reversible_embedding(layer, args, kwargs):
    reverse = kwargs.get("reverse", args[1] if len(args) > 1 else False)
    inputs = first_input(args, kwargs)
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
        kernel, letters = layer._embeddings, einsum_plan("...a,ba->...b", inputs.shape.rank)
    else:
        kernel, letters = layer.reverse_embeddings, einsum_plan("...a,ab->...b",
                                                                 inputs.shape.rank)
    x, w, out = letters
    logits = ops.einsum(f"{x},{w}->{out}", inputs, ops.cast(kernel, dtype))
    lora = None
    if layer.tie_weights and layer.lora_enabled:
        lora = lora_branch(inputs, letters, layer.lora_embeddings_a, layer.lora_embeddings_b,
                            lora_scale(layer))
        logits = ops.add(logits, lora[0])
    outputs = logits
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        outputs = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)

    def gradients(grad):
        found = [(kernel, einsum_factor(x[0], x, w, out, inputs, tuple(kernel.shape), grad))]
        return found + (lora[1](grad) if lora is not None else [])

    return outputs, logits, gradients


register_norm_function(keras.layers.Embedding, _embedding, applies_to=unquantized)
if hasattr(keras.layers, "ReversibleEmbedding"):  # Not in older Keras 3 releases.
    register_norm_function(keras.layers.ReversibleEmbedding, _reversible_embedding,
                           applies_to=unquantized)
