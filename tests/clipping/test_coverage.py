"""Which models the ghost engine covers, and how it refuses the others.

A layer without an applicable norm function makes a model unsupported; a
weight read or an add_loss() term that only the forward pass reveals raises
`UnsupportedModelError` while tracing, before anything changes.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from brute_force import brute_force, check, labels, per_example_loss, rng
from keras_dp import clipping
from keras_dp.clipping import ghost
from small_models import Scale, sequential


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


def test_a_norm_function_reading_a_weight_it_does_not_report_is_refused():
    """The recorded pass watches the weights each norm function reads (a
    variable watcher, not a second tape, see `Recorder`); one it reads and
    reports no factor for is refused while tracing."""
    class Shifted(Scale):
        def build(self, input_shape):
            super().build(input_shape)
            self.shift = self.add_weight(shape=input_shape[1:], initializer="zeros")

        def call(self, inputs):
            return inputs * self.w + self.shift

    def forgets_the_shift(layer, args, kwargs):
        outputs = args[0] * layer.w + layer.shift

        def gradients(grad):
            return [(layer.w, keras_dp.PerExample(args[0] * grad))]

        return outputs, outputs, gradients

    keras_dp.register_norm_function(Shifted, forgets_the_shift)
    model = sequential((5,), Shifted(), keras.layers.Dense(4))
    batch = {"x": np.ones((4, 5), "float32"), "y": labels(4)}
    with pytest.raises(ghost.UnsupportedModelError, match=r"Shifted.*reports no per-example"):
        ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1.0, per_example_loss)


def test_subclass_overriding_call_is_unsupported():
    class MyDense(keras.layers.Dense):
        def call(self, inputs):
            return super().call(inputs) * 2.0

    assert not ghost.supports(sequential((5,), MyDense(4)))


def test_a_call_set_on_the_layer_object_is_unsupported_and_auto_runs_it_exactly():
    """Review round 125: `dense.call = f` on the object was clipped as a plain
    Dense's call (3.97 from the true clipped sum): ghost never ran `f`."""
    dense = keras.layers.Dense(4)
    model = sequential((5,), dense)
    plain_call = dense.call
    dense.call = lambda inputs, **kwargs: plain_call(inputs) * keras.ops.sum(dense.kernel)
    reasons = ghost.unsupported_layers(model)
    assert any("['call'] set on the object itself" in r for r in reasons), reasons
    # Review round 127: a function saying it wraps the method (functools.wraps).
    wrapped = keras.layers.Dense(4)
    claimed = sequential((5,), wrapped)
    wrapped.call = functools.wraps(wrapped.call)(lambda inputs, **kwargs: inputs[..., :4])
    assert any("['call'] set on the object itself" in r
               for r in ghost.unsupported_layers(claimed))
    rnn = keras.layers.SimpleRNN(2)
    recurrent = sequential((3, 2), rnn)
    rnn.get_initial_state = functools.wraps(rnn.get_initial_state)(
        lambda batch_size: [tf.zeros([batch_size, 2])])
    assert not ghost.supports(recurrent)  # Its cell's weights lose their norm function.
    assert ghost.supports(sequential((3, 2), keras.layers.SimpleRNN(2)))
    assert ghost.supports(sequential((5,), keras.layers.Dense(4)))  # Keras' own wrappers.
    private = keras_dp.make_private(model)
    with pytest.warns(UserWarning, match="NOT differentially private"):
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1e6, noise_multiplier=0.0,
                                        learning_rate=1.0)
    private.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x, y = rng().normal(size=(6, 5)).astype("float32"), labels(6)
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x))
    expected = [v.numpy() - g.numpy() for v, g in
                zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables))]
    private.train_on_batch(x, y)
    assert private.clipping_engine_in_use == "vectorized"
    for v, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=1e-4, atol=1e-6)


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

    @tf.function(autograph=False)
    def step(batch):  # A train step may fall back to the vectorized engine.
        try:
            return ghost.clipped_gradient_sum(model, batch, variables, 0.1, per_example_loss)[0]
        except ghost.UnsupportedModelError:
            return clipping.clipped_gradient_sum(microbatch_loss, variables, batch, 6, 0.1)[0]

    expected, _, _ = brute_force(model, batch, 0.1)
    for g, e in zip(step(batch), expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)


def test_a_loss_reading_a_weight_is_refused_and_auto_falls_back():
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(3)
    model = sequential((5,), keras.layers.Dense(4, activation="tanh"), dense)
    crossentropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def penalized(y_true, y_pred):  # The penalty reaches the kernel, not an output.
        return crossentropy(y_true, y_pred) + tf.reduce_sum(tf.square(dense.kernel))

    batch = {"x": rng().normal(size=(6, 5)).astype("float32"), "y": labels(6)}
    with pytest.raises(ghost.UnsupportedModelError, match="The loss reads trainable weights"):
        ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1.0,
                                   lambda b, y_pred: penalized(b["y"], y_pred))
    private = keras_dp.make_private(model)
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1e6, noise_multiplier=0.0,
                                                  learning_rate=1.0), loss=penalized)
    with tf.GradientTape() as tape:  # No clipping at this C: the plain gradient.
        loss = tf.reduce_mean(penalized(batch["y"], model(batch["x"])))
    expected = [v.numpy() - g.numpy()
                for v, g in zip(model.trainable_variables,
                                tape.gradient(loss, model.trainable_variables))]
    private.train_on_batch(batch["x"], batch["y"])
    for v, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=1e-4, atol=1e-6)


class TimeMajor(keras.Model):
    """Applies a Dense to its [B, T, d] input transposed to [T, B, d]."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return keras.ops.mean(keras.ops.transpose(
            self.dense(keras.ops.transpose(x, (1, 0, 2))), (1, 0, 2)), axis=1)


def test_a_layer_on_a_tensor_whose_rows_are_not_the_examples_is_refused():
    model = TimeMajor()
    batch = {"x": rng().normal(size=(6, 5, 4)).astype("float32"), "y": labels(6)}
    model(batch["x"])
    with pytest.raises(ghost.UnsupportedModelError, match="first axis is not the batch"):
        ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1.0,
                                   per_example_loss)
    # Poisson batches leave the batch size unknown: even 6 positions for 6
    # examples cannot pass for the batch then.
    step = tf.function(lambda x, y: ghost.clipped_gradient_sum(
        model, {"x": x, "y": y}, model.trainable_variables, 1.0, per_example_loss)[0],
        input_signature=[tf.TensorSpec([None, 6, 4]), tf.TensorSpec([None], tf.int64)],
        autograph=False)
    with pytest.raises(ghost.UnsupportedModelError, match="first axis is not the batch"):
        step.get_concrete_function()


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
