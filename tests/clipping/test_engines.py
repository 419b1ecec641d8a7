"""Both engines on what fit gives them: Poisson batches of unknown size,
padding rows, layers and losses that only look like covered ones.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_dp
from brute_force import (assert_sums_close, brute_force, check_vectorized, clipped_sum, labels,
                         per_example_gradients, per_example_loss, rng,
                         train_on_laid_out_batch, with_unknown_rows)
from keras_dp.clipping import ghost
from keras_dp.clipping import vectorized


def private(model, engine="auto", loss=None, **optimizer_kwargs):
    """`model` made private with `engine` and compiled for noiseless SGD steps
    of learning rate 1 (cross-entropy on logits unless `loss` is given)."""
    model = keras_dp.make_private(model, clipping_engine=engine)
    optimizer_kwargs.setdefault("l2_norm_clip", 1.0)
    optimizer_kwargs.setdefault("noise_multiplier", 0.0)
    model.compile(optimizer=keras_dp.DPKerasSGD(learning_rate=1.0, **optimizer_kwargs),
                  loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def applied_sum(model, x, y, sample_weight=None, **private_kwargs):
    """The clipped sum one private step of `model` on (x, y) applies (noiseless,
    so the weights move by -sum / B, or -sum / k with k microbatches), and the
    weights as they were."""
    before = [v.numpy() for v in model.trainable_variables]
    train_on_laid_out_batch(private(model, **private_kwargs), x, y, sample_weight)
    divisor = private_kwargs.get("num_microbatches") or len(x)
    return ([(b - v.numpy()) * divisor for b, v in zip(before, model.trainable_variables)],
            before)


def relative_error(actual, expected):
    """||actual - expected|| / ||expected||, over all variables together."""
    difference = sum(np.sum((a - e) ** 2) for a, e in zip(actual, expected))
    return float(np.sqrt(difference / sum(np.sum(e ** 2) for e in expected)))


def active_clip(model, batch):
    """A clip below most per-example gradient norms, so clipping acts."""
    return float(np.quantile(per_example_gradients(model, batch)[1], 0.3))


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


class StandardizedConv2D(keras.layers.Conv2D):
    """Weight standardization (De et al. 2022): the same weights, another forward pass."""

    def convolution_op(self, inputs, kernel):
        mean, variance = ops.moments(kernel, axes=[0, 1, 2], keepdims=True)
        return super().convolution_op(inputs, (kernel - mean) * ops.rsqrt(variance + 1e-4))


def standardized_cnn():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6, 6, 2)), StandardizedConv2D(3, 3),
                             keras.layers.Flatten(), keras.layers.Dense(3)])


def test_a_subclass_computing_otherwise_has_no_norm_function():
    model = standardized_cnn()
    assert not ghost.supports(model)  # It once trained as a plain Conv2D under ghost.
    assert "convolution_op" in " ".join(ghost.unsupported_layers(model))

    class Configured(keras.layers.Dense):  # Configuration only: still Dense's rule.
        def __init__(self, units, **kwargs):
            super().__init__(units, activation="tanh", **kwargs)

        def get_config(self):
            return super().get_config()

    keras.utils.set_random_seed(0)
    assert ghost.supports(keras.Sequential([keras.Input((4,)), Configured(3)]))


def test_auto_clips_a_standardized_convolution_exactly():
    model = standardized_cnn()
    batch = {"x": rng().normal(size=(8, 6, 6, 2)).astype("float32"), "y": labels(8)}
    clip = active_clip(model, batch)
    expected, _, _ = brute_force(model, batch, clip)
    applied, _ = applied_sum(model, batch["x"], batch["y"], l2_norm_clip=clip)
    assert relative_error(applied, expected) < 1e-5  # 0.956 when ghost took it for Conv2D.


def test_ghost_refuses_a_standardized_convolution_by_name():
    model = standardized_cnn()
    x = rng().normal(size=(8, 6, 6, 2)).astype("float32")
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="standardized_conv2d.*convolution_op"):
        private(model, "ghost").train_on_batch(x, labels(8))
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


class HardExamples(keras.losses.SparseCategoricalCrossentropy):
    """Keeps the examples whose loss is above the batch mean: compares rows."""

    def call(self, y_true, y_pred):
        values = super().call(y_true, y_pred)
        return values * ops.cast(values >= ops.mean(values), values.dtype)


def test_a_loss_overriding_call_is_evaluated_per_example():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(3)])
    batch = {"x": rng().normal(size=(8, 5)).astype("float32"), "y": labels(8)}
    clip = active_clip(model, batch)
    # On one example alone HardExamples keeps it: the plain cross-entropy.
    expected, _, _ = brute_force(model, batch, clip)
    applied, _ = applied_sum(model, batch["x"], batch["y"], l2_norm_clip=clip,
                             loss=HardExamples(from_logits=True))
    assert relative_error(applied, expected) < 1e-5


class FlattenedRows(keras.Model):
    """A Dense on its [B, 4, 4] input flattened to [4 B, 4] rows, and a head."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3, activation="tanh")
        self.head = keras.layers.Dense(3)

    def call(self, x):
        return self.head(ops.reshape(self.dense(ops.reshape(x, (-1, 4))), (-1, 12)))


