"""Every misuse is refused clearly and before any weight changes; faults are contained.

The table `CASES` holds every bad input we know of. Each case asserts the
error type, words of the message that name the parameter and the fix, and
that a model involved kept its weights, its optimizer step and its privacy
ledger (`privacy_steps`). `test_tally` runs last and counts them.
"""

import dataclasses
import math
import re
import types
import warnings
from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from keras_dp import noise

# Whole private steps, whose kernel-level parts (each layer family's
# per-example gradients, the engines, noise) tests/clipping checks under
# both oneDNN settings: `make test` runs each test, and each parametrized
# case, in one of its two runs (pytest.ini's marker).
pytestmark = pytest.mark.alternating

N = 64  # Examples in the tiny data set.
BATCH = 16
LOGITS_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def small_data(n=N, features=5):
    generator = np.random.default_rng(0)
    return (generator.normal(size=(n, features)).astype("float32"),
            generator.integers(0, 3, n))


def dp_sgd(**kwargs):
    kwargs.setdefault("l2_norm_clip", 1.0)
    kwargs.setdefault("noise_multiplier", 1.1)
    kwargs.setdefault("learning_rate", 0.1)
    return keras_dp.DPKerasSGD(**kwargs)


def sequential(*layers, input_shape=(5,), **input_kwargs):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(input_shape, **input_kwargs), *layers,
                             keras.layers.Flatten(), keras.layers.Dense(3)])


def private(*layers, optimizer=None, **kwargs):
    model = keras_dp.make_private(sequential(*layers, **kwargs))
    model.compile(optimizer=optimizer or dp_sgd(), loss=LOGITS_LOSS)
    return model


def fit(model, data=None, **kwargs):
    x, y = data or small_data()
    return lambda: model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, **kwargs)


def public(name, module):
    """`keras_dp.<name>`, else `keras_dp.<module>.<name>`, else skip the case.

    `compute_epsilon`, `calibrate_noise_multiplier` and `PrivacyCallback` come
    from keras_dp/accounting.py and keras_dp/callbacks.py.
    """
    value = getattr(keras_dp, name, None)
    if value is None:
        try:
            value = getattr(__import__(f"keras_dp.{module}", fromlist=[name]), name)
        except (ImportError, AttributeError):
            pytest.skip(f"keras_dp.{name} is not importable yet (keras_dp/{module}.py)")
    return value


# --- The cases. `make` returns (model or None, trigger); trigger() must raise.


def optimizer_args(**kwargs):
    def make():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # noise_multiplier=0 warnings.
            return None, lambda: dp_sgd(**kwargs)
    return make


def microbatches_not_dividing_the_batch():
    model = private(optimizer=dp_sgd(num_microbatches=3))
    x, y = small_data(8)
    return model, lambda: model.train_on_batch(x, y)


def compute_epsilon_with(delta):
    def make():
        compute_epsilon = public("compute_epsilon", "accounting")
        return None, lambda: compute_epsilon(100, 10, 1.1, delta, epochs=1)
    return make


def privacy_callback_with(delta):
    def make():
        callback = public("PrivacyCallback", "callbacks")
        return None, lambda: callback(delta=delta, num_examples=N)
    return make


def privacy_callback_fit_with(delta):
    """No num_examples: the delta can only be checked once fit() knows N."""
    def make():
        callback = public("PrivacyCallback", "callbacks")
        model = private()
        return model, fit(model, callbacks=[callback(delta=delta)])
    return make


def unreachable_target_epsilon():
    calibrate = public("calibrate_noise_multiplier", "accounting")
    # Full batches for 10,000 epochs: even noise_multiplier=1000 gives 0.24.
    return None, lambda: calibrate(0.1, 100, 100, epochs=10000, delta=1e-3)


def dp_optimizer_on_plain_model():
    model = sequential()
    model.compile(optimizer=dp_sgd(), loss=LOGITS_LOSS)
    return model, fit(model)


def tape_loop_on_private_model():
    """keras-io's training loop from scratch on a model already made private
    (review round 186: the message only said to make it private)."""
    model = private(keras.layers.Dense(3))
    x, y = small_data()

    def step():
        with tf.GradientTape() as tape:
            loss = LOGITS_LOSS(y[:BATCH], model(x[:BATCH], training=True))
        grads = tape.gradient(loss, model.trainable_weights)
        model.optimizer.apply_gradients(zip(grads, model.trainable_weights))
    return model, step


