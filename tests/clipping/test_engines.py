"""Both engines on what fit gives them: Poisson batches of unknown size,
padding rows, layers and losses that only look like covered ones.
"""

import keras
import numpy as np

import keras_dp
from brute_force import check_vectorized, labels, rng


def private(model, engine="auto", **optimizer_kwargs):
    """`model` made private with `engine` and compiled for one noiseless SGD step."""
    model = keras_dp.make_private(model, clipping_engine=engine)
    optimizer_kwargs.setdefault("l2_norm_clip", 1.0)
    optimizer_kwargs.setdefault("noise_multiplier", 0.0)
    model.compile(optimizer=keras_dp.DPKerasSGD(learning_rate=1.0, **optimizer_kwargs),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def dense_on_sequences():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8, 4)), keras.layers.Dense(3),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])


def test_vectorized_dense_on_sequences_with_an_unknown_batch_size():
    # vectorized_map once returned the kernel's clipped sum as [None, 3].
    batch = {"x": rng().normal(size=(8, 8, 4)).astype("float32"), "y": labels(8, classes=2)}
    check_vectorized(dense_on_sequences(), batch)


def test_vectorized_poisson_fit_of_dense_on_sequences():
    model = dense_on_sequences()
    before = [v.numpy() for v in model.trainable_variables]
    dp = private(model, "vectorized", noise_multiplier=1.1)
    dp.fit(rng().normal(size=(64, 8, 4)).astype("float32"), labels(64, classes=2),
           batch_size=16, epochs=1, verbose=0)
    assert all(not np.array_equal(b, v.numpy())
               for b, v in zip(before, model.trainable_variables))