def every_example_once(x, y):
    """A Poisson dataset with q = 1: one batch of all the examples, in order,
    whose batch size the traced step does not know."""
    return keras_dp.data.poisson_dataset(x, y, expected_batch_size=len(x), seed=0)


def flattened_rows_batch():
    keras.utils.set_random_seed(0)
    model = FlattenedRows()
    batch = {"x": rng().normal(size=(13, 4, 4)).astype("float32"), "y": labels(13)}
    model(batch["x"])
    return model, batch


def test_auto_falls_back_from_rows_that_are_not_the_examples_on_poisson_batches():
    model, batch = flattened_rows_batch()
    clip = active_clip(model, batch)
    expected, _, _ = brute_force(model, batch, clip)
    before = [v.numpy() for v in model.trainable_variables]
    private(model, l2_norm_clip=clip).fit(every_example_once(batch["x"], batch["y"]),
                                          verbose=0)
    applied = [(b - v.numpy()) * 13 for b, v in zip(before, model.trainable_variables)]
    assert relative_error(applied, expected) < 1e-5


def test_ghost_refuses_rows_that_are_not_the_examples_on_poisson_batches():
    # It once ran, then stopped on "Incompatible shapes: [52] vs. [13]".
    model, batch = flattened_rows_batch()
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ghost.UnsupportedModelError, match="first axis is not the batch"):
        private(model, "ghost").fit(every_example_once(batch["x"], batch["y"]), verbose=0)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


