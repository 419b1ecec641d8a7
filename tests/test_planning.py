"""Noise-to-signal, the warning before a private fit, plan() and the privacy report (issue 46).

The measure must be the norm of the noise on the averaged gradient over the
largest averaged signal (checked against sampled noise), count per-layer
clipping by its worst group, and read the units a step divides by (users,
microbatches, accumulated batches) from the step's mechanism. The warning
must fire for the issue's text model and not for the demo or a Fashion-MNIST
MLP at batch 256; the plan must at least halve the text model's ratio with
an epsilon (dp_accounting) within the target.
"""

import dataclasses
import math
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import keras_dp
from keras_dp import data
from keras_dp import mechanism
from keras_dp import planning

# Results no CPU kernel changes: shapes, counts, accounting and book-keeping
# (the fits below train a step or two only to reach fit's hooks).
pytestmark = pytest.mark.once

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_EXAMPLES, TEXT_BATCH, TEXT_EPOCHS = 2000, 32, 2


def text_model():
    """The issue's model: keras-io's bidirectional LSTM on IMDB, 20,000 x 128 embedding."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((200,), dtype="int32")
    h = keras.layers.Embedding(20000, 128)(tokens)
    h = keras.layers.Bidirectional(keras.layers.LSTM(64, return_sequences=True))(h)
    h = keras.layers.Bidirectional(keras.layers.LSTM(64))(h)
    return keras.Model(tokens, keras.layers.Dense(1, activation="sigmoid")(h))


def compiled(model, noise_multiplier, l2_norm_clip=1.0, **optimizer_kwargs):
    private = keras_dp.make_private(model)
    private.compile(optimizer=keras_dp.DPKerasSGD(
        l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier, learning_rate=0.1,
        **optimizer_kwargs), loss="mse")
    return private


def mlp(*widths):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((widths[0],))]
                            + [keras.layers.Dense(w, name=f"dense_{i}")
                               for i, w in enumerate(widths[1:])])


def drowning_warnings(caught):
    return [w for w in caught if issubclass(w.category, keras_dp.PrivacyUtilityWarning)]


def checked(model, units):
    """`(ratio, warnings)` of `planning.check_noise_to_signal`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ratio = planning.check_noise_to_signal(model, units)
    return ratio, drowning_warnings(caught)


# ----------------------------------------------------------------- the measure


def test_noise_to_signal_is_the_sampled_noise_norm_over_the_largest_signal():
    """sigma * sqrt(d) / B against the norm of sampled noise N(0, sigma^2 C^2) / B
    over C; per layer, the worst group's noise norm over its C_l."""
    rng = np.random.default_rng(0)
    sigma, batch, clips, sizes = 1.3, 64, np.array([0.5, 2.0]), np.array([400, 9000])
    total = math.sqrt(np.sum(clips ** 2))
    noise = rng.normal(0.0, sigma * total, size=(50, sizes.sum())) / batch
    flat = np.mean(np.linalg.norm(noise, axis=1)) / total
    assert planning.noise_to_signal(sigma, sizes.sum(), batch) == pytest.approx(flat, rel=0.01)
    per_group = [np.mean(np.linalg.norm(part, axis=1)) / c
                 for part, c in zip(np.split(noise, [sizes[0]], axis=1), clips)]
    measured = planning.noise_to_signal(sigma, sizes.sum(), batch, clips, sizes)
    assert measured == pytest.approx(max(per_group), rel=0.01)


def test_per_layer_clipping_never_lowers_the_ratio_and_matches_flat_at_c_by_sqrt_d():
    sizes = np.array([100, 2500, 40])
    flat = planning.noise_to_signal(1.0, sizes.sum(), 32)
    proportional = planning.noise_to_signal(1.0, sizes.sum(), 32, 0.1 * np.sqrt(sizes), sizes)
    assert proportional == pytest.approx(flat)
    for clips in ([1.0, 1.0, 1.0], [0.01, 1.0, 1.0], [5.0, 0.2, 3.0]):
        assert planning.noise_to_signal(1.0, sizes.sum(), 32, clips, sizes) >= flat


def test_the_model_measure_reads_sigma_and_the_clipping_groups_of_its_optimizer():
    model = mlp(20, 30, 5)  # Groups of 630 and 155 weights.
    flat = compiled(mlp(20, 30, 5), 2.0)
    assert planning.model_noise_to_signal(flat, 16) == pytest.approx(
        2.0 * math.sqrt(785) / 16)
    per_layer = compiled(model, 2.0, l2_norm_clip={"dense_0": 0.1, "dense_1": 1.0})
    assert planning.model_noise_to_signal(per_layer, 16) == pytest.approx(
        planning.noise_to_signal(2.0, 785, 16, [0.1, 1.0], [630, 155]))
    assert planning.model_noise_to_signal(per_layer, 16) > planning.model_noise_to_signal(
        flat, 16)


