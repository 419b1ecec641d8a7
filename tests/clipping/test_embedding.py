"""Embedding on the ghost engine, against brute force.
"""

import keras

from brute_force import check, labels, rng
from keras_dp.clipping import contributions
from small_models import sequential


def test_embedding_with_repeated_ids(monkeypatch):
    model = sequential((7,), keras.layers.Embedding(5, 4), keras.layers.Dense(3, activation="tanh"),
                       input_dtype="int32")
    batch = {"x": rng().integers(0, 5, size=(8, 7)).astype("int32"), "y": labels(8)}
    check(model, batch)
    # Long sequences group ids with tf.unique instead of the masked Gram matrix.
    monkeypatch.setattr(contributions, "_MAX_ROWS_GRAM_STEPS", 1)
    check(model, batch)