def subclass_overriding(name, bases=(keras_dp.DPKerasSGD,)):
    """Defining a DP optimizer subclass whose `name` replaces the mixin's
    (review round 9: an overridden privatize kept the un-noised sum)."""
    return lambda: (None, lambda: type("Peeking", bases, {name: lambda self, *args: None}))


class PrivatizeOf:
    """A mixin whose privatize would come first in a DP optimizer's MRO."""

    def privatize(self, grad_sum, *args):
        return grad_sum


def replaced_privatizer():
    optimizer = dp_sgd()
    return None, lambda: setattr(optimizer, "_privatizer", optimizer.privatizer)


def model_subclass_overriding(name):
    """Defining a private model class whose `name` replaces keras-dp's (review
    round 10: a `_clipped_gradient_sum` returning 100 times the sum, 91 C)."""
    return lambda: (None, lambda: type("Scaled", (keras_dp.DPSequential,),
                                       {name: lambda self, *args, **kwargs: None}))


def instance_privatize():
    optimizer = dp_sgd()
    return None, lambda: setattr(optimizer, "privatize", lambda *args: args[0])


def plain_optimizer_on_private_model():
    model = private(optimizer="sgd")
    return model, fit(model)


def batch_normalization():
    model = private(keras.layers.BatchNormalization())
    return model, fit(model)


def stateful_rnn():
    model = private(keras.layers.SimpleRNN(4, stateful=True), input_shape=None,
                    batch_shape=(8, 4, 2))
    x = np.ones((8, 4, 2), "float32")
    return model, lambda: model.train_on_batch(x, np.zeros(8))


def lstm_with_dropout():
    model = private(keras.layers.LSTM(4, dropout=0.2), input_shape=(4, 2))
    return model, fit(model, (np.ones((N, 4, 2), "float32"), np.zeros(N)))


class ActivityPenalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(tf.reduce_mean(tf.square(inputs)))
        return inputs


def only_add_loss():
    model = keras_dp.make_private(sequential(ActivityPenalty()))
    model.compile(optimizer=dp_sgd())  # No loss=...
    x, _ = small_data()
    return model, lambda: model.fit(x, batch_size=BATCH, verbose=0)


def no_trainable_weights():
    model = sequential()
    model.trainable = False
    model = keras_dp.make_private(model)
    model.compile(optimizer=dp_sgd(), loss=LOGITS_LOSS)
    return model, fit(model)


@dataclasses.dataclass
class Case:
    id: str
    make: Callable
    error: type
    words: tuple  # Regular expressions, each must match the message.
    xfail: str = ""  # The bug, when keras_dp does not refuse this yet.


CLIP_WORDS = (r"l2_norm_clip", r"finite number > 0", r"1\.0")
NOISE_WORDS = (r"noise_multiplier", r">= 0", r"calibrate_noise_multiplier")
DELTA_WORDS = (r"delta", r"default_delta")

