"""The ghost engine itself, against brute force: layers called twice, several
inputs, frozen layers, its variants (second backward pass, XLA, float64),
the vectorized engine, non-finite examples.
"""

import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from brute_force import RTOL, check, labels, per_example_loss, rng
from keras_dp import clipping
from keras_dp.clipping import ghost
from keras_dp.clipping.contributions import outer_methods
from keras_dp.clipping.contributions import to_contribution
from keras_dp.clipping.factors import OuterProduct
from keras_dp.clipping.factors import PerExample
from keras_dp.clipping.factors import with_output_gram
from small_models import sequential, transformer_block


def test_layers_used_twice_include_cross_terms():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 5))
    shared = keras.layers.Dense(5, activation="tanh")
    shared_conv = keras.layers.Conv1D(5, 2, padding="same")
    h = shared(shared(inputs))
    h = shared_conv(shared_conv(h))
    flat = keras.layers.Dense(20, activation="tanh")
    outputs = keras.layers.Dense(3)(flat(flat(keras.layers.Flatten()(h))))
    model = keras.Model(inputs, outputs)
    check(model, {"x": rng().normal(size=(8, 4, 5)).astype("float32"), "y": labels(8)})


def test_two_input_model_and_sample_weights():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((4, 2), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(4)(a),
                                    keras.layers.Flatten()(keras.layers.Dense(2)(b))])
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(h))
    batch = {"x": {"a": rng().normal(size=(8, 3)).astype("float32"),
                   "b": rng(2).normal(size=(8, 4, 2)).astype("float32")},
             "y": labels(8),
             "sample_weight": rng(3).uniform(0.2, 2.0, 8).astype("float32")}
    check(model, batch)


def test_frozen_layers_are_excluded():
    model = sequential((5,), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(4))
    model.layers[0].trainable = False
    check(model, {"x": rng().normal(size=(8, 5)).astype("float32"), "y": labels(8)})


@pytest.mark.slow  # bookkeeping=False is kept to measure; the default is tested throughout.
def test_second_backward_pass_agrees():
    model = transformer_block()
    check(model, {"x": rng().integers(0, 11, size=(8, 6)).astype("int32"), "y": labels(8)},
          bookkeeping=False)


# XLA compiles its own kernels: oneDNN's setting changes none of them, so one run.
@pytest.mark.once
def test_xla_agrees():
    model = transformer_block()
    batch = {"x": rng().integers(0, 11, size=(8, 6)).astype("int32"), "y": labels(8)}
    # The whole computation under XLA (the clipped sum: the norms, traced
    # again, are compared without XLA throughout)...
    check(model, batch, xla=True, norms=False)
    model = sequential((6, 5), keras.layers.Dense(4, activation="tanh"))
    batch = {"x": rng().normal(size=(8, 6, 5)).astype("float32"), "y": labels(8)}
    check(model, batch, jit_compile=True)  # ...or only the clipped sum.


def test_float64_is_exact_to_1e_10():
    keras.config.set_dtype_policy("float64")
    try:
        model = sequential((6, 6, 2), keras.layers.Conv2D(3, 3, strides=2, padding="same"),
                           keras.layers.LayerNormalization(), keras.layers.Dense(4),
                           keras.layers.Dense(4, activation="tanh"), input_dtype="float64")
        batch = {"x": rng().normal(size=(8, 6, 6, 2)), "y": labels(8)}
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None,
                                                          dtype="float64")
        check(model, batch, rtol=1e-10, outer_method="gram",
              loss_fn=lambda batch, y_pred: loss(batch["y"], y_pred))
        assert model.layers[0].kernel.dtype == "float64"
    finally:
        keras.config.set_dtype_policy("float32")


def test_agrees_with_the_vectorized_engine():
    model = transformer_block()
    batch = {"x": tf.constant(rng().integers(0, 11, size=(8, 6)).astype("int32")),
             "y": tf.constant(labels(8))}
    variables = model.trainable_variables

    def microbatch_loss(microbatch):
        y_pred = model(microbatch["x"], training=True)
        return tf.reduce_sum(per_example_loss(microbatch, y_pred)), y_pred

    vectorized = clipping.clipped_gradient_sum(microbatch_loss, variables, batch, 8, 0.1)
    ghosted = ghost.clipped_gradient_sum(model, batch, variables, 0.1, per_example_loss)
    scale = np.sqrt(sum(np.sum(v.numpy() ** 2) for v in vectorized[0]))
    for v, g in zip(vectorized[0], ghosted[0]):
        assert np.linalg.norm(g.numpy() - v.numpy()) <= RTOL * (np.linalg.norm(v) + 1e-2 * scale)
    np.testing.assert_allclose(ghosted[1], vectorized[1], rtol=RTOL)


