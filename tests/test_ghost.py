"""Ghost clipping against a brute-force per-example reference.

Each check runs `ghost.clipped_gradient_sum` (in a tf.function, as in
training) and an eager loop that differentiates every example alone, clips
its gradient and sums in float64. The clip is the 30% quantile of the
per-example norms, so clipping is active for about 70% of the examples.

Tolerance: float32 computations of the same quantity in a different order
(one batched matmul over all examples vs. one small gradient per example)
differ by rounding, about 1e-7 relative per operation. We compare each
variable's clipped sum by its L2 error: ||ghost - ref|| <= 1e-5 ||ref|| +
1e-7 ||ref of all variables|| (elementwise relative errors are meaningless
for entries near zero; the absolute term is for weights whose exact gradient
is zero, e.g. the key bias of attention, to which softmax is invariant, so
that only rounding noise remains), and the per-example norms with rtol 1e-5.
A float64 run checks the same algebra to 1e-10 relative, which only an
exact formula can meet.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from keras_dp import clipping
from keras_dp import ghost
from small_models import transformer_block

RTOL = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def per_example_loss(batch, y_pred):
    return LOSS(batch["y"], y_pred, sample_weight=batch.get("sample_weight"))


def rng(seed=0):
    return np.random.default_rng(seed)


def take(batch, i):
    return tf.nest.map_structure(lambda t: t[i:i + 1], batch)


def brute_force(model, batch, clip, loss_fn=per_example_loss):
    """Eager loop: per-example gradient, its norm, clip, sum (float64)."""
    variables = model.trainable_variables
    size = len(tf.nest.flatten(batch["y"])[0])
    total = [np.zeros(v.shape, np.float64) for v in variables]
    norms, losses = [], []
    for i in range(size):
        example = take(batch, i)
        with tf.GradientTape() as tape:
            loss = loss_fn(example, model(example["x"], training=True))[0]
        grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = [tf.convert_to_tensor(g).numpy().astype(np.float64) for g in grads]
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
        norms.append(norm)
        losses.append(float(loss))
        if np.isfinite(norm):
            total = [t + g * min(1.0, clip / norm) for t, g in zip(total, grads)]
    return total, np.array(norms), np.array(losses)


def check(model, batch, rtol=RTOL, xla=False, loss_fn=per_example_loss, **kwargs):
    """Asserts ghost clipping equals brute force; returns the clip used."""
    variables = model.trainable_variables
    _, norms, _ = brute_force(model, batch, 1.0, loss_fn)
    clip = float(np.quantile(norms[np.isfinite(norms)], 0.3))
    expected, norms, losses = brute_force(model, batch, clip, loss_fn)
    assert np.mean(norms > clip) >= 0.5  # Clipping is active for most examples.

    @tf.function(jit_compile=xla)
    def run(batch):
        return (ghost.clipped_gradient_sum(model, batch, variables, clip, loss_fn, **kwargs),
                ghost.per_example_norms(model, batch, variables, loss_fn,
                                        kwargs.get("outer_method", "auto")))

    # Traced with an unknown batch size, as fit traces bucketed Poisson batches.
    batch = tf.nest.map_structure(tf.convert_to_tensor, batch)
    unknown_rows = tf.nest.map_structure(
        lambda t: tf.TensorSpec([None] + t.shape[1:], t.dtype), batch)
    (grad_sum, ghost_losses, outputs, num_nonfinite), ghost_norms = (
        run.get_concrete_function(unknown_rows)(batch))
    assert len(grad_sum) == len(variables)
    scale = np.sqrt(sum(np.sum(e ** 2) for e in expected))
    for g, e, v in zip(grad_sum, expected, variables):
        assert g.shape == v.shape
        error = np.linalg.norm(g.numpy().astype(np.float64) - e)
        assert error <= rtol * np.linalg.norm(e) + rtol * 1e-2 * scale, (v.path, error)
    finite = np.isfinite(norms)
    np.testing.assert_allclose(ghost_norms.numpy()[finite], norms[finite], rtol=rtol)
    np.testing.assert_allclose(ghost_losses.numpy()[finite], losses[finite], rtol=rtol, atol=1e-6)
    assert tf.nest.flatten(outputs)[0].shape[0] == len(norms)
    assert int(num_nonfinite) == int(np.sum(~finite))
    assert ghost.supports(model)
    return clip


def sequential(input_shape, *layers, input_dtype="float32", classes=3):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(input_shape, dtype=input_dtype), *layers,
                             keras.layers.Flatten(), keras.layers.Dense(classes)])


def labels(n, classes=3):
    return rng(1).integers(0, classes, n)


# ------------------------------------------------------------ registered layers


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


def test_conv1d_causal_dilated_and_strided():
    model = sequential((12, 3), keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2,
                                                    activation="relu"),
                       keras.layers.Conv1D(3, 2, strides=2, padding="same", use_bias=False),
                       keras.layers.Conv1D(2, 3, padding="valid"))
    check(model, {"x": rng().normal(size=(8, 12, 3)).astype("float32"), "y": labels(8)})


@pytest.mark.parametrize("outer_method", ["auto", "gram"])
def test_conv2d_strides_padding_dilation(outer_method):
    model = sequential((9, 9, 2),
                       keras.layers.Conv2D(4, 4, strides=2, padding="same", activation="tanh"),
                       keras.layers.MaxPooling2D(2, strides=1),
                       keras.layers.Conv2D(3, (3, 2), dilation_rate=(1, 2), padding="same"),
                       keras.layers.Conv2D(2, 2, strides=(1, 2), padding="valid", use_bias=False))
    batch = {"x": rng().normal(size=(8, 9, 9, 2)).astype("float32"), "y": labels(8)}
    check(model, batch, outer_method=outer_method)


def test_embedding_with_repeated_ids(monkeypatch):
    model = sequential((7,), keras.layers.Embedding(5, 4), keras.layers.Dense(3, activation="tanh"),
                       input_dtype="int32")
    batch = {"x": rng().integers(0, 5, size=(8, 7)).astype("int32"), "y": labels(8)}
    check(model, batch)
    # Long sequences group ids with tf.unique instead of the masked Gram matrix.
    monkeypatch.setattr(ghost, "_MAX_ROWS_GRAM_STEPS", 1)
    check(model, batch)


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
def test_layer_group_and_rms_normalization():
    model = sequential((6, 6, 4),
                       keras.layers.Conv2D(4, 3, padding="same"),
                       keras.layers.GroupNormalization(groups=2),
                       keras.layers.LayerNormalization(axis=[1, 3]),
                       keras.layers.LayerNormalization(center=False),
                       keras.layers.LayerNormalization(rms_scaling=True),
                       keras.layers.RMSNormalization())
    batch = {"x": rng().normal(size=(8, 6, 6, 4)).astype("float32") * 2, "y": labels(8)}
    check(model, batch)


def test_multi_head_attention():
    model = transformer_block()
    batch = {"x": rng().integers(0, 11, size=(8, 6)).astype("int32"), "y": labels(8)}
    check(model, batch)


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


# ---------------------------------------------------------- engine variants


def test_second_backward_pass_and_xla_agree():
    model = transformer_block()
    batch = {"x": rng().integers(0, 11, size=(8, 6)).astype("int32"), "y": labels(8)}
    check(model, batch, bookkeeping=False)
    check(model, batch, xla=True)  # The whole computation under XLA...
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


# ------------------------------------------------------------ coverage, registry


class Scale(keras.layers.Layer):
    """A custom layer with a weight and no norm function: w * x."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[1:], initializer="ones", name="w")

    def call(self, inputs):
        return inputs * self.w