CASES = [
    Case("clip_zero", optimizer_args(l2_norm_clip=0.0), ValueError, CLIP_WORDS),
    Case("clip_negative", optimizer_args(l2_norm_clip=-1.0), ValueError, CLIP_WORDS),
    Case("clip_nan", optimizer_args(l2_norm_clip=math.nan), ValueError, CLIP_WORDS),
    Case("clip_inf", optimizer_args(l2_norm_clip=math.inf), ValueError, CLIP_WORDS),
    Case("clip_string", optimizer_args(l2_norm_clip="1.0"), ValueError, CLIP_WORDS),
    Case("noise_negative", optimizer_args(noise_multiplier=-0.5), ValueError, NOISE_WORDS),
    Case("noise_nan", optimizer_args(noise_multiplier=math.nan), ValueError, NOISE_WORDS),
    Case("noise_inf", optimizer_args(noise_multiplier=math.inf), ValueError, NOISE_WORDS),
    Case("noise_string", optimizer_args(noise_multiplier="1.1"), ValueError, NOISE_WORDS),
    Case("microbatches_zero", optimizer_args(num_microbatches=0), ValueError,
         (r"num_microbatches", r"None or an integer >= 1")),
    Case("microbatches_fraction", optimizer_args(num_microbatches=2.5), ValueError,
         (r"num_microbatches", r"None or an integer >= 1")),
    Case("microbatches_not_dividing_batch", microbatches_not_dividing_the_batch, ValueError,
         (r"num_microbatches=3", r"must divide the batch size", r"multiple of num_microbatches",
          r"batch of 8")),
    Case("accumulation_zero", optimizer_args(gradient_accumulation_steps=0), ValueError,
         (r"gradient_accumulation_steps", r"None or an integer >= 1")),
    Case("secure_mode_with_seed", optimizer_args(secure_mode=True, seed=1), ValueError,
         (r"secure_mode=True", r"seed=1", r"Drop the seed")),
    Case("seed_string", optimizer_args(seed="1"), ValueError, (r"seed", r"integer")),
    Case("compute_epsilon_delta_zero", compute_epsilon_with(0.0), ValueError, DELTA_WORDS),
    Case("compute_epsilon_delta_negative", compute_epsilon_with(-1e-5), ValueError, DELTA_WORDS),
    Case("compute_epsilon_delta_one", compute_epsilon_with(1.0), ValueError, DELTA_WORDS),
    Case("compute_epsilon_delta_one_over_n", compute_epsilon_with(1 / 100), ValueError,
         DELTA_WORDS + (r"1/num_examples|1 / num_examples",)),
    Case("privacy_callback_delta_one_over_n", privacy_callback_with(1 / N), ValueError,
         DELTA_WORDS + (r"1/num_examples",)),
    Case("privacy_callback_delta_zero", privacy_callback_with(0.0), ValueError,
         DELTA_WORDS + (r"1/num_examples",)),
    Case("privacy_callback_delta_one_over_n_in_fit", privacy_callback_fit_with(1 / N),
         ValueError, DELTA_WORDS + (r"1/num_examples",)),
    Case("unreachable_target_epsilon", unreachable_target_epsilon, ValueError,
         (r"target_epsilon=0\.1", r"cannot be reached",
          r"larger target_epsilon, fewer epochs or a smaller batch_size")),
    Case("dp_optimizer_on_plain_model", dp_optimizer_on_plain_model, RuntimeError,
         (r"DPKerasSGD only applies privatized gradients", r"keras_dp\.make_private\(model\)")),
    Case("tape_loop_on_private_model", tape_loop_on_private_model, RuntimeError,
         (r"only applies privatized gradients", r"GradientTape", r"train_on_batch",
          r"keras_dp\.custom_loops\.PrivateSteps")),
    Case("plain_optimizer_on_private_model", plain_optimizer_on_private_model, ValueError,
         (r"needs a DP optimizer", r"SGD", r"DPKerasSGD", r"make_dp_optimizer_class")),
    Case("batch_normalization", batch_normalization, ValueError,
         (r"BatchNormalization", r"mixes examples", r"GroupNormalization",
          r"training=False.*layer\.trainable = False")),
    Case("stateful_rnn", stateful_rnn, ValueError,
         (r"SimpleRNN", r"is stateful", r"stateful=False")),
    Case("lstm_with_dropout", lstm_with_dropout, ValueError,
         (r"LSTM", r"dropout", r"keras\.layers\.Dropout")),
    Case("only_add_loss", only_add_loss, ValueError,
         (r"compile\(loss=\.\.\.\)", r"add_loss\(\)")),
    Case("no_trainable_weights", no_trainable_weights, ValueError,
         (r"no trainable weights", r"trainable = True")),
    Case("make_private_on_a_layer",
         lambda: (None, lambda: keras_dp.make_private(keras.layers.Dense(3))), TypeError,
         (r"make_private expects a keras\.Model", r"Dense", r"keras\.Sequential")),
    Case("dp_optimizer_subclass_overriding_privatize", subclass_overriding("privatize"),
         TypeError, (r"overrides privatize", r"un-noised clipped sum",
                     r"make_dp_optimizer_class on your class", r"override apply\(\)")),
    Case("dp_optimizer_subclass_overriding_apply_noisy", subclass_overriding("_apply_noisy"),
         TypeError, (r"overrides _apply_noisy", r"make_dp_optimizer_class")),
    Case("dp_optimizer_subclass_with_a_mixin_privatize",
         subclass_overriding("extra", (PrivatizeOf, keras_dp.DPKerasSGD)), TypeError,
         (r"overrides privatize",)),
    Case("private_model_overriding_clipped_gradient_sum",
         model_subclass_overriding("_clipped_gradient_sum"), TypeError,
         (r"overrides _clipped_gradient_sum", r"super\(\)\.train_step\(data\)")),
    Case("private_model_overriding_private_step", model_subclass_overriding("_private_step"),
         TypeError, (r"overrides _private_step",)),
    Case("dp_optimizer_mechanism_state_replaced", replaced_privatizer, AttributeError,
         (r"_privatizer holds the state of its noise mechanism", r"new DP optimizer")),
    Case("dp_optimizer_loss_scale_factor", optimizer_args(loss_scale_factor=1e-3), ValueError,
         (r"no loss_scale_factor", r"0\.001", r"Drop it")),
    Case("private_model_overriding_make_train_function",
         model_subclass_overriding("make_train_function"), TypeError,
         (r"overrides make_train_function",)),
    Case("dp_optimizer_instance_privatize", instance_privatize, AttributeError,
         (r"overrides privatize", r"override apply\(\)")),
    Case("make_dp_optimizer_class_on_a_string",
         lambda: (None, lambda: keras_dp.make_dp_optimizer_class("sgd")), TypeError,
         (r"make_dp_optimizer_class", r"keras\.optimizers\.Optimizer subclass",
          r"keras\.optimizers\.SGD")),
    Case("make_dp_optimizer_class_on_an_instance",
         lambda: (None, lambda: keras_dp.make_dp_optimizer_class(keras.optimizers.SGD())),
         TypeError, (r"make_dp_optimizer_class", r"Optimizer subclass")),
]

