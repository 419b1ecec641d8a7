"""Ghost clipping for the layers of Keras Hub's text backbones (`keras-dp[hub]`).

A lazy plugin (`keras_dp.clipping.registry.register_lazy_plugin`): the
engine imports this module the first time it meets a layer defined in
`keras_hub`, so keras-hub stays an optional dependency. What covers the
layers of `GPT2Backbone` and `BertBackbone`:

* `PositionEmbedding`: here; its per-example gradient gathers the output
  gradients by position, like an embedding of the position ids.
* `ReversibleEmbedding` (token embeddings, tied with the output projection
  of the language-model heads): Keras' own layer, covered in
  `keras_dp.clipping.layers.embedding`; the engine sums the two uses of a
  tied table exactly.
* `TokenAndPositionEmbedding`, `TransformerEncoder`, `TransformerDecoder`
  and `CachedMultiHeadAttention` have no weights of their own: their
  sublayers (Dense, EinsumDense with or without LoRA, LayerNormalization,
  the embeddings above) are covered.

A Keras Hub layer not covered (another model's custom normalization, say)
makes `keras_dp.clipping.ghost.supports` False, so "auto" uses the vectorized
engine.
"""

import keras_hub
from keras import ops

from keras_dp.clipping.factors import GatheredRows
from keras_dp.clipping.factors import as_sequence
from keras_dp.clipping.registry import first_input
from keras_dp.clipping.registry import register_norm_function


def _position_embedding(layer, args, kwargs):
    # Same values as PositionEmbedding.call outside vLLM serving: rows
    # start_index .. start_index + T of the table, or the given positions.
    inputs = first_input(args, kwargs)
    start_index = kwargs.get("start_index", args[1] if len(args) > 1 else 0)
    positions = kwargs.get("positions", args[2] if len(args) > 2 else None)
    shape = ops.shape(inputs)
    if positions is None:
        positions = ops.arange(shape[-2]) + start_index
    ids = ops.broadcast_to(positions, shape[:-1])
    outputs = ops.take(layer.position_embeddings, ids, axis=0)

    def gradients(grad):
        grad = as_sequence(grad)
        rows = ops.reshape(ids, (-1, grad.shape[1]))
        return [(layer.position_embeddings,
                 GatheredRows(rows, grad, layer.sequence_length))]

    return outputs, outputs, gradients


register_norm_function(keras_hub.layers.PositionEmbedding, _position_embedding)
