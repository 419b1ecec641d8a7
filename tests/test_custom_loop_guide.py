"""keras-io's "Writing a training loop from scratch in TensorFlow", private (issue 45).

The guide's end-to-end loop (a `tf.GradientTape` step, a training metric,
a validation loop) on generated data of its layout: MNIST-like rows of 784
features in [0, 1], ten classes, the guide's three-layer Dense model. Made
private by the lines marked `# dp`, at most three: a DP optimizer, keras-dp's
Poisson draws in place of the shuffled batches, and a loop header that
takes each private step's batch, logits and loss where the guide's
`GradientTape` block (gone) computed them. It spends fit's Poisson epsilon
for the same steps, and learns.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp

pytestmark = pytest.mark.program

NUM_TRAIN, NUM_VAL, BATCH_SIZE, EPOCHS, DELTA = 2048, 512, 64, 2, 1e-4


def mnist_like(num_rows, seed):
    """Ten separable classes of 784 features in [0, 1] (MNIST's layout)."""
    centers = np.random.default_rng(0).uniform(0.0, 1.0, (10, 784))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, num_rows)
    pixels = np.clip(centers[labels] + rng.normal(0.0, 0.3, (num_rows, 784)), 0.0, 1.0)
    return pixels.astype("float32"), labels.astype("int64")


def get_model():
    inputs = keras.Input(shape=(784,), name="digits")
    x1 = keras.layers.Dense(64, activation="relu")(inputs)
    x2 = keras.layers.Dense(64, activation="relu")(x1)
    outputs = keras.layers.Dense(10, name="predictions")(x2)
    return keras.Model(inputs=inputs, outputs=outputs)


def training_loop_from_scratch(x_train, y_train, x_val, y_val):
    """The guide's loop with metrics and validation; the private lines are marked dp."""
    model = get_model()
    optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.5)  # dp
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
    val_acc_metric = keras.metrics.SparseCategoricalAccuracy()

    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    train_dataset = keras_dp.custom_loops.PrivateSteps(model, optimizer, loss_fn, keras_dp.data.poisson_dataset(train_dataset, expected_batch_size=BATCH_SIZE))  # dp  # noqa: E501
    val_dataset = tf.data.Dataset.from_tensor_slices((x_val, y_val))
    val_dataset = val_dataset.batch(BATCH_SIZE)

    for epoch in range(EPOCHS):
        print(f"\nStart of epoch {epoch}")
        for step, (_, y_batch_train, logits, loss_value) in enumerate(train_dataset):  # dp
            train_acc_metric.update_state(y_batch_train, logits)
            if step % 100 == 0:
                print(f"Training loss (for 1 batch) at step {step}: {float(loss_value):.4f}")
        train_acc = train_acc_metric.result()
        print(f"Training acc over epoch: {float(train_acc):.4f}")
        train_acc_metric.reset_state()

        for x_batch_val, y_batch_val in val_dataset:
            val_logits = model(x_batch_val, training=False)
            val_acc_metric.update_state(y_batch_val, val_logits)
        val_acc = val_acc_metric.result()
        val_acc_metric.reset_state()
        print(f"Validation acc: {float(val_acc):.4f}")
    return model, float(val_acc)


def test_the_guides_loop_made_private_in_three_lines_spends_fits_epsilon_and_learns():
    source = inspect.getsource(training_loop_from_scratch)
    assert source.count("# dp") == 3
    assert "GradientTape" not in source  # Its gradients were never clipped.
    keras.utils.set_random_seed(0)
    x_train, y_train = mnist_like(NUM_TRAIN, seed=1)
    x_val, y_val = mnist_like(NUM_VAL, seed=2)
    model, val_acc = training_loop_from_scratch(x_train, y_train, x_val, y_val)

    private = keras_dp.make_private(model)  # The ledger of the model's variables.
    steps = EPOCHS * NUM_TRAIN // BATCH_SIZE
    assert private.privacy_steps == steps
    fitted = keras_dp.make_private(get_model())
    fitted.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fitted.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=EPOCHS, verbose=0)
    assert fitted.privacy_steps == steps
    epsilon = private.privacy_spent(DELTA)[0]
    assert epsilon == pytest.approx(fitted.privacy_spent(DELTA)[0], rel=1e-2)
    assert [s.sampling for s in private.privacy_ledger.segments()] == ["poisson"]
    assert val_acc > 0.5  # Ten classes: chance is 0.1.