# Filled by the table test; read by test_tally (which runs after it).
_TRIED = set()
_REFUSED = set()


def _state(model):
    """Everything a refusal must leave untouched."""
    state = {"variables": [np.array(v) for v in model.variables]}
    if hasattr(model, "privacy_steps"):
        state["privacy_steps"] = model.privacy_steps
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, str):
        state["iterations"] = int(optimizer.iterations.numpy())
    return state


def _params():
    for case in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
        yield pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_bad_input_is_refused_clearly(case):
    model, trigger = case.make()
    before = None if model is None else _state(model)
    _TRIED.add(case.id)
    with pytest.raises(Exception) as raised:
        trigger()
    # Not pytest.raises(case.error): a missing refusal must fail, not error out.
    assert type(raised.value) is case.error, (
        f"expected {case.error.__name__}, got {type(raised.value).__name__}: {raised.value}")
    message = str(raised.value)
    for word in case.words:
        assert re.search(word, message), f"{word!r} not in the message: {message}"
    if model is not None:
        after = _state(model)
        assert after.keys() == before.keys()
        for w0, w1 in zip(before.pop("variables"), after.pop("variables")):
            np.testing.assert_array_equal(w0, w1)
        assert after == before
        if hasattr(model, "privacy_steps"):
            assert model.privacy_steps == 0
    _REFUSED.add(case.id)


def test_tally(request):
    """Counts the table: every bad input tried is refused, except the known
    bugs; every case selected ran (`make test` shares them between its two
    runs)."""
    if not _TRIED:
        pytest.skip("run together with test_bad_input_is_refused_clearly")
    known_bugs = {case.id for case in CASES if case.xfail}
    selected = {item.callspec.params["case"].id for item in request.session.items
                if item.originalname == "test_bad_input_is_refused_clearly"}
    print(f"\n{len(_TRIED)} bad inputs tried, {len(_REFUSED)} refused clearly "
          f"({len(CASES)} in the table; not refused: {sorted(_TRIED - _REFUSED)})")
    assert len(CASES) == 43
    assert _TRIED == selected
    assert _REFUSED == _TRIED - known_bugs


# --- noise_multiplier=0 is allowed, loudly.


@pytest.mark.once  # Grouping and warnings, not kernels: once.
def test_zero_noise_trains_only_with_a_loud_warning():
    with pytest.warns(UserWarning, match="NOT differentially private"):
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=0.0)
    model = private(optimizer=optimizer)
    fit(model)()
    assert model.privacy_steps == math.ceil(N / BATCH)


@pytest.mark.once  # Grouping and warnings, not kernels: once.
def test_zero_noise_warning_points_at_the_callers_line():
    with pytest.warns(UserWarning, match="NOT differentially private") as record:
        keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=0.0)
    assert record[0].filename == __file__, f"{record[0].filename}:{record[0].lineno}"


@pytest.mark.once  # Grouping and warnings, not kernels: once.
def test_zero_noise_privacy_callback_warns_too():
    callback = public("PrivacyCallback", "callbacks")
    with pytest.warns(UserWarning, match="NOT differentially private"):
        model = private(optimizer=dp_sgd(noise_multiplier=0.0))
        fit(model, callbacks=[callback(delta=1e-3)])()
    assert math.isinf(model.history.history["epsilon"][-1])


