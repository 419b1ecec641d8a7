"""The private step against a brute-force per-example reference, and its noise scale."""

import dataclasses
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from brute_force import train_on_laid_out_batch
from keras_dp import mechanism
from keras_dp import optimizers
from keras_dp.clipping import ghost
from keras_dp.clipping.engine import uses_ghost
from small_models import transformer_block

# Whole private steps, whose kernel-level parts (each layer family's
# per-example gradients, the engines, noise) tests/clipping checks under
# both oneDNN settings: `make test` runs each test, and each parametrized
# case, in one of its two runs (pytest.ini's marker).
pytestmark = pytest.mark.alternating

CLIP = 0.5
LEARNING_RATE = 1.0  # SGD with lr 1: the weight change is exactly the update.


def brute_force_update(model, x, y, sample_weight=None, num_microbatches=None, clip=CLIP):
    """Loop over microbatches in eager mode: clip each mean gradient, sum, divide."""
    batch_size = len(tf.nest.flatten(x)[0])
    k = num_microbatches or batch_size
    size = batch_size // k
    loss_fn = model.loss if callable(model.loss) else keras.losses.get(model.loss)
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for i in range(k):
        part = slice(i * size, (i + 1) * size)
        xi = tf.nest.map_structure(lambda t: t[part], x)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[part], model(xi, training=True),
                           sample_weight=None if sample_weight is None else sample_weight[part])
        grads = tape.gradient(loss, model.trainable_variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = [tf.convert_to_tensor(g).numpy() for g in grads]
        norm = np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in grads))
        scale = min(1.0, clip / norm)
        total = [t + g * scale for t, g in zip(total, grads)]
    return [t / k for t in total]


def compile_private(model, noise_multiplier=0.0, num_microbatches=None, loss=None, **kwargs):
    private = keras_dp.make_private(model)
    warns = noise_multiplier == 0
    with pytest.warns(UserWarning, match="NOT differentially private") if warns else _NullContext():
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=CLIP, noise_multiplier=noise_multiplier,
                                        num_microbatches=num_microbatches,
                                        learning_rate=LEARNING_RATE, seed=1)
    private.compile(optimizer=optimizer,
                    loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    **kwargs)
    return private


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


@pytest.fixture(params=["vectorized", "ghost"])
def engine(request):
    """Both exact per-example engines must match the brute-force reference."""
    return request.param


def assert_step_matches_reference(model, x, y, sample_weight=None, num_microbatches=None,
                                  loss=None, engine="auto", **compile_kwargs):
    private = compile_private(model, num_microbatches=num_microbatches, loss=loss,
                              **compile_kwargs)
    private.clipping_engine = engine
    before = [v.numpy() for v in private.trainable_variables]
    expected = brute_force_update(private, x, y, sample_weight, num_microbatches)
    if num_microbatches:
        train_on_laid_out_batch(private, x, y, sample_weight)
    else:
        private.train_on_batch(x, y, sample_weight=sample_weight)
    for w0, w1, g in zip(before, private.trainable_variables, expected):
        np.testing.assert_allclose(w0 - w1.numpy(), LEARNING_RATE * g, rtol=1e-4, atol=1e-6)
    assert private.privacy_steps == 1
    return private


def rng(seed=0):
    return np.random.default_rng(seed)


def classifier(layers, input_shape, input_dtype="float32"):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(input_shape, dtype=input_dtype), *layers,
                             keras.layers.Flatten(), keras.layers.Dense(3)])


def test_dense_matches_brute_force(engine):
    x = rng().normal(size=(8, 5)).astype("float32") * 3
    y = rng(1).integers(0, 3, 8)
    assert_step_matches_reference(classifier([keras.layers.Dense(4, activation="tanh")], (5,)),
                                  x, y, engine=engine)


