"""Per-example losses built from the compiled loss, against the compiled loss per example.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from brute_force import check, labels, rng, take
from keras_dp.clipping import ghost
from keras_dp.clipping.registry import UnsupportedModelError
from small_models import sequential


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


@pytest.mark.parametrize("weighted", [False, True])
def test_per_example_loss_fn_with_a_keras_mask(weighted):
    """With one weight per example (Poisson batches' padding weights), the
    weight holds for each of its masked tokens: Keras multiplied [B] by the
    [B, T] mask (review round 138: a masked tagger could not fit)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(7, 4, mask_zero=True)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(3)(h))  # Per-token logits, masked.
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng().integers(1, 7, size=(6, 5)).astype("int32")
    x[1, 2:] = 0
    x[4, 4:] = 0
    batch = {"x": x, "y": rng(1).integers(0, 3, size=(6, 5))}
    if weighted:
        batch["sample_weight"] = rng(3).uniform(0.2, 2.0, 6).astype("float32")
    loss_fn = ghost.per_example_loss_fn(model)
    expected = compiled_loss_per_example(model, batch)
    np.testing.assert_allclose(loss_fn(batch, model(batch["x"], training=True)), expected,
                               rtol=1e-6)


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


@pytest.mark.parametrize("activation, loss, classes", [
    ("softmax", "sparse_categorical_crossentropy", 5), ("sigmoid", "binary_crossentropy", 1)])
def test_ghost_reads_the_logits_under_a_softmax_or_sigmoid_output(activation, loss, classes):
    """Keras' cross-entropies read the input of the output's softmax or
    sigmoid (`_get_logits`), whose rows are the examples wherever the
    output's are: ghost clipping takes them and equals brute force. Before,
    keras-io's plain `Dense(10, activation="softmax")` with
    `"sparse_categorical_crossentropy"` was refused under
    `clipping_engine="ghost"` (and ran the vectorized engine under "auto")."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(classes, activation=activation)])
    model.compile(loss=loss)
    y = labels(8, classes=5) if classes > 1 else labels(8, classes=2)[:, None].astype("float32")
    batch = {"x": 3 * rng().normal(size=(8, 4)).astype("float32"), "y": y}
    check(model, batch, loss_fn=ghost.per_example_loss_fn(model))


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_a_loss_evaluated_per_example_reads_each_rows_logits(engine):
    """Labels of another rank than the predictions (keras-io's fraud
    example: y [B] against a sigmoid's [B, 1]) make ghost evaluate the loss
    on each example alone, on a row sliced off the output, which no longer
    showed the sigmoid's input to Keras' cross-entropy: review round 186, a
    saturated output's gradient was 0.02 where Keras' step gives 134."""
    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((30,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(1, activation="sigmoid")])

    x = 25 * rng(1).normal(size=(1, 30)).astype("float32")
    y = np.ones((1,), "float32")
    plain = model()

    @tf.function  # As Keras' train step: the loss reads the sigmoid's input.
    def keras_gradient():
        with tf.GradientTape() as tape:
            loss = keras.losses.binary_crossentropy(y[:, None], plain(x, training=True))
        return tf.linalg.global_norm(tape.gradient(loss, plain.trainable_weights))

    private = keras_dp.make_private(model(), clipping_engine=engine)
    with pytest.warns(UserWarning, match="NOT differentially private"):
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1e6, noise_multiplier=0.0,
                                        learning_rate=1.0)
    private.compile(optimizer=optimizer, loss="binary_crossentropy")
    before = [w.numpy() for w in private.trainable_weights]
    private.train_on_batch(x, y)
    moved = np.sqrt(sum(np.sum((w.numpy() - b) ** 2)
                        for w, b in zip(private.trainable_weights, before)))
    assert private.clipping_engine_in_use == engine
    assert float(keras_gradient()) > 100
    np.testing.assert_allclose(moved, float(keras_gradient()), rtol=1e-4)


class OtherLogits(keras.layers.Layer):
    """A softmax whose `_keras_logits` (what Keras' cross-entropies read in
    its place) are not its input: the batch's rows less their mean, or a
    constant (review round 127: every example's gradient 0 under ghost)."""

    def __init__(self, of_the_batch, **kwargs):
        super().__init__(**kwargs)
        self.of_the_batch = of_the_batch

    def call(self, inputs):
        outputs = tf.nn.softmax(inputs)
        outputs._keras_logits = (inputs - tf.reduce_mean(inputs, axis=0) if self.of_the_batch
                                 else tf.zeros_like(inputs) + tf.range(5.0))
        return outputs


@pytest.mark.parametrize("of_the_batch", [True, False])
def test_ghost_refuses_logits_that_are_not_the_softmax_input(of_the_batch):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                              OtherLogits(of_the_batch)])
    model.compile(loss="sparse_categorical_crossentropy")
    batch = {"x": 3 * rng().normal(size=(8, 4)).astype("float32"), "y": labels(8, classes=5)}
    loss_fn = ghost.per_example_loss_fn(model)

    @tf.function(autograph=False)
    def run(batch):
        return ghost.clipped_gradient_sum(model, batch, model.trainable_variables, 1.0, loss_fn)

    with pytest.raises(UnsupportedModelError, match="not the input of the softmax"):
        run(batch)