# --- Faults met during training.


@pytest.mark.once  # Grouping and warnings, not kernels: once.
def test_microbatches_that_divide_the_batch_size_train_with_poisson_fit():
    model = private(optimizer=dp_sgd(num_microbatches=4))
    fit(model)()
    assert model.privacy_steps == math.ceil(N / BATCH)


def test_microbatches_and_a_partial_last_batch_are_refused_before_training():
    model = private(optimizer=dp_sgd(num_microbatches=4))
    before = _state(model)
    x, y = small_data(70)
    with pytest.raises(ValueError, match="num_microbatches=4 does not divide the last batch"):
        model.fit(x, y, batch_size=BATCH, sampling="shuffle", verbose=0)
    after = _state(model)
    for w0, w1 in zip(before.pop("variables"), after.pop("variables")):
        np.testing.assert_array_equal(w0, w1)
    assert after == before


@pytest.mark.parametrize("dataset_microbatches, optimizer_microbatches",
                         [(None, 4), (4, None), (2, 4)])
def test_a_poisson_dataset_laid_out_for_other_microbatches_is_refused(
        dataset_microbatches, optimizer_microbatches):
    # Laid out without the optimizer's groups, one example can shift the rows
    # after it into other microbatches and move the clipped sum by over 2C.
    model = private(optimizer=dp_sgd(num_microbatches=optimizer_microbatches))
    before = _state(model)
    x, y = small_data(64)
    dataset = keras_dp.data.poisson_dataset(x, y, expected_batch_size=BATCH, seed=0,
                                            num_microbatches=dataset_microbatches)
    with pytest.raises(ValueError, match=f"num_microbatches={optimizer_microbatches}"):
        model.fit(dataset, verbose=0)
    after = _state(model)
    for w0, w1 in zip(before.pop("variables"), after.pop("variables")):
        np.testing.assert_array_equal(w0, w1)
    assert after == before


def test_an_overridden_compute_loss_is_refused():
    # The private step evaluates compile()'s loss per example: an override
    # would be ignored silently.
    class CustomLoss(keras_dp.DPSequential):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):
            return 100.0 * super().compute_loss(x, y, y_pred, sample_weight, training)

    model = CustomLoss([keras.Input((5,)), keras.layers.Dense(3)])
    model.compile(optimizer=dp_sgd(), loss="sparse_categorical_crossentropy")
    weights = model.get_weights()
    x, y = small_data(8)
    with pytest.raises(ValueError, match="overrides compute_loss"):
        model.train_on_batch(x, y)
    for w0, w1 in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(w0, w1)


class CountingSGD(keras_dp.DPKerasSGD):
    """A DP optimizer subclass of what may be overridden: `__init__`,
    `apply` (it receives the noised average) and `get_config`."""

    def __init__(self, *args, label="counting", **kwargs):
        super().__init__(*args, **kwargs)
        self.label = label
        self.applied = 0

    def apply(self, grads, trainable_variables=None):
        self.applied += 1
        return super().apply(grads, trainable_variables)

    def get_config(self):
        return {**super().get_config(), "label": self.label}


@pytest.mark.once  # Class construction, not kernels: once.
def test_a_subclass_overriding_only_init_apply_and_config_trains_as_its_parent():
    trained = []
    for optimizer_class in (keras_dp.DPKerasSGD, CountingSGD):
        keras.utils.set_random_seed(0)
        model = keras_dp.make_private(sequential())
        optimizer = optimizer_class(l2_norm_clip=1.0, noise_multiplier=1.1, seed=3)
        optimizer.noise_multiplier = 1.2  # A property's setter is no override.
        model.compile(optimizer=optimizer, loss=LOGITS_LOSS)
        x, y = small_data()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        trained.append((model.get_weights(), model.privacy_steps))
    assert optimizer.applied == 1  # Its Python ran once, while the step was traced.
    assert trained[0][1] == trained[1][1] == N // BATCH
    for w0, w1 in zip(trained[0][0], trained[1][0]):
        np.testing.assert_array_equal(w0, w1)


class AddsTheAccumulation(keras_dp.DPKerasSGD):
    """An overridden apply adding what the optimizer still holds of the
    accumulated clipped sums (review round 10: they held the logical step's
    un-noised sum while apply ran, 100 C)."""

    def apply(self, grads, trainable_variables=None):
        held = [tf.convert_to_tensor(total) for total in self._accumulation.sums]
        return super().apply([g + h for g, h in zip(grads, held)], trainable_variables)