def test_unregistered_layer_is_unsupported_and_refused():
    model = sequential((5,), Scale(), keras.layers.Dense(4))
    assert not ghost.supports(model)
    assert any("Scale" in reason for reason in ghost.unsupported_layers(model))
    batch = {"x": np.ones((4, 5), "float32"), "y": labels(4)}
    with pytest.raises(ghost.UnsupportedModelError, match="outside any registered norm function"):
        ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1.0, per_example_loss)


def test_registered_custom_layer_is_exact():
    class RegisteredScale(Scale):
        def call(self, inputs):  # Overrides call: Scale's rule would not apply.
            return inputs * self.w

    def scale_norm(layer, args, kwargs):
        outputs = args[0] * layer.w

        def gradients(grad):
            return [(layer.w, keras_dp.PerExample(args[0] * grad))]

        return outputs, outputs, gradients

    keras_dp.register_norm_function(RegisteredScale, scale_norm)
    model = sequential((3, 5), RegisteredScale(), keras.layers.Dense(4, activation="tanh"))
    check(model, {"x": rng().normal(size=(8, 3, 5)).astype("float32"), "y": labels(8)})


def test_subclass_overriding_call_is_unsupported():
    class MyDense(keras.layers.Dense):
        def call(self, inputs):
            return super().call(inputs) * 2.0

    assert not ghost.supports(sequential((5,), MyDense(4)))