@pytest.mark.parametrize("info, optimizer_kwargs, units", [
    # Poisson batches of 64 expected examples.
    (data.SamplingInfo("poisson", 64, 1000), {}, 64),
    # Accumulation: one Poisson draw of 4 x 16 per logical step.
    (data.SamplingInfo("poisson", 64, 1000, accumulation_steps=4),
     {"gradient_accumulation_steps": 4}, 64),
    # Users: 20 expected users of up to 8 rows each; the unit is the user.
    (data.SamplingInfo("poisson", 20, 1600, unit="user", rows_per_unit=8, num_users=200),
     {}, 20),
    # Microbatches: the noisy sum is divided by their number, not the examples'.
    (data.SamplingInfo("poisson", 64, 1000, num_microbatches=8), {"num_microbatches": 8}, 8),
    # Fixed-size shuffled batches, accumulated twice.
    (data.SamplingInfo("shuffle", 50, 1000), {"gradient_accumulation_steps": 2}, 100),
])
def test_units_per_step_are_what_the_step_mechanism_divides_by(info, optimizer_kwargs, units):
    model = compiled(mlp(4, 2), 1.0, **optimizer_kwargs)
    sampling = mechanism.Sampling.of_fit(info, model.optimizer.dp_settings)
    with model.step_mechanism.using(sampling):
        assert planning.units_per_step(model) == units


# ----------------------------------------------------------------- the warning


def test_the_warning_fires_for_the_issues_text_model_at_epsilon_3():
    delta = keras_dp.default_delta(TEXT_EXAMPLES)
    sigma = keras_dp.calibrate_noise_multiplier(3.0, TEXT_EXAMPLES, TEXT_BATCH, TEXT_EPOCHS,
                                                delta)
    ratio, caught = checked(compiled(text_model(), sigma), TEXT_BATCH)
    assert 17 <= ratio <= 43  # Where the trials' text models stayed at chance.
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"{ratio:.1f}" in message and "2,757,761 trainable weights" in message
    assert "keras_dp.plan" in message and "LoRA" in message


def test_no_warning_for_the_demo_nor_a_fashion_mnist_mlp_at_batch_256():
    # examples/fashion_mnist.py's defaults: ScatterNet features (7 x 7 x 81), GroupNorm and
    # one Dense layer; 58,800 training images, batch 8,192, 40 epochs, C 0.1, epsilon 3.
    demo = keras.Sequential([keras.Input((7, 7, 81)), keras.layers.GroupNormalization(27),
                             keras.layers.Flatten(), keras.layers.Dense(10)])
    sigma = keras_dp.calibrate_noise_multiplier(3.0, 58800, 8192, 40, 1e-5)
    ratio, caught = checked(compiled(demo, sigma, l2_norm_clip=0.1), 8192)
    assert ratio < 0.2 and not caught
    # The speed benchmark's MLP, 784-512-512-10, at batch 256 for 60 epochs.
    sigma = keras_dp.calibrate_noise_multiplier(3.0, 60000, 256, 60, 1e-5)
    ratio, caught = checked(compiled(mlp(784, 512, 512, 10), sigma), 256)
    assert 0.9 <= ratio <= 5.6 and not caught  # Where the trials' models learned.


def test_the_warning_counts_per_layer_clipping():
    """A tiny C on the large layer makes it drown though the flat ratio is low."""
    model = mlp(200, 100, 2)
    flat_ratio, caught = checked(compiled(model, 1.0), 32)
    assert flat_ratio < planning.NOISE_TO_SIGNAL_LIMIT and not caught
    per_layer = compiled(mlp(200, 100, 2), 1.0, l2_norm_clip={"dense_0": 0.01, "dense_1": 1.0})
    ratio, caught = checked(per_layer, 32)
    assert ratio > planning.NOISE_TO_SIGNAL_LIMIT and len(caught) == 1


def test_no_check_without_noise_or_a_known_batch():
    with pytest.warns(UserWarning, match="NOT differentially private"):
        silent = compiled(text_model(), 0.0)
    assert checked(silent, TEXT_BATCH) == (None, [])
    assert checked(compiled(text_model(), 1.0), 0.0) == (None, [])


