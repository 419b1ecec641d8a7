"""Dense, EinsumDense and MultiHeadAttention on the ghost engine, against brute force.
"""

import keras
import pytest
import tensorflow as tf

from brute_force import check, labels, rng
from keras_dp.clipping import ghost
from small_models import sequential, transformer_block


def test_dense_with_and_without_bias():
    model = sequential((5,), keras.layers.Dense(4, activation="tanh"),
                       keras.layers.Dense(4, use_bias=False, activation="relu"))
    check(model, {"x": rng().normal(size=(8, 5)).astype("float32") * 3, "y": labels(8)})


@pytest.mark.parametrize("outer_method", ["gram", "direct"])
def test_dense_on_sequences(outer_method):
    model = sequential((6, 5), keras.layers.Dense(4, activation="tanh"),
                       keras.layers.Dense(3, use_bias=False))
    batch = {"x": rng().normal(size=(8, 6, 5)).astype("float32"), "y": labels(8)}
    check(model, batch, outer_method=outer_method)


def test_einsum_dense_equations():
    inputs = keras.Input((4, 5))
    keras.utils.set_random_seed(0)
    branches = [
        keras.layers.EinsumDense("abc,cd->abd", (4, 3), bias_axes="d", activation="tanh")(inputs),
        keras.layers.EinsumDense("abc,dc->abd", (4, 3))(inputs),  # kernel stored [out, in]
        keras.layers.EinsumDense("abc,cde->abde", (4, 2, 3), bias_axes="de")(inputs),
        keras.layers.EinsumDense("...c,cd->...d", (3,), bias_axes="d")(inputs),
        keras.layers.EinsumDense("abc,bcd->abd", (4, 3), bias_axes="bd")(inputs),  # per-position
    ]
    flat = keras.layers.Concatenate()([keras.layers.Flatten()(b) for b in branches])
    model = keras.Model(inputs, keras.layers.Dense(3)(flat))
    check(model, {"x": rng().normal(size=(8, 4, 5)).astype("float32"), "y": labels(8)})


class CalledAtAnotherRank(keras.Model):
    """An EinsumDense built at rank 4 and called at rank 3 (its input spec
    dropped): the ellipsis is then empty and the examples land on the
    output's last axis."""

    def __init__(self):
        super().__init__()
        self.projection = keras.layers.EinsumDense("...atb,bc->...tca", (None, 1, None),
                                                   activation="softmax")
        self.projection.build((None, 5, 3, 4))
        self.projection.input_spec = None

    def call(self, x):
        return self.projection(x)


def test_an_einsum_dense_is_read_at_the_rank_it_is_called_with():
    """Review round 114: support was decided at a guessed rank, and the
    softmax normalized over the examples (8 C)."""
    model = CalledAtAnotherRank()
    x = rng().normal(size=(8, 8, 4)).astype("float32")
    model(x)
    with pytest.raises(ghost.UnsupportedModelError, match="rank 3"):
        tf.function(lambda b: ghost.clipped_gradient_sum(
            model, b, model.trainable_variables, 1.0,
            lambda batch, y_pred: tf.reduce_sum(y_pred, axis=[1, 2])), autograph=False)(
                {"x": x, "y": labels(8)})


def test_multi_head_attention():
    model = transformer_block()
    batch = {"x": rng().integers(0, 11, size=(8, 6)).astype("int32"), "y": labels(8)}
    check(model, batch)



def test_dense_on_a_lookups_one_hot_encoding():
    # StringLookup encodes as int64; Dense multiplies it as floats. Ghost
    # clipping failed with a dtype error (review round 7).
    vocabulary = ["a", "b", "c", "d"]
    inputs = keras.Input((), dtype="string")
    encoded = keras.layers.StringLookup(vocabulary=vocabulary, output_mode="one_hot")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(4)(encoded)))
    check(model, {"x": rng().choice(vocabulary + ["oov"], size=8), "y": labels(8)})