def test_nonfinite_examples_are_counted_and_contribute_zero():
    model = sequential((4, 5), keras.layers.Dense(4, activation="tanh"),
                       keras.layers.Conv1D(3, 2))
    x = rng().normal(size=(8, 4, 5)).astype("float32")
    x[2, 1, 3] = np.nan
    x[5, 0, 0] = np.inf
    check(model, {"x": x, "y": labels(8)})
    check(model, {"x": x, "y": labels(8)}, bookkeeping=False)


# Runs in a fresh process whose TensorFlow counts its CPU allocations.
_HELD_BETWEEN_STEPS = """
import json, keras, tensorflow as tf, keras_dp
def held(private):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3),
                              keras.layers.Flatten(), keras.layers.Dense(4)])
    optimizer = keras.optimizers.SGD(0.1)
    if private:
        model = keras_dp.make_private(model, clipping_engine="ghost")
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0, seed=0)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    x, y = tf.random.normal([512, 16, 16, 3]), tf.zeros([512], tf.int32)
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    for _ in range(2):
        model.train_on_batch(x, y)
    return tf.config.experimental.get_memory_info("CPU:0")["current"] - before
print(json.dumps([held(False), held(True)]))
"""


@pytest.mark.program
@pytest.mark.slow  # 13 s in a process of its own: memory, not privacy (make test-all).
def test_a_traced_step_holds_no_batch_sized_tensors_between_steps():
    # Grappler folds zeros_like of a static shape into a constant that lives
    # as long as the step: the masked clipped sum once held 3.7 MB of zeros
    # here (42 MB for the benchmark CNN at batch 1024).
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", _HELD_BETWEEN_STEPS], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    non_private, private = json.loads(done.stdout.strip().splitlines()[-1])
    # The private model holds the noise key and the ledger besides the same
    # weights: a few KB, not megabytes.
    assert private - non_private < 2**20, (non_private, private)


def test_factors_sharing_output_gradients_take_the_gram_route_together():
    """As an LSTM's kernel (alone: direct, 4*16 <= 8*(4+16) floats) and
    recurrent kernel (Gram: 32*16 > 8*(32+16)) share their gate gradients."""
    gates = tf.zeros([2, 8, 16])
    factors = {"kernel": OuterProduct(tf.zeros([2, 8, 4]), gates),
               "recurrent_kernel": OuterProduct(tf.zeros([2, 8, 32]), gates),
               "other": OuterProduct(tf.zeros([2, 8, 4]), tf.zeros([2, 8, 16]))}
    assert outer_methods(factors, "auto") == {
        "kernel": "gram", "recurrent_kernel": "gram", "other": "direct"}
    assert set(outer_methods(factors, "direct").values()) == {"direct"}
    # Four rows per unit make 32 positions: the recurrent kernel alone is direct.
    assert set(outer_methods(factors, "auto", rows_per_unit=4).values()) == {"direct"}


def test_a_given_output_gram_takes_the_gram_route_where_it_is_smaller():
    """A norm function's own g g^T (a GRU's, from column blocks shared with
    its other kernel) leaves the input Gram, T^2 floats, against d*p."""
    a, g = tf.constant(rng().normal(size=(2, 8, 4)), tf.float32), tf.ones([2, 8, 16])
    gram = tf.linalg.matmul(g, g, transpose_b=True)
    given = {"given": with_output_gram(OuterProduct(a, g), gram)}
    assert outer_methods(given, "auto") == {"given": "gram"}  # 8 * 8 <= 4 * 16
    assert outer_methods({"plain": OuterProduct(a, g)}, "auto") == {"plain": "direct"}
    narrow = with_output_gram(OuterProduct(a[..., :2], g), gram)
    assert outer_methods({"narrow": narrow}, "auto") == {"narrow": "direct"}  # 64 > 32
    assert outer_methods(given, "auto", rows_per_unit=2) == {"given": "direct"}
    # The Gram formula reads the given matrix (twice g g^T: twice the norms).
    doubled = to_contribution(with_output_gram(OuterProduct(a, g), 2 * gram), (4, 16),
                              "gram")
    exact = to_contribution(OuterProduct(a, g), (4, 16), "gram")
    # Both bound their float32 weighted sum's rounding (the same margin).
    np.testing.assert_allclose(doubled.sq_norms, 2 * exact.sq_norms, rtol=1e-4)