class _UnitsSeen(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.units = planning.units_per_step(self.model)


def test_fit_warns_once_at_its_start_for_users_per_batch_not_rows():
    """A user-level fit of 4 expected users (up to 8 rows each) drowns an
    embedding the same fit over 32-example batches would not."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(1000, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    private = compiled(model, 0.5)  # 0.5 * sqrt(8009) = 44.7: drowns below 4.5 units.
    x = np.random.default_rng(0).integers(0, 1000, (64, 3))
    y = np.zeros((64, 1), "float32")
    seen = _UnitsSeen()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        private.fit(x, y, batch_size=4, epochs=2, user_ids=np.arange(64) // 2,
                    steps_per_epoch=1, callbacks=[seen], verbose=0)
    assert seen.units == 4
    assert len(drowning_warnings(caught)) == 1  # Once, not per epoch.
    model.set_weights([np.zeros_like(w) for w in model.get_weights()])
    examples = compiled(keras.models.clone_model(model), 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        examples.fit(x, y, batch_size=32, epochs=1, callbacks=[seen], verbose=0)
    assert seen.units == 32 and not drowning_warnings(caught)


# ----------------------------------------------------------------- the plan


@pytest.fixture(scope="module")
def text_plan():
    model = keras_dp.make_private(text_model())
    model.compile(optimizer=keras_dp.DPKerasAdam(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                 learning_rate=1e-3), loss="mse")
    return keras_dp.plan(model, num_examples=TEXT_EXAMPLES, target_epsilon=3.0,
                         batch_size=TEXT_BATCH, epochs=TEXT_EPOCHS)


def test_the_plan_halves_the_text_models_noise_within_the_target_epsilon(text_plan):
    delta = keras_dp.default_delta(TEXT_EXAMPLES)
    sigma = keras_dp.calibrate_noise_multiplier(3.0, TEXT_EXAMPLES, TEXT_BATCH, TEXT_EPOCHS,
                                                delta)
    yours = planning.noise_to_signal(sigma, 2_757_761, TEXT_BATCH)
    assert text_plan.your_noise_to_signal == pytest.approx(yours)
    assert text_plan.noise_to_signal <= yours / 2
    assert text_plan.noise_to_signal == pytest.approx(planning.noise_to_signal(
        text_plan.noise_multiplier, 2_757_761, text_plan.batch_size))
    epsilon = keras_dp.compute_epsilon(TEXT_EXAMPLES, text_plan.batch_size,
                                       text_plan.noise_multiplier, delta,
                                       epochs=text_plan.epochs)
    assert epsilon == pytest.approx(text_plan.epsilon) and epsilon <= 3.0
    # It keeps your steps, within the compute allowed (10 times your epochs).
    assert text_plan.steps >= TEXT_EPOCHS * math.ceil(TEXT_EXAMPLES / TEXT_BATCH)
    assert text_plan.steps == text_plan.epochs * math.ceil(TEXT_EXAMPLES / text_plan.batch_size)
    assert text_plan.epochs <= 10 * TEXT_EPOCHS


def test_the_plan_scales_adams_learning_rate_by_the_square_root_and_says_it_drowns(text_plan):
    assert text_plan.learning_rate_scale == pytest.approx(
        math.sqrt(text_plan.batch_size / TEXT_BATCH))
    assert text_plan.learning_rate == pytest.approx(1e-3 * text_plan.learning_rate_scale)
    # Still above the limit: 2.76M weights on 2,000 examples cannot reach it in 126 steps.
    assert text_plan.drowned
    assert "fewer weights" in str(text_plan) and "batch_size: " in str(text_plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        text_plan.batch_size = 1


def test_the_plan_keeps_a_healthy_run_and_scales_sgd_linearly():
    """A run already past the knee keeps its batch; SGD's learning rate scales linearly."""
    plan = keras_dp.plan(num_weights=39_862, num_examples=58800, target_epsilon=3.0,
                         delta=1e-5, batch_size=8192, epochs=40)
    assert (plan.batch_size, plan.epochs) == (8192, 40) and not plan.drowned
    assert plan.learning_rate_scale == 1.0 and plan.learning_rate is None
    larger = keras_dp.plan(num_weights=669_706, num_examples=60000, target_epsilon=3.0,
                           delta=1e-5, batch_size=256, epochs=20)
    assert larger.batch_size > 256
    assert larger.learning_rate_scale == larger.batch_size / 256


def test_the_plan_counts_microbatches_accumulation_and_per_layer_clipping():
    model = compiled(mlp(50, 40, 3), 1.0, num_microbatches=4, gradient_accumulation_steps=2,
                     l2_norm_clip={"dense_0": 0.1, "dense_1": 1.0})
    plan = keras_dp.plan(model, num_examples=4000, target_epsilon=2.0, steps=200,
                         max_epochs=200)
    logical = plan.batch_size * 2  # fit's batch_size is the physical one.
    # Microbatches: sensitivity 2, so twice the noise the accountant sees.
    epsilon = keras_dp.compute_epsilon(4000, logical, plan.noise_multiplier / 2,
                                       keras_dp.default_delta(4000), epochs=plan.epochs)
    assert epsilon <= 2.0
    # The noisy sum of a logical step is divided by its 4 x 2 microbatches.
    assert plan.noise_to_signal == pytest.approx(planning.noise_to_signal(
        plan.noise_multiplier, 2163, 8, [0.1, 1.0], [2040, 123]))


@pytest.mark.parametrize("kwargs, message", [
    ({"num_weights": 1000}, "plan keeps the number of private steps"),
    ({"batch_size": 32, "epochs": 2}, "plan needs the model, or num_weights"),
    ({"num_weights": 1000, "steps": 500, "max_epochs": 1}, "No batch size runs 500"),
    ({"num_weights": 1000, "steps": 50, "unit": "row"}, "must be \"example\" or \"user\""),
    ({"num_weights": 1000, "batch_size": 4000, "epochs": 1}, "exceeds the 2000 examples"),
])
def test_plan_refusals_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        keras_dp.plan(num_examples=2000, target_epsilon=3.0, **kwargs)


def test_plan_needs_a_built_model():
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="plan needs a built model"):
        keras_dp.plan(unbuilt, num_examples=2000, target_epsilon=3.0, steps=10)


