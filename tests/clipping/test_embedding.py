"""Embedding on the ghost engine, against brute force.
"""

import keras
import numpy as np
import tensorflow as tf

from brute_force import check, labels, rng
from keras_dp.clipping import contributions
from keras_dp.clipping.factors import GatheredRows
from keras_dp.clipping.factors import OuterProduct
from small_models import sequential


def test_embedding_with_repeated_ids(monkeypatch):
    model = sequential((7,), keras.layers.Embedding(5, 4), keras.layers.Dense(3, activation="tanh"),
                       input_dtype="int32")
    batch = {"x": rng().integers(0, 5, size=(8, 7)).astype("int32"), "y": labels(8)}
    check(model, batch)
    # Long sequences group ids with tf.unique instead of the masked Gram matrix.
    monkeypatch.setattr(contributions, "_MAX_ROWS_GRAM_STEPS", 1)
    check(model, batch)


def test_an_id_outside_the_table_adds_to_no_example_s_rows():
    # Review round 26: a tied ReversibleEmbedding under XLA (whose gather
    # clamps such ids) merged its rows as example * rows + id, so example 1's
    # id 5 + 1 of a 5-row table landed in example 2's row 1: 3.5 C at B = 9.
    ids = tf.constant([[0, 2], [6, -7], [1, 3]])
    grads = tf.ones([3, 2, 4])
    rows = GatheredRows(ids, grads, 5)
    dense = OuterProduct(tf.zeros([3, 1, 5]), tf.zeros([3, 1, 4]))
    per_example = contributions.merge([rows, dense], (5, 4)).grads.numpy()
    np.testing.assert_array_equal(per_example[1], np.zeros((5, 4)))
    np.testing.assert_array_equal(per_example[2].sum(axis=1), [0, 4, 0, 4, 0])
