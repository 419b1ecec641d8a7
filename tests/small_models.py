"""Small models shared by the test files."""

import keras


def transformer_block(seq_len=6, vocab=11, width=8):
    """Embedding, self-attention, LayerNormalization and a GELU Dense: every
    kind of weight of a transformer, in a model small enough to check by brute force."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq_len,), dtype="int32")
    h = keras.layers.Embedding(vocab, width)(tokens)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = keras.layers.LayerNormalization()(h + attended)
    h = keras.layers.Dense(2 * width, activation="gelu")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(3)(h))


def lora_attention_classifier(seq_len=16, vocab=100, rank=4, b_initializer="zeros"):
    """The model of issue 17: a frozen Embedding, self-attention with LoRA on
    its four EinsumDense sublayers, average pooling and a LoRA Dense head."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq_len,), dtype="int32")
    embedding = keras.layers.Embedding(vocab, 32, trainable=False)
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16)
    h = embedding(tokens)
    h = keras.layers.GlobalAveragePooling1D()(attention(h, h))
    head = keras.layers.Dense(3)
    model = keras.Model(tokens, head(h))
    for dense in (attention.query_dense, attention.key_dense, attention.value_dense,
                  attention.output_dense, head):
        dense.enable_lora(rank, b_initializer=b_initializer)
    return model


def sequential(input_shape, *layers, input_dtype="float32", classes=3):
    """`layers` between an input of `input_shape` and a Flatten-Dense head of `classes` logits."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(input_shape, dtype=input_dtype), *layers,
                             keras.layers.Flatten(), keras.layers.Dense(classes)])


class Scale(keras.layers.Layer):
    """A custom layer with a weight and no norm function: w * x."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[1:], initializer="ones", name="w")

    def call(self, inputs):
        return inputs * self.w