# ----------------------------------------------------------------- the report


def test_the_privacy_report_reads_the_ledger_and_says_what_is_not_covered():
    private = compiled(mlp(4, 1), 1.1)
    private.fit(np.zeros((100, 4)), np.zeros((100, 1)), batch_size=10, epochs=2, verbose=0)
    report = private.privacy_report(delta=1e-3)
    epsilon, _ = private.privacy_spent(1e-3)
    assert f"epsilon: {keras_dp.accounting.format_upper(epsilon, 4)} (delta 0.001)" in report
    assert "RDP accountant" in report and "privacy unit: one example; N = 100 examples" in report
    assert "private steps: 20" in report
    assert ("1. Poisson sampling q = 0.1, expected batch 10: 20 steps, noise multiplier 1.1"
            in report)
    assert "clipping norm C (now): 1" in report
    for uncovered in ("validation data", "hyperparameter search", "adapt()"):
        assert uncovered in report
    assert keras_dp.accounting.privacy_statement(epsilon, 1e-3) in report
    default = private.privacy_report()  # privacy_spent's default delta.
    assert f"delta {keras_dp.accounting.format_upper(keras_dp.default_delta(100), 4, 'g')}" in (
        default)


def test_an_adapt_release_keeps_the_statement_of_poisson_training():
    """Review round 136 (LOW): a keras_dp.adapt release (no sampling) made
    the statement of a Poisson run say its batches were shuffled."""
    x = np.random.default_rng(0).uniform(size=(100, 4)).astype("float32")
    normalization = keras.layers.Normalization()
    keras_dp.adapt(normalization, x, epsilon=1.0, delta=1e-6, value_range=(0, 1))
    private = compiled(keras.Sequential([keras.Input((4,)), normalization,
                                         keras.layers.Dense(1)]), 1.1)
    private.fit(x, np.zeros((100, 1)), batch_size=10, epochs=1, verbose=0)
    report = private.privacy_report(delta=1e-3)
    epsilon, _ = private.privacy_spent(1e-3)
    assert keras_dp.accounting.privacy_statement(epsilon, 1e-3) in report


def test_the_report_of_an_untrained_model_has_no_statement():
    report = compiled(mlp(4, 1), 1.1).privacy_report(delta=1e-3)
    assert "no private step yet" in report and "differentially private" not in report


# ----------------------------------------------------------------- the benchmark


@pytest.mark.program
@pytest.mark.slow  # 17 s; the plan, the measure and the warning have fast tests above.
def test_the_benchmark_runs_yours_and_the_plan_side_by_side():
    done = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "planning.py"),
         "--programs=cnn", "--num_examples=192", "--num_test=64", "--sequence_length=64",
         "--vocabulary=300"],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO_ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| cnn |")]
    table = {row[1]: row for row in rows[-3:]}
    assert set(table) == {"keras", "yours", "plan"}
    assert float(table["plan"][6]) < float(table["yours"][6])  # Noise-to-signal.
    for name in ("yours", "plan"):
        assert float(table[name][8]) <= 3.0  # Epsilon from the model's ledger.
