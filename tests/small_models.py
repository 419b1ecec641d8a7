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