@pytest.mark.once  # The order of an update's ops, not kernels: once.
def test_an_overridden_apply_finds_no_accumulated_sum():
    trained = []
    for optimizer_class in (keras_dp.DPKerasSGD, AddsTheAccumulation):
        keras.utils.set_random_seed(0)
        model = keras_dp.make_private(sequential())
        model.compile(optimizer=optimizer_class(l2_norm_clip=1.0, noise_multiplier=1.1, seed=3,
                                                gradient_accumulation_steps=2),
                      loss=LOGITS_LOSS)
        x, y = small_data()
        for start in (0, BATCH):
            model.train_on_batch(x[start:start + BATCH], y[start:start + BATCH])
        trained.append(model.get_weights())
    for w0, w1 in zip(*trained):
        np.testing.assert_array_equal(w0, w1)


def non_finite_model():
    keras.utils.set_random_seed(0)
    return keras_dp.make_private(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
        keras.layers.Dense(2)]))


def brute_force_update(model, x, y, clip):
    """Sum of each example's clipped gradient, over the finite ones only."""
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y[i:i + 1], model(x[i:i + 1]))
        grads = [g.numpy().astype(np.float64)
                 for g in tape.gradient(loss, model.trainable_variables)]
        norm = math.sqrt(sum(np.sum(g * g) for g in grads))
        if math.isfinite(norm):
            total = [t + g * min(1.0, clip / norm) for t, g in zip(total, grads)]
    return total


def poison(x, y, kind):
    x, y = x.copy(), y.copy()
    if kind == "inf_input":
        x[2, 1] = np.inf
    elif kind == "nan_input":
        x[2, 1] = np.nan
    elif kind == "nan_label":
        y[2, 0] = np.nan
    else:  # "overflow": finite input, but its squared error overflows float32.
        y[2, 0] = 3e38
    return x, y


@pytest.mark.parametrize("kind", ["inf_input", "nan_input", "nan_label", "overflow"])
def test_a_non_finite_gradient_contributes_zero(kind):
    batch, clip = 8, 0.5
    generator = np.random.default_rng(1)
    clean_x = generator.normal(size=(batch, 4)).astype("float32") * 3
    clean_y = generator.normal(size=(batch, 2)).astype("float32")
    x, y = poison(clean_x, clean_y, kind)
    model = non_finite_model()
    with pytest.warns(UserWarning, match="NOT differentially private"):
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=clip, noise_multiplier=0.0,
                                        learning_rate=1.0)
    model.compile(optimizer=optimizer, loss="mse")
    before = [v.numpy() for v in model.trainable_variables]
    expected = brute_force_update(model, x, y, clip)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert int(logs["nonfinite_gradients"]) == 1
    assert model.privacy_steps == 1
    for w0, w1, g in zip(before, model.trainable_variables, expected):
        assert np.all(np.isfinite(w1.numpy()))
        # The bad example counts in the divisor B but adds nothing.
        np.testing.assert_allclose(w0 - w1.numpy(), g / batch, rtol=1e-4, atol=1e-6)

    # A clean batch afterwards (of the same shape: no second trace) reports
    # no non-finite gradient.
    clean = model.train_on_batch(clean_x, clean_y, return_dict=True)
    assert int(clean["nonfinite_gradients"]) == 0


def test_non_finite_gradients_are_counted_in_fit_logs():
    x, y = small_data(N, 4)
    y = np.zeros((N, 2), "float32")
    x[5, 0] = np.inf
    model = non_finite_model()
    model.compile(optimizer=dp_sgd(), loss="mse")
    seen = []
    model.fit(x, y, batch_size=N, sampling="shuffle", shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(
                  on_train_batch_end=lambda batch, logs: seen.append(
                      int(logs["nonfinite_gradients"])))])
    assert seen == [1]
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


def test_noise_is_still_added_when_an_example_is_non_finite():
    # Zero inputs, no bias: every finite gradient is 0, so the update is pure
    # noise of std sigma*C/B (100,000 draws: 3% is ten standard errors). One
    # example's inf input makes its gradient NaN; it must not silence the noise.
    sigma, clip, batch = 1.3, 0.5, 32
    keras.utils.set_random_seed(0)
    model = keras_dp.make_private(keras.Sequential([
        keras.Input((100,)), keras.layers.Dense(1000, use_bias=False)]))
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=clip, noise_multiplier=sigma,
                                                learning_rate=1.0, seed=3), loss="mse")
    x = np.zeros((batch, 100), "float32")
    x[0, 0] = np.inf
    before = model.trainable_variables[0].numpy()
    logs = model.train_on_batch(x, np.zeros((batch, 1000), "float32"), return_dict=True)
    update = before - model.trainable_variables[0].numpy()
    assert int(logs["nonfinite_gradients"]) == 1
    assert np.all(np.isfinite(update))
    assert abs(update.mean()) < 5 * sigma * clip / batch / math.sqrt(update.size)
    np.testing.assert_allclose(update.std(), sigma * clip / batch, rtol=0.03)