def test_conv1d_matches_brute_force(engine):
    x = rng().normal(size=(6, 10, 3)).astype("float32")
    y = rng(1).integers(0, 3, 6)
    assert_step_matches_reference(
        classifier([keras.layers.Conv1D(4, 3, activation="relu")], (10, 3)), x, y, engine=engine)


def test_conv2d_matches_brute_force(engine):
    x = rng().normal(size=(6, 8, 8, 1)).astype("float32")
    y = rng(1).integers(0, 3, 6)
    model = classifier([keras.layers.Conv2D(4, 3, strides=2, activation="tanh"),
                        keras.layers.MaxPooling2D(2, 1)], (8, 8, 1))
    assert_step_matches_reference(model, x, y, engine=engine)


def test_embedding_and_layer_normalization_match_brute_force(engine):
    x = rng().integers(0, 20, size=(6, 7))
    y = rng(1).integers(0, 3, 6)
    model = classifier([keras.layers.Embedding(20, 4), keras.layers.LayerNormalization()],
                       (7,), input_dtype="int32")
    assert_step_matches_reference(model, x, y, engine=engine)


def test_multi_head_attention_matches_brute_force(engine):
    x = rng().integers(0, 11, size=(6, 6))
    y = rng(1).integers(0, 3, 6)
    assert_step_matches_reference(transformer_block(), x, y, engine=engine)


def test_layer_used_twice_matches_brute_force(engine):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, activation="tanh")
    outputs = keras.layers.Dense(3)(shared(shared(inputs)))
    x = rng().normal(size=(8, 4)).astype("float32")
    y = rng(1).integers(0, 3, 8)
    assert_step_matches_reference(keras.Model(inputs, outputs), x, y, engine=engine)


def test_two_input_functional_model_matches_brute_force(engine):
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(4)(a), keras.layers.Dense(4)(b)])
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(h))
    x = {"a": rng().normal(size=(6, 3)).astype("float32"),
         "b": rng(2).normal(size=(6, 2)).astype("float32")}
    y = rng(1).integers(0, 3, 6)
    assert_step_matches_reference(model, x, y, engine=engine)


def test_sample_weights_match_brute_force(engine):
    x = rng().normal(size=(8, 5)).astype("float32") * 3
    y = rng(1).integers(0, 3, 8)
    weights = rng(2).uniform(0, 2, 8).astype("float32")
    assert_step_matches_reference(classifier([keras.layers.Dense(4)], (5,)), x, y,
                                  sample_weight=weights, engine=engine)


def test_microbatches_match_brute_force():
    x = rng().normal(size=(8, 5)).astype("float32") * 3
    y = rng(1).integers(0, 3, 8)
    assert_step_matches_reference(classifier([keras.layers.Dense(4)], (5,)), x, y,
                                  num_microbatches=4)


def test_microbatches_that_do_not_divide_the_batch_are_refused_before_weights_change():
    private = compile_private(classifier([], (5,)), num_microbatches=3)
    before = [v.numpy() for v in private.variables]
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError),
                       match="must divide the batch size"):
        private.train_on_batch(np.ones((8, 5), "float32"), np.zeros(8))
    for w0, w1 in zip(before, private.variables):
        np.testing.assert_array_equal(w0, w1.numpy())


def test_noise_std_is_sigma_clip_over_batch_size():
    # Zero inputs and no bias: every clipped gradient is 0, so the update is
    # pure noise N(0, (sigma C)^2) / B. 100,000 draws estimate its std to about
    # 0.3% (one standard error); the 3% tolerance is ten of those, and sigma*C
    # (the wrong, mean-scaled noise) is 32x away.
    sigma, batch_size = 1.3, 32
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((100,)), keras.layers.Dense(1000, use_bias=False)])
    private = keras_dp.make_private(model)
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=CLIP, noise_multiplier=sigma,
                                                  learning_rate=LEARNING_RATE, seed=3),
                    loss="mse")
    before = private.trainable_variables[0].numpy()
    private.train_on_batch(np.zeros((batch_size, 100), "float32"),
                           np.zeros((batch_size, 1000), "float32"))
    update = before - private.trainable_variables[0].numpy()
    assert abs(update.mean()) < 5 * sigma * CLIP / batch_size / np.sqrt(update.size)
    np.testing.assert_allclose(update.std(), sigma * CLIP / batch_size, rtol=0.03)