class TiedOutput(keras.layers.Layer):
    """Reads another layer's kernel (tied weights) and has no norm function."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.source = source

    def call(self, inputs):
        return tf.matmul(inputs, self.source.kernel, transpose_b=True)


def test_weights_read_outside_norm_functions_are_refused_and_the_trace_can_fall_back():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    encoder = keras.layers.Dense(3)
    outputs = TiedOutput(encoder)(encoder(inputs))
    model = keras.Model(inputs, outputs)
    assert ghost.supports(model)  # Statically every weight has an owner with a rule...
    batch = {"x": rng().normal(size=(6, 5)).astype("float32"), "y": labels(6, classes=5)}
    variables = model.trainable_variables
    with pytest.raises(ghost.UnsupportedModelError, match="TiedOutput"):  # ...but caught.
        ghost.clipped_gradient_sum(model, batch, variables, 1.0, per_example_loss)

    def microbatch_loss(microbatch):
        y_pred = model(microbatch["x"], training=True)
        return tf.reduce_sum(per_example_loss(microbatch, y_pred)), y_pred

    @tf.function
    def step(batch):  # A train step may fall back to the vectorized engine.
        try:
            return ghost.clipped_gradient_sum(model, batch, variables, 0.1, per_example_loss)[0]
        except ghost.UnsupportedModelError:
            return clipping.clipped_gradient_sum(microbatch_loss, variables, batch, 6, 0.1)[0]

    expected, _, _ = brute_force(model, batch, 0.1)
    for g, e in zip(step(batch), expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)


# --------------------------------------------------- per-example compiled loss


def compiled_loss_per_example(model, batch):
    """model._compile_loss on each example alone (what the vectorized engine uses)."""
    values = []
    for i in range(len(tf.nest.flatten(batch["y"])[0])):
        example = take(batch, i)
        y_pred = model(example["x"], training=True)
        values.append(float(model._compile_loss(example["y"], y_pred,
                                                example.get("sample_weight"))))
    return np.array(values)


def test_per_example_loss_fn_matches_the_compiled_loss():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(5, activation="tanh")(inputs)
    model = keras.Model(inputs, {"label": keras.layers.Dense(3, name="label")(h),
                                 "value": keras.layers.Dense(2, name="value")(h)})
    model.compile(loss={"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "value": "mse"},
                  loss_weights={"label": 1.0, "value": 0.5})
    batch = {"x": rng().normal(size=(6, 4)).astype("float32"),
             "y": {"label": labels(6), "value": rng(4).normal(size=(6, 2)).astype("float32")},
             "sample_weight": rng(3).uniform(0.2, 2.0, 6).astype("float32")}
    loss_fn = ghost.per_example_loss_fn(model)
    expected = compiled_loss_per_example(model, batch)
    np.testing.assert_allclose(loss_fn(batch, model(batch["x"], training=True)), expected,
                               rtol=1e-6)
    check(model, batch, loss_fn=loss_fn)


def test_per_example_loss_fn_with_a_keras_mask():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(7, 4, mask_zero=True)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(3)(h))  # Per-token logits, masked.
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng().integers(1, 7, size=(6, 5)).astype("int32")
    x[1, 2:] = 0
    x[4, 4:] = 0
    batch = {"x": x, "y": rng(1).integers(0, 3, size=(6, 5))}
    loss_fn = ghost.per_example_loss_fn(model)
    expected = compiled_loss_per_example(model, batch)
    np.testing.assert_allclose(loss_fn(batch, model(batch["x"], training=True)), expected,
                               rtol=1e-6)


def test_single_channel_convolutions_through_depthwise_filter_gradients(monkeypatch):
    # The path taken when TensorFlow uses oneDNN (one input channel).
    monkeypatch.setattr(ghost, "runs_on_onednn", lambda: True)
    model = sequential((10, 10, 1),
                       keras.layers.Conv2D(3, 4, strides=2, padding="same", activation="tanh"),
                       keras.layers.Reshape((25, 3)),
                       keras.layers.Conv1D(2, 3, strides=2, padding="valid"))
    check(model, {"x": rng().normal(size=(8, 10, 10, 1)).astype("float32"), "y": labels(8)})
    model = sequential((9, 1), keras.layers.Conv1D(3, 3, padding="causal"),
                       keras.layers.Conv1D(1, 2, padding="same"),
                       keras.layers.Conv1D(2, 2, padding="same"))
    check(model, {"x": rng().normal(size=(8, 9, 1)).astype("float32"), "y": labels(8)})


@pytest.mark.parametrize("loss", ["sparse_categorical_crossentropy",
                                  keras.losses.SparseCategoricalCrossentropy(reduction="sum")])
def test_per_example_loss_fn_single_output_with_weights(loss):
    model = sequential((4,), keras.layers.Dense(5, activation="softmax"), classes=5)
    model.layers[-1].activation = keras.activations.softmax
    model.compile(loss=loss, loss_weights=0.3)
    batch = {"x": rng().normal(size=(6, 4)).astype("float32"), "y": labels(6, classes=5),
             "sample_weight": rng(3).uniform(0.2, 2.0, 6).astype("float32")}
    loss_fn = ghost.per_example_loss_fn(model)
    np.testing.assert_allclose(loss_fn(batch, model(batch["x"], training=True)),
                               compiled_loss_per_example(model, batch), rtol=1e-6)


class AddsLoss(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(tf.reduce_sum(tf.square(inputs)))
        return inputs


def test_add_loss_terms_are_refused():
    assert not ghost.supports(sequential((5,), keras.layers.Dense(4, activity_regularizer="l2")))
    model = sequential((5,), keras.layers.Dense(4), AddsLoss())
    assert ghost.supports(model)  # Only the forward pass reveals add_loss() calls.
    batch = {"x": np.ones((4, 5), "float32"), "y": labels(4)}
    with pytest.raises(ghost.UnsupportedModelError, match="add_loss"):
        ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1.0, per_example_loss)