# --- Where the noise comes from.


def zero_gradient_updates(optimizer_kwargs, seed=0):
    """Weight change of one step on a zero-gradient setup: pure noise."""
    keras.utils.set_random_seed(seed)
    model = keras_dp.make_private(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(50, use_bias=False)]))
    model.compile(optimizer=dp_sgd(learning_rate=1.0, **optimizer_kwargs), loss="mse")
    before = model.trainable_variables[0].numpy()
    model.train_on_batch(np.zeros((4, 4), "float32"), np.zeros((4, 50), "float32"))
    return before - model.trainable_variables[0].numpy()


def test_secure_mode_noise_differs_even_under_the_same_seed():
    first = zero_gradient_updates(dict(secure_mode=True))
    second = zero_gradient_updates(dict(secure_mode=True))
    assert first.std() > 0 and second.std() > 0
    assert not np.any(first == second)
    assert abs(np.corrcoef(first.ravel(), second.ravel())[0, 1]) < 0.5

    keras.utils.set_random_seed(0)
    keys = {dp_sgd(secure_mode=True)._noise_key for _ in range(20)}
    assert len(keys) == 20


def test_secure_mode_round_trips_through_the_config():
    optimizer = dp_sgd(secure_mode=True)
    config = optimizer.get_config()
    assert config["secure_mode"] is True and config["seed"] is None
    restored = type(optimizer).from_config(config)
    assert restored.secure_mode
    assert restored._noise_key != optimizer._noise_key  # Fresh entropy, never saved.


def fit_twice_weights(global_seed, **optimizer_kwargs):
    """Trains a tiny private model (Poisson batches, noise) from a global seed."""
    keras.utils.set_random_seed(global_seed)
    model = keras_dp.make_private(keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]))
    model.compile(optimizer=dp_sgd(**optimizer_kwargs), loss=LOGITS_LOSS)
    model.fit(*small_data(), batch_size=BATCH, epochs=2, verbose=0)
    return [v.numpy() for v in model.trainable_variables]


@pytest.mark.once  # Seeds and entropy, not kernels.
def test_an_optimizer_seed_reproduces_noise_and_batches():
    first, again = fit_twice_weights(5, seed=7), fit_twice_weights(5, seed=7)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    other = fit_twice_weights(5, seed=8)
    assert not np.allclose(first[0], other[0])


@pytest.mark.once  # Seeds and entropy, not kernels.
def test_without_a_seed_set_random_seed_does_not_fix_the_noise():
    # The noise key comes from OS entropy: a re-run script cannot replay it.
    first, again = fit_twice_weights(5), fit_twice_weights(5)
    assert not np.allclose(first[0], again[0])


@pytest.mark.once  # Seeds and entropy, not kernels.
def test_secure_mode_is_not_reproducible_under_set_random_seed():
    first, again = fit_twice_weights(5, secure_mode=True), fit_twice_weights(5, secure_mode=True)
    assert not np.allclose(first[0], again[0])


def test_every_noise_draw_is_keyed_by_63_secret_bits_with_unique_counters(monkeypatch):
    # Philox's 64-bit key must be the secret, and the block (the high half of
    # its 128-bit counter) must never repeat.
    draws = []
    uniform = tf.raw_ops.StatelessRandomUniformFullIntV2

    def spy(**kwargs):
        draws.append((int(kwargs["key"].numpy()[0]), int(kwargs["counter"].numpy()[1])))
        return uniform(**kwargs)

    monkeypatch.setattr(tf.raw_ops, "StatelessRandomUniformFullIntV2", spy)
    optimizer = dp_sgd(secure_mode=True)
    variables = [tf.Variable(tf.zeros([3, 2])), tf.Variable(tf.zeros([2]))]
    optimizer.build(variables)
    for block in range(3):
        optimizer.privatize([tf.zeros([3, 2]), tf.zeros([2])], 4, 1.0,
                            tf.constant(optimizer._noise_key, tf.int64), block)
    assert len(draws) == 3 * 2  # One draw per step for all variables (radius, angle words).
    assert {key for key, _ in draws} == {optimizer._noise_key}
    assert optimizer._noise_key >= 2**32  # Not a 31/32-bit seed (probability 2^-31).
    assert sorted({block for _, block in draws}) == [0, 1, 2]