def padded_tokens():
    """Embedding(mask_zero) and mean pooling, on 6 real rows and 2 padding rows
    (all-zero tokens, sample weight 0), whose fully masked mean is 0 / 0."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,), dtype="int32"),
                              keras.layers.Embedding(7, 4, mask_zero=True),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    x = rng().integers(1, 7, size=(8, 5)).astype("int32")
    weights = np.ones(8, "float32")
    x[[2, 7]], weights[[2, 7]] = 0, 0.0
    return model, {"x": x, "y": labels(8), "sample_weight": weights}


def real_rows_of(batch):
    real = batch["sample_weight"] > 0
    return {key: value[real] for key, value in batch.items()}


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_padding_rows_contribute_exactly_nothing(engine):
    model, batch = padded_tokens()
    variables = model.trainable_variables
    gradients, norms, _ = per_example_gradients(model, real_rows_of(batch))
    clip = float(np.quantile(norms, 0.3))

    def microbatch_loss(microbatch):
        y_pred = model(microbatch["x"], training=True)
        return tf.reduce_sum(per_example_loss(microbatch, y_pred)), y_pred

    @tf.function(autograph=False)
    def run(batch):
        if engine == "ghost":
            return ghost.clipped_gradient_sum(model, batch, variables, clip, per_example_loss)
        size = tf.shape(batch["y"])[0]
        return vectorized.clipped_gradient_sum(microbatch_loss, variables, batch, size, clip)

    grad_sum, losses, _, num_nonfinite = with_unknown_rows(run, batch)[:4]
    assert_sums_close(grad_sum, clipped_sum(gradients, norms, clip), variables)
    assert np.all(np.isfinite(losses)) and int(num_nonfinite) == 0  # Were NaN and 2.


def test_padding_rows_leave_microbatches_their_real_rows():
    model, batch = padded_tokens()
    # Each microbatch of 4 rows holds one padding row: once NaN, and zeroed.
    gradients, _, _ = per_example_gradients(model, batch | {"x": np.maximum(batch["x"], 1)})
    real = batch["sample_weight"] > 0
    microbatches = [[sum(g[v] for g, r in zip(gradients[k:k + 4], real[k:k + 4]) if r) / 4
                     for v in range(len(gradients[0]))] for k in (0, 4)]
    norms = [np.sqrt(sum(np.sum(g ** 2) for g in m)) for m in microbatches]
    clip = float(min(norms))
    expected = clipped_sum(microbatches, norms, clip)
    applied, _ = applied_sum(model, batch["x"], batch["y"], batch["sample_weight"],
                             num_microbatches=2, l2_norm_clip=clip)
    assert relative_error(applied, expected) < 1e-5


def test_a_padding_row_copying_a_nan_label_leaves_its_microbatch_finite():
    """Review round 44: padding rows copy the draw's first example, label
    included; one NaN label made every microbatch holding a padding row
    non-finite, each zeroed: the whole clipped sum erased (4 C at m = 4).
    Each microbatch's padding now takes its own first real row's label."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    a, z = np.array([1.0, 2.0], "float32"), np.array([3.0, -1.0], "float32")
    x = np.stack([a, z, z, a])  # Microbatches [a, padding copying z], [z, a].
    y = np.array([[1.0], [np.nan], [np.nan], [1.0]], "float32")
    applied, before = applied_sum(model, x, y, np.array([1.0, 0.0, 1.0, 1.0], "float32"),
                                  loss="mse", num_microbatches=2, l2_norm_clip=1e6)
    # [z, a] is not finite and zeroed; [a, padding] is a's gradient over 2 rows.
    gradient = 2 * (a @ before[0] - 1.0) * a / 2
    np.testing.assert_allclose(applied[0][:, 0], gradient, rtol=1e-5)


@pytest.mark.parametrize("engine,num_microbatches",
                         [("auto", None), ("vectorized", None), ("auto", 4)])
