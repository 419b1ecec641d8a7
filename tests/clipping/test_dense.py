"""Dense, EinsumDense and MultiHeadAttention on the ghost engine, against brute force.
"""

import keras
import pytest

from brute_force import check, labels, rng
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
