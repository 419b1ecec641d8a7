"""LoRA, frozen layers and mixed precision on the ghost engine, against brute force.

`check` (tests/test_ghost.py) compares the clipped sums and per-example norms
of ghost clipping with an eager per-example loop, to a relative L2 error of
1e-5 in float32. LoRA's B starts at zero in Keras, which would make every
gradient of A zero: the tests draw B at random so that both factors matter.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from keras_dp import clipping
from keras_dp import ghost
from small_models import lora_attention_classifier
from test_ghost import check, labels, per_example_loss, rng, sequential


def lora(layer, rank=2, alpha=3):
    """Enables LoRA on a built layer with a random B (and alpha != rank)."""
    layer.enable_lora(rank, lora_alpha=alpha, b_initializer="he_uniform")
    return layer


def test_dense_with_lora_on_vectors_and_sequences():
    model = sequential((5,), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(4))
    lora(model.layers[0])
    assert [v.name for v in model.layers[0].trainable_variables] == [
        "bias", "lora_kernel_a", "lora_kernel_b"]
    check(model, {"x": rng().normal(size=(8, 5)).astype("float32") * 3, "y": labels(8)})
    model = sequential((6, 5), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3))
    lora(model.layers[0])
    lora(model.layers[1], rank=1, alpha=1)
    batch = {"x": rng().normal(size=(8, 6, 5)).astype("float32"), "y": labels(8)}
    for method in ("gram", "direct"):
        check(model, batch, outer_method=method)


def test_dense_with_lora_and_a_trainable_base_kernel():
    model = sequential((6, 5), keras.layers.Dense(4, activation="tanh"))
    lora(model.layers[0])
    model.layers[0]._kernel.trainable = True  # Full fine-tuning plus the adapter.
    assert len(model.layers[0].trainable_variables) == 4
    check(model, {"x": rng().normal(size=(8, 6, 5)).astype("float32"), "y": labels(8)})


def test_einsum_dense_with_lora():
    inputs = keras.Input((4, 5))
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.EinsumDense("abc,cd->abd", (4, 3), bias_axes="d", activation="tanh"),
        keras.layers.EinsumDense("abc,dc->abd", (4, 3)),  # Last kernel axis contracted.
        keras.layers.EinsumDense("abc,cde->abde", (4, 2, 3), bias_axes="de"),
        keras.layers.EinsumDense("...c,cd->...d", (3,), bias_axes="d"),
        keras.layers.EinsumDense("abc,bcd->abd", (4, 3), bias_axes="bd"),  # Per position.
    ]
    branches = [layer(inputs) for layer in layers]
    for layer in layers:
        lora(layer)
    flat = keras.layers.Concatenate()([keras.layers.Flatten()(b) for b in branches])
    model = keras.Model(inputs, keras.layers.Dense(3)(flat))
    check(model, {"x": rng().normal(size=(8, 4, 5)).astype("float32"), "y": labels(8)})


def test_attention_with_lora_einsum_sublayers_and_a_frozen_embedding():
    model = lora_attention_classifier(seq_len=6, vocab=11, b_initializer="he_uniform")
    assert not model.layers[1].trainable_variables  # The frozen embedding.
    check(model, {"x": rng().integers(0, 11, size=(8, 6)).astype("int32"), "y": labels(8)})


def test_embedding_with_lora_and_repeated_ids():
    model = sequential((7,), keras.layers.Embedding(5, 4), keras.layers.Dense(3, activation="tanh"),
                       input_dtype="int32")
    lora(model.layers[0])
    assert [v.name for v in model.layers[0].trainable_variables] == [
        "lora_embeddings_a", "lora_embeddings_b"]
    check(model, {"x": rng().integers(0, 5, size=(8, 7)).astype("int32"), "y": labels(8)})


def test_issue_reproduction_trains_on_the_ghost_engine(monkeypatch):
    # Runs with oneDNN off and on (`make test` runs the suite both ways).
    def vectorized(*args, **kwargs):
        raise AssertionError("the vectorized engine was used")

    monkeypatch.setattr(clipping, "clipped_gradient_sum", vectorized)
    model = keras_dp.make_private(lora_attention_classifier())
    assert ghost.supports(model)
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy() for v in model.trainable_variables]
    x = rng().integers(0, 100, size=(64, 16)).astype("int32")
    history = model.fit(x, labels(64), batch_size=32, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert model.privacy_steps == 2
    changed = [not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables)]
    assert all(changed)
    assert all("lora" in v.name or v.name == "bias" for v in model.trainable_variables)
