"""LoRA, frozen layers and mixed precision on the ghost engine, against brute force.

`check` (tests/brute_force.py) compares the clipped sums and per-example norms
of ghost clipping with an eager per-example loop, to a relative L2 error of
1e-5 in float32. LoRA's B starts at zero in Keras, which would make every
gradient of A zero: the tests draw B at random so that both factors matter.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from brute_force import RTOL, check, labels, per_example_loss, rng
from keras_dp.clipping import ghost
from keras_dp.clipping import vectorized
from small_models import Scale, lora_attention_classifier, sequential

# Whole private steps: the Dense and EinsumDense norm functions LoRA's
# factors go through are checked in both of make test's runs by
# tests/clipping, so each test here runs in one of them, in turns.
pytestmark = pytest.mark.alternating


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
    # The Gram route's norms bound its float32 weighted sum's rounding too:
    # above the exact ones by up to gamma_{B T} times the positions' norms
    # (`contributions._upper_bound`), which clips 1.1e-5 harder here with
    # oneDNN off on a CPU with AMX (2e-7 by the direct route).
    for method, rtol in (("gram", 1e-4), ("direct", RTOL)):
        check(model, batch, outer_method=method, rtol=rtol)


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


def test_frozen_layers_need_no_norm_function():
    # Scale has no norm function; frozen, it is only run forward.
    model = sequential((6, 5), Scale(), keras.layers.Dense(4, activation="tanh"))
    model.layers[0].trainable = False
    lora(model.layers[1])
    assert ghost.supports(model)
    check(model, {"x": rng().normal(size=(8, 6, 5)).astype("float32"), "y": labels(8)})


def test_lora_kernel_factorization_without_two_einsums_is_refused():
    # The kernel's last axis is both an input and an output axis: LoRA's A B
    # cannot be split into two einsums, so the model is not covered...
    model = sequential((4, 5), keras.layers.EinsumDense("abc,bc->abc", (4, 5)))
    lora(model.layers[0])
    assert any("EinsumDense" in reason for reason in ghost.unsupported_layers(model))
    private = keras_dp.make_private(model, clipping_engine="ghost")
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng().normal(size=(8, 4, 5)).astype("float32")
    with pytest.raises(ValueError, match="norm function"):  # ...ghost refuses it,
        private.train_on_batch(x, labels(8))
    private.clipping_engine = "auto"  # ...and "auto" uses the vectorized engine.
    private.train_on_batch(x, labels(8))
    assert private.privacy_steps == 1


@pytest.fixture
def ghost_engine_only(monkeypatch):
    """Fails a test whose private step would use the vectorized engine."""
    def refuse(*args, **kwargs):
        raise AssertionError("the vectorized engine was used")

    monkeypatch.setattr(vectorized, "clipped_gradient_sum", refuse)


def test_issue_reproduction_trains_on_the_ghost_engine(ghost_engine_only):
    # Runs with oneDNN off and on (`make test` runs the suite both ways).
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


# ------------------------------------------------------------- mixed precision
# The passes run in half precision, the norms and clipped sums in float32
# from the same half-precision factors; the brute-force loop differentiates
# in half precision. They differ by rounding of the half-precision type:
# measured up to 0.4% (bfloat16, 8-bit mantissa) and 0.1% (float16) on the
# norms and 1.2% / 0.2% on the clipped sums with oneDNN's kernels, but up to
# 5.1% for bfloat16 with TensorFlow's own (oneDNN off: a GroupNormalization
# and a convolution's bias), so the stated tolerances are 1e-1 and 5e-3; a
# wrong formula is off by far more. The clip bound itself holds in float32
# to 1e-6.
MIXED_RTOL = {"mixed_bfloat16": 1e-1, "mixed_float16": 5e-3}


@pytest.fixture(params=sorted(MIXED_RTOL))
def mixed_policy(request):
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy("float32")


def mixed_models():
    conv = sequential((8, 8, 1), keras.layers.Conv2D(4, 3, strides=2, activation="tanh"),
                      keras.layers.GroupNormalization(groups=2),
                      keras.layers.Conv2D(3, 2, padding="same"))
    lora(conv.layers[-1])  # The Dense head.
    attention = lora_attention_classifier(seq_len=6, vocab=11, b_initializer="he_uniform")
    return [(conv, rng().normal(size=(8, 8, 8, 1)).astype("float32")),
            (attention, rng().integers(0, 11, size=(8, 6)).astype("int32"))]


def test_mixed_precision_matches_brute_force(mixed_policy):
    for model, x in mixed_models():
        assert model.layers[-1].compute_dtype != "float32"
        assert all(v.dtype == "float32" for v in model.trainable_variables)
        # norms=False: the clipped sum, most examples clipped, is off by the
        # error of their norms; test_mixed_precision_clips_the_float32_gradient
        # holds a clipped example's norm to C in float32.
        check(model, {"x": x, "y": labels(8)}, rtol=MIXED_RTOL[mixed_policy], norms=False)


def test_mixed_precision_clips_the_float32_gradient(mixed_policy):
    model, x = mixed_models()[1]
    variables = model.trainable_variables
    clip = 1e-3  # Below every example's norm: each one is scaled to exactly C.
    step = tf.function(lambda batch: ghost.clipped_gradient_sum(
        model, batch, variables, clip, per_example_loss)[0], autograph=False)
    for i in range(4):  # A batch of one example: the sum is its clipped gradient.
        grads = step({"x": x[i:i + 1], "y": labels(8)[i:i + 1]})
        assert all(g.dtype == tf.float32 for g in grads)
        norm = np.sqrt(sum(np.sum(np.square(g.numpy().astype(np.float64))) for g in grads))
        np.testing.assert_allclose(norm, clip, rtol=1e-6)


def test_mixed_precision_trains_privately_on_the_ghost_engine(mixed_policy, ghost_engine_only):
    model = keras_dp.make_private(lora_attention_classifier())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = rng().integers(0, 100, size=(64, 16)).astype("int32")
    if mixed_policy == "mixed_float16":  # Keras' loss scaling is refused, with the fix.
        model.compile(optimizer=keras_dp.DPKerasSGD(1.0, 1.0), loss=loss)
        with pytest.raises(ValueError, match="auto_scale_loss=False"):
            model.fit(x, labels(64), batch_size=32, epochs=1, verbose=0)
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=loss, auto_scale_loss=False)
    history = model.fit(x, labels(64), batch_size=32, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert history.history["nonfinite_gradients"][-1] == 0