def test_noise_is_fresh_every_step_and_reproducible_with_a_seed():
    def two_updates(seed):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10, use_bias=False)])
        private = keras_dp.make_private(model)
        private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                      seed=seed), loss="mse")
        zeros = np.zeros((4, 10), "float32")
        weights = [private.trainable_variables[0].numpy()]
        for _ in range(2):
            private.train_on_batch(zeros, zeros)
            weights.append(private.trainable_variables[0].numpy())
        return np.diff(np.stack(weights), axis=0)

    first, again = two_updates(seed=7), two_updates(seed=7)
    np.testing.assert_array_equal(first, again)
    assert np.corrcoef(first[0].ravel(), first[1].ravel())[0, 1] < 0.5


def small_data(n=64):
    return (rng().normal(size=(n, 5)).astype("float32"), rng(1).integers(0, 3, n))


def dp_sgd(**kwargs):
    return keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1, **kwargs)


LOGITS_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_dp_optimizer_on_a_plain_model_is_refused_before_weights_change():
    model = classifier([], (5,))
    model.compile(optimizer=dp_sgd(), loss=LOGITS_LOSS)
    before = [v.numpy() for v in model.variables]
    with pytest.raises(RuntimeError, match="keras_dp.make_private"):
        model.fit(*small_data(), batch_size=16, verbose=0)
    for w0, w1 in zip(before, model.variables):
        np.testing.assert_array_equal(w0, w1.numpy())


def test_private_model_with_a_plain_optimizer_is_refused_before_weights_change():
    private = keras_dp.make_private(classifier([], (5,)))
    private.compile(optimizer="sgd", loss=LOGITS_LOSS)
    before = [v.numpy() for v in private.variables]
    with pytest.raises(ValueError, match="needs a DP optimizer.*DPKerasSGD"):
        private.fit(*small_data(), batch_size=16, verbose=0)
    for w0, w1 in zip(before, private.variables):
        np.testing.assert_array_equal(w0, w1.numpy())


def test_batch_normalization_is_refused_before_weights_change():
    private = keras_dp.make_private(classifier([keras.layers.BatchNormalization()], (5,)))
    private.compile(optimizer=dp_sgd(), loss=LOGITS_LOSS)
    before = [v.numpy() for v in private.variables]
    with pytest.raises(ValueError, match="batch_normalization.*GroupNormalization"):
        private.fit(*small_data(), batch_size=16, verbose=0)
    for w0, w1 in zip(before, private.variables):
        np.testing.assert_array_equal(w0, w1.numpy())
    assert private.privacy_steps == 0