def test_poisson_fit_on_fully_masked_padding_rows(engine, num_microbatches):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,), dtype="int32"),
                              keras.layers.Embedding(7, 4, mask_zero=True),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    before = [v.numpy() for v in model.trainable_variables]
    x = rng().integers(1, 7, size=(64, 5))
    history = private(model, engine, noise_multiplier=0.5, num_microbatches=num_microbatches,
                      ).fit(x, (x[:, 0] > 3).astype(int), batch_size=16, verbose=0).history
    # The loss was NaN, nonfinite_gradients the padding rows (the realised
    # batch size), and every microbatch was zeroed.
    assert np.isfinite(history["loss"][0]) and history["nonfinite_gradients"][0] == 0
    assert all(not np.array_equal(b, v.numpy())
               for b, v in zip(before, model.trainable_variables))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_half_precision_weights_are_refused_before_any_step(engine, dtype):
    # Review round 53: the vectorized engine squared float16 gradients in
    # float16, where entries below 1.7e-4 underflow: a gradient of 10 C was
    # not clipped. (A mixed precision policy keeps weights in float32: test_bounds.)
    keras.utils.set_random_seed(0)
    model = private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype=dtype)]),
                    engine)
    before = [w.numpy() for w in model.trainable_weights]
    with pytest.raises(ValueError, match="are float16 or bfloat16, too coarse"):
        model.train_on_batch(np.ones((2, 4), "float32"), labels(2, classes=3))
    for a, b in zip(before, model.trainable_weights):
        np.testing.assert_array_equal(a, b.numpy())
    assert model.privacy_steps == 0


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_sparse_and_ragged_inputs_are_refused_before_any_step(engine, kind):
    # Reviewers saw an AttributeError or a TypeError deep in the engines: a
    # refusal that names the fix, with the weights untouched.
    keras.utils.set_random_seed(0)
    if kind == "sparse":
        inputs = keras.Input((6,), sparse=True)
        dense = inputs
        x = tf.sparse.from_dense(np.eye(6, dtype="float32")[:4])
    else:
        inputs = keras.Input((None,), ragged=True)
        dense = keras.layers.Lambda(lambda t: t.to_tensor(shape=[None, 6]),
                                    output_shape=(6,))(inputs)
        x = tf.ragged.constant([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], [7.0]])
    model = private(keras.Model(inputs, keras.layers.Dense(3)(dense)), engine)
    before = [w.numpy() for w in model.trainable_weights]
    with pytest.raises(ValueError, match="holds a (Sparse|Ragged)Tensor"):
        model.train_on_batch(x, labels(4, classes=3))
    for a, b in zip(before, model.trainable_weights):
        np.testing.assert_array_equal(a, b.numpy())
    assert model.privacy_steps == 0


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_normalization_by_a_tiny_gamma_bounds_an_example_whose_squares_underflow(engine):
    # Review round 73: a gradient of 1e-20, whose float32 square CPU kernels
    # flush to 0, took norm 0: scale C / gamma, 10 C at gamma = 1e-21 (2e7 C
    # at 1e-30). A flushed square now counts as the smallest normal float32,
    # 1.2e-38: the norm is taken as 1.1e-19, and the example moves 0.09 C.
    keras.utils.set_random_seed(0)
    model = private(keras.Sequential([keras.Input((1,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="ones")]), engine, loss="mse",
        clipping="normalize", normalize_gamma=1e-21)
    before = model.trainable_weights[0].numpy()
    model.train_on_batch(np.array([[5e-21]], "float32"), np.array([[-1.0]], "float32"))
    moved = np.linalg.norm(before - model.trainable_weights[0].numpy())
    assert 0.05 <= moved <= 1.0


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_normalizations_scale_stays_finite_for_a_tiny_gradient_and_a_huge_clip(engine):
    # Review round 76: C = 1e30, gamma = 1e-12 and a gradient of 1e-12 gave a
    # scale of 5e41, inf as float32: the clipped sum was inf (NaN for a zero
    # gradient) with the example and finite without it.
    keras.utils.set_random_seed(0)
    model = private(keras.Sequential([keras.Input((2,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")]), engine,
        loss=lambda y_true, y_pred: tf.reduce_sum(y_true * y_pred, axis=-1),
        l2_norm_clip=1e30, clipping="normalize", normalize_gamma=1e-12)
    x = np.array([[1.0, 1.0], [1e-12, 1e-12], [0.0, 0.0]], "float32")
    model.train_on_batch(x, np.ones((3, 1), "float32"))
    moved = np.linalg.norm(model.trainable_weights[0].numpy().astype("float64"))
    assert np.isfinite(moved) and moved <= 2e30 / 3


def text_model():
    vectorize = keras.layers.TextVectorization(output_sequence_length=4,
                                               vocabulary=["good", "bad", "movie"])
    inputs = keras.Input((), dtype="string")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(8, 4)(
        vectorize(inputs)))
    private = keras_dp.make_private(keras.Model(inputs, keras.layers.Dense(2)(pooled)),
                                    clipping_engine="vectorized")
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return private


@pytest.mark.parametrize("compiled", [True, False])
def test_strings_in_the_batch_are_refused_by_the_vectorized_engine(monkeypatch, compiled):
    """A TextVectorization inside the model aborted the process on a CPU
    with oneDNN on (its per-example pass compiles with XLA, which has no
    string ops), and without XLA failed on texts of different lengths."""
    monkeypatch.setattr(vectorized, "runs_on_onednn", lambda: compiled)
    private = text_model()
    texts, y = np.array(["good movie", "bad movie", "good", "bad"]), np.array([1, 0, 1, 0])
    before = [w.copy() for w in private.get_weights()]
    with pytest.raises(ValueError, match="The batch holds strings"):
        private.train_on_batch(texts, y)
    for old, new in zip(before, private.get_weights()):
        np.testing.assert_array_equal(old, new)
    assert private.privacy_steps == 0


def test_ghost_with_microbatches_is_refused_naming_them():
    """Review round 180 (LOW): the refusal listed the layers missing a norm
    function, an empty list here; it names the microbatches."""
    model = private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), "ghost",
                    num_microbatches=2)
    x = np.ones((4, 3), "float32")
    with pytest.raises(ValueError, match="clips each example, so it needs num_microbatches"):
        model.train_on_batch(x, np.zeros(4, "int64"))
