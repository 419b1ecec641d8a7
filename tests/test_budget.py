"""The privacy budget (`keras_dp.budget.PrivacyBudget`) against dp_accounting.

Each composition costs about 0.1 s, so the cases are few and small.
"""

import math

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting import rdp

import keras_dp
from keras_dp import accounting
from keras_dp import budget
from keras_dp.ledger import Segment

# Budgets are arithmetic on the ledger: no CPU kernel changes them.
pytestmark = pytest.mark.once

N = 1000
BATCH_SIZE = 50
SIGMA = 1.0
DELTA = 1e-4


def private_model(prior=None, sigma=SIGMA):
    model = keras_dp.DPSequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=sigma),
                  loss="mse")
    return keras_dp.make_private(model, prior_ledger=prior)


def dp_accounting_epsilon(events, delta):
    """What dp_accounting says, composing `events` itself."""
    accountant = rdp.RdpAccountant(accounting.RDP_ORDERS)
    return accountant.compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(delta)


def poisson_steps(sampling_rate, sigma, steps):
    return dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        sampling_rate, dp_accounting.GaussianDpEvent(sigma)), steps)


def gaussian_releases(sigma, releases):
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), releases)


def test_epsilon_is_dp_accountings_for_the_same_events():
    prior = [Segment("poisson", 1.1, 300, sampling_rate=0.05, num_examples=N),
             Segment("shuffle", 2.0, 40, releases=3, num_examples=N)]
    model = private_model(prior)
    epsilon, _ = budget.PrivacyBudget(model, DELTA).spent()
    expected = dp_accounting_epsilon([poisson_steps(0.05, 1.1, 300),
                                      gaussian_releases(2.0, 3)], DELTA)
    assert epsilon == pytest.approx(expected, rel=1e-12)
    assert model.privacy_spent(DELTA)[0] == epsilon


class _ProbedError(Exception):
    """Ends a fit in on_train_begin, before any step."""


class AllowanceProbe(keras.callbacks.Callback):
    """After PrivacyCallback's on_train_begin, reads its budget's answers."""

    def __init__(self, privacy_callback):
        super().__init__()
        self.privacy_callback = privacy_callback

    def on_train_begin(self, logs=None):
        budget_in_use = self.privacy_callback.budget
        self.allowance = budget_in_use.allowance()
        self.exceed = [budget_in_use.next_steps_exceed(k)
                       for k in (self.allowance, self.allowance + 1)]
        self.segment = self.model.step_mechanism.next_segment()
        raise _ProbedError()


def test_the_allowance_is_the_largest_step_count_that_fits():
    target = 2.6  # About 50 of fit's Poisson steps (q = 0.05, sigma 1); 20 make an epoch.
    callback = keras_dp.PrivacyCallback(delta=DELTA, target_epsilon=target)
    probe = AllowanceProbe(callback)
    model = private_model()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N, 4)).astype("float32"), rng.normal(size=(N, 1))
    with pytest.raises(_ProbedError):
        model.fit(x, y, batch_size=BATCH_SIZE, epochs=5, verbose=0,
                  callbacks=[callback, probe])
    segment = probe.segment
    assert segment.sampling == "poisson" and segment.sampling_rate == BATCH_SIZE / N

    def epsilon_after(steps):  # The steps' truncation and tail deltas come off delta.
        return dp_accounting_epsilon(
            [poisson_steps(segment.sampling_rate, segment.noise_multiplier, steps)],
            DELTA - steps * segment.step_delta())

    k = probe.allowance
    assert 20 < k < 100
    assert epsilon_after(k) <= target < epsilon_after(k + 1)
    assert probe.exceed == [False, True]
    assert model.privacy_steps == 0


def test_a_loose_target_allows_the_steps_whose_truncation_fits_in_delta():
    """A new user's target_epsilon=1e5 (400 examples, batches of 16, delta
    1e-5) was refused ("delta used up") before any step: the allowance's
    search probed step counts whose truncation deltas alone exceed delta.
    Those counts exceed the budget instead."""
    delta, num_examples, batch_size = 1e-5, 400, 16
    callback = keras_dp.PrivacyCallback(delta=delta, target_epsilon=1e5)
    probe = AllowanceProbe(callback)
    model = private_model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_examples, 4)).astype("float32")
    y = rng.normal(size=(num_examples, 1))
    with pytest.raises(_ProbedError):
        model.fit(x, y, batch_size=batch_size, epochs=5, verbose=0,
                  callbacks=[callback, probe])
    extra = probe.segment.extra_delta
    assert probe.exceed == [False, True]
    assert 0 < probe.allowance * extra < delta
    model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0, callbacks=[callback])
    assert model.privacy_steps == 2 * num_examples // batch_size