def private_variants():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="relu")(inputs))
    yield "functional DPModel", keras_dp.DPModel(inputs, outputs)
    yield "DPSequential", keras_dp.DPSequential(
        [keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    yield "make_private", keras_dp.make_private(classifier([keras.layers.Dense(8)], (5,)))


@pytest.mark.once  # The API's round trip: `make test` runs it once, for one
# way of making a model private (all three in make test-all).
@pytest.mark.parametrize("name", [
    name if name == "functional DPModel" else pytest.param(name, marks=pytest.mark.slow)
    for name, _ in private_variants()])
def test_fit_evaluate_predict_save_load_round_trip(name, tmp_path):
    private = dict(private_variants())[name]
    x, y = small_data()
    private.compile(optimizer=dp_sgd(momentum=0.9), loss=LOGITS_LOSS, metrics=["accuracy"])
    history = private.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and "accuracy" in history.history
    assert private.privacy_steps == 8
    predictions = private(x, training=False).numpy()  # Eager: one trace fewer.

    path = str(tmp_path / "model.keras")
    private.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer).__name__ == "DPKerasSGD"
    assert loaded.optimizer.get_config() == private.optimizer.get_config()
    assert loaded.privacy_steps == 8
    np.testing.assert_allclose(loaded.predict(x, verbose=0), predictions, rtol=1e-5, atol=1e-6)
    loss, accuracy = loaded.evaluate(x, y, verbose=0)  # Compiled with its metrics.
    assert np.isfinite(loss) and 0 <= accuracy <= 1
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert loaded.privacy_steps == 12


@pytest.mark.once
def test_dp_settings_hold_what_the_step_bakes_in_and_round_trip_through_the_config():
    optimizer = keras_dp.DPKerasAdam(
        l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=2,
        gradient_accumulation_steps=3, clipping="normalize", normalize_gamma=0.1,
        noise_correlation=keras_dp.BandedMF(bands=2), seed=5, save_seed=True)
    settings = optimizer.dp_settings
    assert settings == optimizers.DPSettings(
        num_microbatches=2, accumulation_steps=3, clipping=optimizers.ClippingRule.NORMALIZE,
        normalize_gamma=0.1, noise_correlation=keras_dp.BandedMF(bands=2), seed=5,
        secure_mode=False, save_seed=True)
    config = optimizer.get_config()
    assert config["clipping"] == "normalize" and type(config["clipping"]) is str
    assert keras_dp.DPKerasAdam.from_config(config).dp_settings == settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.accumulation_steps = 1
    with pytest.raises(AttributeError):
        optimizer.dp_settings = dataclasses.replace(settings, accumulation_steps=1)


@pytest.mark.once
def test_a_baked_in_setting_cannot_change_after_the_step_was_traced():
    """A step traced with accumulation 4 would keep it while the sampler and
    the ledger read a new value: the assignment is refused, checked as the
    constructor checks it before."""
    optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0, secure_mode=True)
    with pytest.raises(ValueError, match="refuses a user seed"):
        optimizer.seed = 7
    x, y = np.random.default_rng(0).normal(size=(64, 4)).astype("float32"), np.zeros(64)
    private = keras_dp.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                  gradient_accumulation_steps=4),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private.fit(x, y, batch_size=4, epochs=1, verbose=0)
    for name, value in (("accumulation_steps", 1), ("num_microbatches", 2), ("seed", 3)):
        with pytest.raises(ValueError, match=f"{name} of a DP optimizer cannot change"):
            setattr(private.optimizer, name, value)
    assert private.optimizer.dp_settings.accumulation_steps == 4


def test_regularization_gradient_is_added_after_privatization():
    x = rng().normal(size=(8, 5)).astype("float32") * 3
    y = rng(1).integers(0, 3, 8)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.5))])
    private = compile_private(model)
    kernel = private.trainable_variables[0]
    before = kernel.numpy()
    expected = brute_force_update(private, x, y)[0] + 2 * 0.5 * before
    private.train_on_batch(x, y)
    np.testing.assert_allclose(before - kernel.numpy(), expected, rtol=1e-4, atol=1e-6)


