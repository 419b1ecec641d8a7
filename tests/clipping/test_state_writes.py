"""A layer that writes values of the batch into a variable during training is
refused on every path, before any weight changes (issue 44, review round 5).

Nothing clips or noises such a variable: a running sum saved with the model
tells whether an example was trained on, and state carried into the next
step lets one example move the gradients of others. The step refuses itself
while it is traced (`keras_dp.clipping.engine.refuse_batch_writes`, from the
traced graph by data flow), whichever engine runs and whatever calls it.
State that does not depend on the batch's values (Dropout's seed, a step
counter, a count of rows) still trains.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp

REFUSAL = "writes values computed from the batch into a variable"


class RunningSum(keras.layers.Layer):
    """Adds up its training inputs in a saved, non-trainable weight."""

    def build(self, input_shape):
        self.total = self.add_weight(shape=input_shape[1:], initializer="zeros",
                                     trainable=False, name="total")

    def call(self, x, training=None):
        if training:
            self.total.assign_add(tf.reduce_sum(x, axis=0))
        return x


class CarriedMax(keras.layers.Layer):
    """Adds the previous batch's column maxima: state carried across steps."""

    def build(self, input_shape):
        self.last = self.add_weight(shape=input_shape[1:], initializer="zeros",
                                    trainable=False, name="last")

    def call(self, x, training=None):
        out = x + self.last
        if training:
            self.last.assign(tf.reduce_max(x, axis=0))
        return out


class RowInTrainableWeight(keras.layers.Layer):
    """Sets a trainable bias to the batch's column maxima: a raw row released."""

    def build(self, input_shape):
        self.b = self.add_weight(shape=input_shape[1:], initializer="zeros", name="b")

    def call(self, x, training=None):
        if training:
            self.b.assign(keras.ops.max(x, axis=0))
        return x + self.b


class Counters(keras.layers.Layer):
    """Counts steps and rows: state of the batch's shape, not of its values."""

    def build(self, input_shape):
        self.steps = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="steps")
        self.rows = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    name="rows")

    def call(self, x, training=None):
        if training:
            self.steps.assign_add(1.0)
            self.rows.assign_add(tf.cast(tf.shape(x)[0], "float32"))
        return x


def private(layer, engine="auto", jit_compile=False):
    keras.utils.set_random_seed(0)
    model = keras_dp.make_private(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(4), layer, keras.layers.Dense(3)]),
        clipping_engine=engine)
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                                learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return model


def data(n=32):
    generator = np.random.default_rng(0)
    return generator.normal(size=(n, 4)).astype("float32"), generator.integers(0, 3, n)


def fit(model, x, y):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def train_on_batch(model, x, y):
    model.train_on_batch(x[:8], y[:8])


def tf_function_loop(model, x, y):
    step = tf.function(model.train_step, jit_compile=model.jit_compile)
    for start in (0, 8):
        step((x[start:start + 8], y[start:start + 8]))


def eager_train_step(model, x, y):
    model.train_step((tf.constant(x[:8]), tf.constant(y[:8])))


ENTRIES = [fit, train_on_batch, tf_function_loop, eager_train_step]


@pytest.mark.parametrize("layer_class", [RunningSum, CarriedMax, RowInTrainableWeight])
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda entry: entry.__name__)
def test_a_layer_writing_the_batch_into_a_variable_is_refused_before_any_change(
        layer_class, entry):
    x, y = data()
    model = private(layer_class())
    model(x[:1])
    before = [v.numpy().copy() for v in model.variables]
    with pytest.raises(ValueError, match=REFUSAL):
        entry(model, x, y)
    for was, variable in zip(before, model.variables):
        np.testing.assert_array_equal(variable.numpy(), was, err_msg=variable.path)
    assert model.privacy_steps == 0


@pytest.mark.parametrize("engine, jit_compile", [("vectorized", False), ("auto", True)])
def test_the_refusal_holds_on_either_engine_and_under_xla(engine, jit_compile):
    x, y = data()
    model = private(RunningSum(), engine=engine, jit_compile=jit_compile)
    with pytest.raises(ValueError, match=f"running_sum.*{REFUSAL}"):
        tf_function_loop(model, x, y)
    assert model.privacy_steps == 0


@pytest.mark.parametrize("layer", [keras.layers.Dropout(0.2), keras.layers.GaussianNoise(0.1),
                                   Counters()], ids=["dropout", "gaussian_noise", "counters"])
def test_state_that_does_not_depend_on_the_batchs_values_trains(layer):
    x, y = data()
    model = private(layer)
    fit(model, x, y)
    tf_function_loop(model, x, y)
    assert model.privacy_steps > 0
    if isinstance(layer, Counters):
        assert float(layer.steps.numpy()) == model.privacy_steps