@pytest.mark.parametrize("shape", [(5, 3), (5, 2, 3), (5, 0, 2)])
def test_the_clipped_sum_of_per_example_gradients_is_tensordots(shape):
    """sum_i c_i g_i, formed as one matmul: tf.tensordot's values bit for bit,
    with the inner shape static, unknown (traced) or empty."""
    grads = rng().normal(size=shape).astype("float32")
    scale = rng(1).uniform(size=shape[0]).astype("float32")
    want = tf.tensordot(scale, grads, axes=1).numpy()

    def clipped_sum(scale, grads):
        factor = PerExample(tf.convert_to_tensor(grads))
        return to_contribution(factor, shape[1:], "direct").weighted_sum(scale, None)

    unknown = tf.function(clipped_sum, input_signature=[
        tf.TensorSpec([None]), tf.TensorSpec([None] * len(shape))])
    np.testing.assert_array_equal(clipped_sum(scale, grads), want)
    np.testing.assert_array_equal(unknown(scale, grads), want)


def cancelling_positions(scale):
    """A Dense on two positions of one example, [W, ..., W] and
    [-(W - 10), ...], averaged: its gradient is 10 x g^T, but the Gram
    formula's products are of the order W^4 and cancel."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2, 16)), keras.layers.Dense(16, use_bias=False),
                              keras.layers.GlobalAveragePooling1D()])
    x = np.stack([np.full(16, scale), np.full(16, -(scale - 10.0))])[None].astype("float32")
    return model, {"x": tf.constant(x), "y": tf.zeros([1, 16])}


@pytest.mark.parametrize("scale", [100.0, 5e4, 3e6])
@pytest.mark.parametrize("outer_method", ["gram", "direct"])
def test_positions_that_cancel_cannot_hide_a_gradient_from_its_bound(scale, outer_method):
    # Review round 67: the Gram formula in float32 took the norm of a
    # gradient of 32 C (80 C at W = 5e4 here) for about 0, and added it
    # unclipped. Its norm is now bounded from above in float64; at 3e6 the
    # float32 weighted sum rounds by more than 0.6 % of C unless the
    # cancellation is capped (`contributions.MAX_CANCELLATION`).
    model, batch = cancelling_positions(scale)
    clip = 1e-3

    def loss_fn(batch, y_pred):
        return tf.reduce_sum(tf.square(y_pred - batch["y"]), axis=-1)

    grad_sum = ghost.clipped_gradient_sum(model, batch, model.trainable_variables, clip,
                                          loss_fn, outer_method=outer_method)[0]
    norm = np.sqrt(sum(np.sum(g.numpy().astype("float64") ** 2) for g in grad_sum))
    assert norm <= clip * (1 + 1e-5)
    if scale == 100.0:  # Cancelling by less than MAX_CANCELLATION: clipped exactly to C.
        np.testing.assert_allclose(norm, clip, rtol=1e-5)


def test_an_embeddings_positions_of_one_id_that_cancel_cannot_hide_its_gradient():
    # The masked Gram formula of an Embedding: two positions of one id whose
    # gradients are W v and -(W - 10) v.
    keras.utils.set_random_seed(0)
    weights = tf.constant([[3e5], [-(3e5 - 10.0)]])
    model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(4, 8),
                              keras.layers.Lambda(lambda h: tf.reduce_sum(h * weights, axis=1))])
    batch = {"x": tf.constant([[3, 3]], tf.int32), "y": tf.zeros([1, 8])}

    def loss_fn(batch, y_pred):
        return tf.reduce_sum(tf.square(y_pred - batch["y"] - 1.0), axis=-1)

    grad_sum = ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1e-3,
                                          loss_fn)[0]
    assert np.linalg.norm(grad_sum[0].numpy().astype("float64")) <= 1e-3 * (1 + 1e-5)


def test_an_embeddings_clipped_sum_rounds_within_its_bound():
    # Review round 68: 65,536 positions of one id, a term of 1024, tiny ones
    # of 0.45 ulp of it and one that nearly cancels it; the float32 segment
    # sum of the clipped terms lost the tiny ones (1.9 C; 4.5 C at 2^20
    # positions). The sum is now formed in float64.
    steps, big = 2 ** 16, np.float32(2.0 ** 10)
    tiny = np.float32(0.45 * float(big) * 2.0 ** -24)
    labels_of_positions = np.full(steps, -tiny, np.float32)
    labels_of_positions[0] = big
    labels_of_positions[-1] = -(big - np.float32(2e-3 * big + (steps - 2) * float(tiny)))
    model = keras.Sequential([keras.Input((steps,), dtype="int32"),
                              keras.layers.Embedding(2, 1, embeddings_initializer="zeros")])
    batch = {"x": tf.zeros([1, steps], tf.int32),
             "y": tf.constant(labels_of_positions[None, :, None])}

    def loss_fn(batch, y_pred):
        return tf.reduce_sum(batch["y"] * y_pred, axis=[1, 2])

    grad_sum = ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1.0,
                                          loss_fn)[0]
    assert np.linalg.norm(grad_sum[0].numpy().astype("float64")) <= 1 + 1e-5


def test_factors_whose_squares_underflow_float32_still_bound_the_gradient():
    # Review round 70: a Dense's norm ||x||^2 ||g||^2 in float32, inputs of
    # 1e-19 (squares flushed to 0) and output gradients of 1e19: norm 0,
    # gradient entries of 1, added unclipped (70.7 C at 10,000 x 2).
    model = keras.Sequential([keras.Input((100,)),
                              keras.layers.Dense(2, use_bias=False, kernel_initializer="zeros")])
    batch = {"x": tf.fill([1, 100], 1e-19), "y": tf.fill([1, 2], 5e18)}

    def loss_fn(batch, y_pred):
        return tf.reduce_sum(-batch["y"] * y_pred, axis=-1)

    grad_sum = ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1.0,
                                          loss_fn)[0]
    # The norm counts each flushed square as the smallest normal float32:
    # a bound from above, so the example is clipped a little harder (0.92 C).
    assert 0.9 <= np.linalg.norm(grad_sum[0].numpy().astype("float64")) <= 1 + 1e-5


def test_a_factor_the_clip_factor_makes_subnormal_still_cancels_its_partner():
    # Review round 72: a position of input 3.4e38 and output gradient
    # 1.25e-37 cancels another's term; scaled by the clip factor (1/11), the
    # tiny gradient was flushed to 0 in float32 and the other term went in
    # alone: 3.99 C (512 C at C = 1e-3).
    x = np.zeros((1, 3, 8), "float32")
    x[0, 0, 0], x[0, 1, 0], x[0, 2, 1] = 3.4e38, 1.0, 1.0
    y = np.zeros((1, 3, 8), "float32")
    y[0, 0, 0] = 1.5e-36
    y[0, 1, 0] = -np.float32(3.4e38) * y[0, 0, 0]
    y[0, 2, 1] = 132.0
    model = keras.Sequential([keras.Input((3, 8)),
                              keras.layers.Dense(8, use_bias=False, kernel_initializer="zeros")])
    batch = {"x": tf.constant(x), "y": tf.constant(y)}

    def loss_fn(batch, y_pred):
        return tf.reduce_mean(tf.square(y_pred - batch["y"]), axis=[1, 2])

    for outer_method in ("auto", "gram"):
        grad_sum = ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1.0,
                                              loss_fn, outer_method=outer_method)[0]
        np.testing.assert_allclose(np.linalg.norm(grad_sum[0].numpy().astype("float64")), 1.0,
                                   rtol=1e-4)


def seconds_per_call(function, calls):
    """Wall seconds of each of `calls` calls of `function` (a list)."""
    seconds = []
    for call in range(calls):
        start = time.perf_counter()
        function(call)
        seconds.append(time.perf_counter() - start)
    return seconds


@pytest.mark.once
def test_xla_compiles_the_private_step_once_for_batches_of_one_shape():
    """Session 35 saw XLA compile the ghost step again at every batch (its
    values taken as compile-time constants: 0.7 s a step against 2 ms).
    Measured side by side: each later batch of the same shape takes a small
    part of the first call's compilation."""
    model = keras_dp.make_private(
        sequential((8,), keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.2)),
        clipping_engine="ghost")  # The vectorized engine never recompiled.
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="sparse_categorical_crossentropy", jit_compile=True)
    x = rng().normal(size=(6, 32, 8)).astype("float32")
    first, *later = seconds_per_call(lambda i: model.train_on_batch(x[i], labels(32)), 6)
    assert max(later) < first / 4, (first, later)