def test_fit_on_arrays_samples_poisson_batches_and_divides_by_the_expected_size():
    x, y = small_data(256)
    private = keras_dp.make_private(classifier([], (5,)))
    private.compile(optimizer=dp_sgd(), loss=LOGITS_LOSS, metrics=["accuracy"])
    history = private.fit(x, y, batch_size=32, epochs=2, validation_split=0.25, verbose=0)
    info = private.sampling_info
    # Each example is held out with probability 0.25: about 192 train.
    assert (info.sampling, info.batch_size) == ("poisson", 32)
    assert abs(info.num_examples - 192) < 5 * np.sqrt(256 * 0.25 * 0.75)
    assert info.physical_batch_size > 32 and 0 < info.extra_delta <= 1e-12
    assert private.privacy_steps == 2 * -(-info.num_examples // 32)
    assert "val_loss" in history.history
    settings = private.optimizer.dp_settings
    assert mechanism.Sampling.of_fit(info, settings).expected_batch_size == 32

    private.fit(x, y, batch_size=32, sampling="shuffle", verbose=0)
    assert private.sampling_info.sampling == "shuffle"
    assert mechanism.Sampling.of_fit(private.sampling_info, settings).expected_batch_size == 0


def test_train_on_batch_after_a_poisson_fit_divides_by_its_own_batch():
    x, y = small_data(128)
    private = compile_private(classifier([keras.layers.Dense(4)], (5,)))
    private.fit(x, y, batch_size=32, verbose=0)  # Divides by the expected 32.
    kernel = private.trainable_variables[0]
    before = kernel.numpy()
    expected = brute_force_update(private, x[:8], y[:8])[0]  # The mean over 8.
    private.train_on_batch(x[:8], y[:8])
    np.testing.assert_allclose(before - kernel.numpy(), LEARNING_RATE * expected,
                               rtol=1e-4, atol=1e-7)


def test_gradient_accumulation_equals_one_large_step():
    x = rng().normal(size=(16, 5)).astype("float32") * 3
    y = rng(1).integers(0, 3, 16)

    def train(accumulation_steps):
        keras.utils.set_random_seed(0)
        private = keras_dp.make_private(classifier([keras.layers.Dense(4)], (5,)))
        with pytest.warns(UserWarning, match="NOT differentially private"):
            optimizer = keras_dp.DPKerasSGD(
                l2_norm_clip=CLIP, noise_multiplier=0.0, learning_rate=LEARNING_RATE,
                gradient_accumulation_steps=accumulation_steps)
        private.compile(optimizer=optimizer, loss=LOGITS_LOSS)
        size = 16 // accumulation_steps
        for step in range(accumulation_steps):
            before = [v.numpy() for v in private.trainable_variables]
            rows = slice(step * size, (step + 1) * size)
            private.train_on_batch(x[rows], y[rows])
            moved = any(np.any(w0 != w1.numpy())
                        for w0, w1 in zip(before, private.trainable_variables))
            assert moved == (step == accumulation_steps - 1)
        assert private.privacy_steps == 1
        return [v.numpy() for v in private.trainable_variables]

    for accumulated, single in zip(train(4), train(1)):
        np.testing.assert_allclose(accumulated, single, rtol=1e-5, atol=1e-7)


def test_noise_std_after_accumulation_is_sigma_clip_over_logical_batch():
    sigma, physical, steps = 1.3, 8, 4
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((100,)), keras.layers.Dense(1000, use_bias=False)])
    private = keras_dp.make_private(model)
    private.compile(optimizer=keras_dp.DPKerasSGD(
        l2_norm_clip=CLIP, noise_multiplier=sigma, learning_rate=LEARNING_RATE, seed=3,
        gradient_accumulation_steps=steps), loss="mse")
    before = private.trainable_variables[0].numpy()
    for _ in range(steps):
        private.train_on_batch(np.zeros((physical, 100), "float32"),
                               np.zeros((physical, 1000), "float32"))
    update = before - private.trainable_variables[0].numpy()
    np.testing.assert_allclose(update.std(), sigma * CLIP / (steps * physical), rtol=0.03)


def test_multi_output_losses_are_summed_per_example_before_clipping():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(3, name="label")(hidden),
                                 keras.layers.Dense(1, name="value")(hidden)])
    x = rng().normal(size=(6, 4)).astype("float32") * 2
    y = [rng(1).integers(0, 3, 6), rng(2).normal(size=(6, 1)).astype("float32")]
    losses = [keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              keras.losses.MeanSquaredError()]
    private = compile_private(model, loss=losses, loss_weights=[1.0, 0.5])
    before = [v.numpy() for v in private.trainable_variables]

    expected = [np.zeros(v.shape) for v in private.trainable_variables]
    for i in range(6):
        with tf.GradientTape() as tape:
            label, value = private(x[i:i + 1], training=True)
            loss = losses[0](y[0][i:i + 1], label) + 0.5 * losses[1](y[1][i:i + 1], value)
        grads = [tf.convert_to_tensor(g).numpy()
                 for g in tape.gradient(loss, private.trainable_variables)]
        scale = min(1.0, CLIP / np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads)))
        expected = [e + g * scale / 6 for e, g in zip(expected, grads)]
    private.train_on_batch(x, y)
    for w0, w1, g in zip(before, private.trainable_variables, expected):
        np.testing.assert_allclose(w0 - w1.numpy(), g, rtol=1e-4, atol=1e-6)