def noise_of_two_models_sharing_one_optimizer(**optimizer_kwargs):
    """The updates of one zero-gradient step of each of two private models
    of disjoint variables, compiled with one optimizer (built for both)."""
    layers = [keras.layers.Dense(16, use_bias=False) for _ in range(2)]
    models = []
    for layer in layers:
        inputs = keras.Input((16,))
        models.append(keras_dp.make_private(keras.Model(inputs, layer(inputs))))
    optimizer = dp_sgd(**optimizer_kwargs)
    optimizer.build([layer.kernel for layer in layers])
    zeros = np.zeros((100, 16), "float32")
    updates = []
    for model, layer in zip(models, layers):
        model.compile(optimizer=optimizer, loss="mse")
        before = layer.kernel.numpy()
        model.fit(zeros, zeros, batch_size=10, epochs=1, steps_per_epoch=1, verbose=0)
        updates.append((layer.kernel.numpy() - before).ravel())
    return updates


def test_one_optimizer_noises_each_ledger_of_its_variables_with_its_own_stream():
    """Review round 60: two private models of disjoint variables compiled
    with one optimizer drew the same noise (correlation 0.9999999999997):
    the difference of their updates was the clipped sum without noise."""
    first, second = noise_of_two_models_sharing_one_optimizer()
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.3  # 256 draws each.
    # A seed fixes the noise of every model it trains (documented).
    first, second = noise_of_two_models_sharing_one_optimizer(seed=3)
    np.testing.assert_allclose(first, second, atol=1e-7)  # Rounding of unequal weights.


def captured_poisson_batches(monkeypatch, seed, **optimizer_kwargs):
    """The first pass of the Poisson dataset fit() builds, under a global seed."""
    from keras_dp import data as data_module
    made = []
    poisson_dataset = data_module.poisson_dataset

    def spy(*args, **kwargs):
        made.append(poisson_dataset(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(data_module, "poisson_dataset", spy)
    keras.utils.set_random_seed(seed)
    model = private(optimizer=dp_sgd(**optimizer_kwargs))
    fit(model)()
    # The rows drawn, not only the padding weights: two draws of one batch
    # size share those by chance (a flaky comparison, seen once in make test).
    return [np.concatenate([np.ravel(x), np.ravel(w)]) for x, _, w in made[0].take(2)]


@pytest.mark.once  # Seeds and entropy, not kernels.
def test_secure_mode_also_draws_batches_from_os_entropy(monkeypatch):
    first = captured_poisson_batches(monkeypatch, 0, secure_mode=True)
    again = captured_poisson_batches(monkeypatch, 0, secure_mode=True)
    assert not all(np.array_equal(a, b) for a, b in zip(first, again))


def test_the_noise_key_is_no_constant_of_the_compiled_step():
    """Review round 179: the key was a constant of the traced step, so XLA's
    compiled program, which a TensorBoard profile stores, held its two
    32-bit halves: the key, then every step's noise, was recovered from the
    profile. The step reads it from a variable that is never saved."""
    optimizer = dp_sgd(secure_mode=True)
    variables = [tf.Variable(tf.zeros([3, 2]))]
    optimizer.build(variables)
    step = types.SimpleNamespace(noise_stream=12345)
    key = optimizer._noise_key ^ step.noise_stream

    @tf.function(jit_compile=True)
    def noised(block):
        return optimizer.privatize([tf.zeros([3, 2])], 4, 1.0, optimizer._stream_key(step), block)

    program = noised.experimental_get_compiler_ir(tf.constant(0, tf.int64))(stage="hlo")
    halves = [key & 0xFFFFFFFF, key >> 32]
    as_int32 = [h - 2**32 if h >= 2**31 else h for h in halves]
    assert not any(str(value) in program for value in halves + as_int32 + [key])
    expected = noise.add_gaussian_noise([tf.zeros([3, 2])], 1.0, tf.constant(key, tf.int64),
                                        tf.constant(0, tf.int64))[0] / 4
    np.testing.assert_allclose(noised(tf.constant(0, tf.int64))[0], expected, rtol=1e-5)