def test_every_step_counts_for_batches_keras_dp_did_not_sample():
    # Outside fit every step is a full Gaussian release (unknown batches).
    model = private_model()
    segment = model.step_mechanism.next_segment()

    def epsilon_after(releases):
        return dp_accounting_epsilon([gaussian_releases(SIGMA, releases)],
                                     DELTA - releases * segment.step_delta())

    target = (epsilon_after(3) + epsilon_after(4)) / 2
    checked = budget.PrivacyBudget(model, DELTA, target_epsilon=target)
    assert checked.allowance() == 3
    assert not checked.next_steps_exceed(3) and checked.next_steps_exceed(4)
    checked.check_next_steps(steps=3)
    with pytest.raises(RuntimeError, match="would be exceeded by the next steps"):
        checked.check_next_steps(steps=4)
    assert budget.PrivacyBudget(model, DELTA).allowance() == math.inf  # No target.


def test_a_look_ahead_answers_the_next_execution_without_reading_the_ledger(monkeypatch):
    model = private_model()
    checked = budget.PrivacyBudget(model, DELTA, target_epsilon=100.0)
    reads = []
    segments = keras_dp.ledger.PrivacyLedger.segments
    monkeypatch.setattr(keras_dp.ledger.PrivacyLedger, "segments",
                        lambda self: reads.append(1) or segments(self))
    checked.check_next_steps(look_ahead=True)
    assert len(reads) == 1
    assert not checked.next_execution_exceeds()
    assert len(reads) == 1  # Two executions fitted: the next one fits.
    assert not checked.next_execution_exceeds()
    assert len(reads) == 2  # Good for one question only.


def test_the_default_delta_is_for_the_largest_number_of_examples_recorded():
    prior = [Segment("shuffle", 2.0, 5, num_examples=500),
             Segment("shuffle", 3.0, 5, num_examples=N)]
    model = private_model(prior)
    assert budget.PrivacyBudget(model).delta == accounting.default_delta(N)
    assert model.privacy_spent()[0] == model.privacy_spent(accounting.default_delta(N))[0]
    with pytest.warns(UserWarning, match=f"accounting uses {N}"):
        assert budget.PrivacyBudget(model, num_examples=600).delta == accounting.default_delta(N)
    upcoming = Segment("poisson", 1.0, 0, sampling_rate=0.01, num_examples=2 * N)
    assert budget.PrivacyBudget(model, upcoming=upcoming).delta == accounting.default_delta(2 * N)


def test_without_a_recorded_number_of_examples_the_stated_one_or_delta_counts():
    model = private_model([Segment("shuffle", 2.0, 5)])
    assert budget.PrivacyBudget(model, num_examples=N).delta == accounting.default_delta(N)
    assert budget.PrivacyBudget(model, delta=0.5).delta == 0.5  # Taken as stated.
    for refused in (lambda: budget.PrivacyBudget(model), model.privacy_spent):
        with pytest.raises(ValueError, match="number of training examples is unknown"):
            refused()


def test_resolve_delta_refuses_a_delta_of_one_over_n_or_more():
    assert budget.resolve_delta(None, N) == accounting.default_delta(N)
    assert budget.resolve_delta(1e-5, N) == 1e-5
    for delta in (1 / N, 0.0):
        with pytest.raises(ValueError, match=r"delta must be a number in \(0, 1/num_examples\)"):
            budget.resolve_delta(delta, N)
    model = private_model([Segment("shuffle", 2.0, 5, num_examples=N)])
    with pytest.raises(ValueError, match="1/num_examples"):
        budget.PrivacyBudget(model, delta=2 / N)


def test_truncation_that_uses_up_delta_is_refused():
    model = private_model([Segment("poisson", 1.0, 100, sampling_rate=0.05,
                                   extra_delta=1e-6, num_examples=N)])
    with pytest.raises(ValueError, match="is used up by the extra deltas of what ran"):
        budget.PrivacyBudget(model, delta=1e-5).spent()


def test_an_epsilon_made_infinite_by_the_noise_cap_says_why():
    # sigma 0.3 on 10^5 weights: the cap's chance (e^(9.42 / 0.3) 2^-63
    # sqrt(d) per step) uses up delta; sigma 0 says it had no noise.
    low = private_model([Segment("poisson", 0.3, 100, sampling_rate=0.05, num_examples=N,
                                 num_weights=100_000)])
    with pytest.warns(UserWarning, match=r"epsilon is infinite: no noise value beyond 9.42"):
        assert math.isinf(low.privacy_spent(DELTA)[0])
    assert "for the smallest noise multiplier per C of sensitivity, 0.3)" in (
        low.privacy_report(DELTA))
    unnoised = private_model([Segment("poisson", 0.0, 100, sampling_rate=0.05,
                                      num_examples=N)])
    assert "epsilon is infinite: a step added no noise" in unnoised.privacy_report(DELTA)
    assert budget.infinite_because(private_model().privacy_ledger.segments(), DELTA) is None


@pytest.mark.parametrize("settings,name", [
    (dict(accountant="moments"), "accountant"),
    (dict(target_epsilon=math.inf), "target_epsilon"),
    (dict(num_examples=2.5), "num_examples"),
    (dict(delta=1e-2, num_examples=N), "delta"),
])
def test_bad_settings_are_refused_naming_them(settings, name):
    with pytest.raises(ValueError, match=name):
        budget.check_settings(**settings)


def test_epsilon_key_names_the_unit():
    assert budget.epsilon_key("example") == "epsilon"
    assert budget.epsilon_key("user") == "user_epsilon"