@pytest.mark.once  # Which step runs and what it logs, not kernels: once.
def test_one_fit_traces_the_private_step_once():
    # Poisson batches come in several padded sizes, all traced as one
    # unknown batch dimension (XLA, when used, compiles one program per size).
    x, y = small_data(256)
    private = keras_dp.make_private(classifier([], (5,)))
    private.compile(optimizer=dp_sgd(), loss=LOGITS_LOSS)
    traces = []
    original = private._clipped_gradient_sum

    def counting_engine(*args):
        traces.append(1)
        return original(*args)

    private._clipped_gradient_sum = counting_engine
    private.fit(x, y, batch_size=16, epochs=3, verbose=0)
    info = private.sampling_info
    assert info.padding_multiple < info.physical_batch_size  # Several sizes.
    assert private.privacy_steps == 48
    assert len(traces) == 1


@pytest.mark.once  # Which step runs and what it logs, not kernels: once.
@pytest.mark.parametrize("jit_compile", [
    False, pytest.param(True, marks=pytest.mark.slow)])  # XLA: 5-8 s of compiles.
def test_training_metrics_ignore_the_padding_rows_of_poisson_batches(jit_compile):
    # All labels are 1 and the model always predicts class 1: accuracy is 1.0
    # on real rows; padding rows (label 0) would pull it down to about B/P.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, use_bias=True)])
    private = keras_dp.make_private(model)
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                  learning_rate=0.0),
                    loss=LOGITS_LOSS, metrics=["accuracy"], jit_compile=jit_compile)
    model.layers[0].set_weights([np.zeros((5, 3), "float32"),
                                 np.array([0.0, 5.0, 0.0], "float32")])
    # 3 Poisson batches of 32 +- 5 rows padded to a multiple of 8: all three
    # without padding has probability about 8 ** -3. Each new batch shape is
    # a new XLA compilation, so few batches keep jit_compile=True fast.
    x = rng().normal(size=(96, 5)).astype("float32")
    history = private.fit(x, np.ones(96), batch_size=32, epochs=1, verbose=0)
    assert private.sampling_info.physical_batch_size > 32
    assert history.history["accuracy"] == [1.0]


@pytest.mark.once  # Which step runs and what it logs, not kernels: once.
def test_jit_compile_compiles_the_private_step_once():
    # The noise's Philox algorithm was once computed from the seed: XLA then
    # needed the step counter at compile time and compiled every step again
    # (later steps took 0.8 of the first, compiled step; now 0.002).
    private = compile_private(classifier([keras.layers.Dense(4)], (5,)), noise_multiplier=1.0,
                              jit_compile=True)
    x, y = small_data(16)
    seconds = []
    for _ in range(4):
        start = time.perf_counter()
        float(private.train_on_batch(x, y, return_dict=True)["loss"])
        seconds.append(time.perf_counter() - start)
    assert max(seconds[1:]) < 0.3 * seconds[0], seconds


