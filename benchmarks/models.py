"""The benchmark models and their random data (no flags, no timing).

(a) the Fashion-MNIST CNN of the DP-SGD literature (reference.md), (b) a
784-512-512-10 MLP, (c) a 2-block pre-norm transformer text classifier
(vocabulary 10,000, sequence 64, width 64, 4 heads), (d) LoRA fine-tuning
of a GPT-2-shaped Keras Hub backbone (needs keras-hub: `pip install
'keras-dp[hub]'`).
"""

import keras
import numpy as np
import tensorflow as tf

import keras_dp

VOCAB_SIZE = 10000
SEQUENCE_LENGTH = 64
NUM_CLASSES = {"cnn": 10, "mlp": 10, "transformer": 2, "gpt2_lora": 2}
GPT2_VOCAB_SIZE = 50257
GPT2_SEQUENCE_LENGTH = 128


def cnn():
    """The Fashion-MNIST CNN of the DP-SGD literature (tanh activations)."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(10),
    ], name="cnn")


def mlp():
    """A 784-512-512-10 multilayer perceptron."""
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ], name="mlp")


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a `[B, T, D]` sequence."""

    def __init__(self, sequence_length, width, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = sequence_length
        self.width = width

    def build(self, input_shape):
        self.position_embeddings = self.add_weight(
            shape=(self.sequence_length, self.width), initializer="glorot_uniform",
            name="position_embeddings")

    def call(self, inputs):
        return inputs + self.position_embeddings[None, : keras.ops.shape(inputs)[1]]

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length,
                "width": self.width}


def position_embedding_norm(layer, args, kwargs):
    """Ghost norm function of PositionEmbedding, an example of the registry:
    example i's gradient is its output gradient, zero-padded to all positions."""
    inputs = args[0] if args else kwargs["inputs"]
    steps = inputs.shape[1]
    outputs = inputs + layer.position_embeddings[None, :steps]

    def gradients(grad):
        if steps != layer.sequence_length:
            grad = tf.pad(grad, [[0, 0], [0, layer.sequence_length - steps], [0, 0]])
        return [(layer.position_embeddings, keras_dp.PerExample(grad))]

    return outputs, outputs, gradients


keras_dp.register_norm_function(PositionEmbedding, position_embedding_norm)


def transformer(num_blocks=2, width=64, num_heads=4, sequence_length=SEQUENCE_LENGTH):
    """A small pre-norm transformer text classifier (token ids to 2 logits)."""
    tokens = keras.Input((sequence_length,), dtype="int32")
    x = keras.layers.Embedding(VOCAB_SIZE, width)(tokens)
    x = PositionEmbedding(sequence_length, width)(x)
    for _ in range(num_blocks):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.MultiHeadAttention(num_heads, key_dim=width // num_heads)(h, h)
        x = x + h
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(4 * width, activation="gelu")(h)
        h = keras.layers.Dense(width)(h)
        x = x + h
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Dense(NUM_CLASSES["transformer"])(x)
    return keras.Model(tokens, logits, name="transformer")


def gpt2_lora(num_layers=4, width=256, num_heads=4, rank=8):
    """A GPT-2-shaped backbone built from a config (random weights: GPT-2's
    vocabulary and layout, 4 layers of width 256, 128 tokens) with LoRA of
    rank 8 on its query and value projections (the rest frozen), and a
    classifier head on the mean of its token states."""
    import keras_hub
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=GPT2_VOCAB_SIZE, num_layers=num_layers, num_heads=num_heads,
        hidden_dim=width, intermediate_dim=4 * width,
        max_sequence_length=GPT2_SEQUENCE_LENGTH)
    backbone.enable_lora(rank)
    inputs = {name: keras.Input((GPT2_SEQUENCE_LENGTH,), dtype="int32", name=name)
              for name in ("token_ids", "padding_mask")}
    pooled = keras.layers.GlobalAveragePooling1D()(backbone(inputs))
    logits = keras.layers.Dense(NUM_CLASSES["gpt2_lora"])(pooled)
    return keras.Model(inputs, logits, name="gpt2_lora")


MODELS = {"cnn": cnn, "mlp": mlp, "transformer": transformer, "gpt2_lora": gpt2_lora}


def random_batch(model_name, batch_size, seed=0, sequence_length=SEQUENCE_LENGTH):
    """A fixed `(x, y)` batch of the model's input shape, as tensors."""
    rng = np.random.default_rng(seed)
    if model_name == "cnn":
        x = rng.random((batch_size, 28, 28, 1), dtype=np.float32)
    elif model_name == "mlp":
        x = rng.random((batch_size, 784), dtype=np.float32)
    elif model_name == "gpt2_lora":
        ids = rng.integers(0, GPT2_VOCAB_SIZE, size=(batch_size, GPT2_SEQUENCE_LENGTH))
        x = {"token_ids": tf.constant(ids.astype("int32")),
             "padding_mask": tf.ones((batch_size, GPT2_SEQUENCE_LENGTH), "int32")}
    else:
        x = rng.integers(0, VOCAB_SIZE, size=(batch_size, sequence_length)).astype("int32")
    y = rng.integers(0, NUM_CLASSES[model_name], size=batch_size).astype("int32")
    return tf.nest.map_structure(tf.constant, x), tf.constant(y)