class Scale(keras.layers.Layer):
    """A custom layer with a weight and no registered ghost norm function."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, inputs):
        return inputs * self.scale


def test_a_layer_without_a_norm_function_uses_the_vectorized_engine():
    x = rng().normal(size=(6, 5)).astype("float32") * 3
    y = rng(1).integers(0, 3, 6)
    model = classifier([Scale(), keras.layers.Dense(4)], (5,))
    private = assert_step_matches_reference(model, x, y, engine="auto")
    assert not uses_ghost(private)
    private.clipping_engine = "ghost"
    with pytest.raises(ValueError, match="Scale.*register_norm_function"):
        uses_ghost(private)


@pytest.mark.once  # Which step runs and what it logs, not kernels: once.
def test_clipping_engine_is_checked_when_set_and_switches_at_the_next_step(monkeypatch):
    with pytest.raises(ValueError, match='"auto", "ghost" or "vectorized"'):
        keras_dp.make_private(classifier([], (5,)), clipping_engine="fast")
    ghost_calls = []
    ghost_sum = ghost.clipped_gradient_sum
    monkeypatch.setattr(ghost, "clipped_gradient_sum",
                        lambda *a, **k: ghost_calls.append(1) or ghost_sum(*a, **k))
    x, y = rng().normal(size=(4, 5)).astype("float32"), rng(1).integers(0, 3, 4)
    private = keras_dp.make_private(classifier([], (5,)), clipping_engine="vectorized")
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                    loss="sparse_categorical_crossentropy")
    private.train_on_batch(x, y)
    assert not ghost_calls
    private.clipping_engine = "ghost"
    private.train_on_batch(x, y)
    assert ghost_calls and private.privacy_steps == 2
    assert keras_dp.make_private(private).clipping_engine == "ghost"  # Kept.


class ActivityPenalty(keras.layers.Layer):
    """Adds a data-dependent add_loss() term, which ghost clipping cannot split."""

    def call(self, inputs):
        self.add_loss(0.1 * tf.reduce_sum(tf.square(inputs)))
        return inputs


@pytest.mark.once  # Which step runs and what it logs, not kernels: once.
def test_auto_engine_falls_back_when_ghost_meets_add_loss_while_tracing():
    keras.utils.set_random_seed(0)
    x = rng().normal(size=(6, 5)).astype("float32")
    y = rng(1).integers(0, 3, 6)
    private = compile_private(classifier([keras.layers.Dense(4), ActivityPenalty()], (5,)))
    before = [v.numpy() for v in private.trainable_variables]
    private.train_on_batch(x, y)
    assert private.privacy_steps == 1
    assert any(np.any(w0 != w1.numpy()) for w0, w1 in zip(before, private.trainable_variables))
    forced = compile_private(classifier([keras.layers.Dense(4), ActivityPenalty()], (5,)))
    forced.clipping_engine = "ghost"
    with pytest.raises(ghost.UnsupportedModelError):
        forced.train_on_batch(x, y)
    assert forced.privacy_steps == 0


def test_settings_assigned_before_the_step_are_checked_as_the_constructor_checks_them():
    """Review round 90: normalize_gamma = -0.99, refused by the constructor,
    was accepted by its setter (100 C moved, C recorded); a seed dropped for
    secure_mode kept its noise key."""
    optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                    clipping="normalize")
    with pytest.raises(ValueError, match="normalize_gamma"):
        optimizer.normalize_gamma = -0.99
    assert optimizer.normalize_gamma == 0.01
    adaptive = keras_dp.DPKerasSGD(l2_norm_clip=keras_dp.AdaptiveClipping(1.0),
                                   noise_multiplier=1.0)
    with pytest.raises(ValueError, match="no clipping norm for AdaptiveClipping"):
        adaptive.clipping = "normalize"
    banded = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                 noise_correlation=keras_dp.BandedMF(bands=4))
    with pytest.raises(ValueError, match="noise_correlation is fixed"):  # Review round 92.
        banded.replace_dp_settings(dataclasses.replace(banded.dp_settings,
                                                       noise_correlation=None))
    seeded = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0, seed=123)
    assert seeded._noise_key == 123
    seeded.seed = None
    seeded.secure_mode = True
    assert seeded._noise_key != 123 and seeded._noise_key >= 2 ** 32
