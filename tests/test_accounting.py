"""keras_dp.accounting against dp_accounting itself and published values."""

import logging
import math
import time
import warnings

import dp_accounting
import numpy as np
import pytest
from absl import logging as absl_logging
from dp_accounting import dp_event
from dp_accounting import pld
from dp_accounting import rdp

from keras_dp import accounting
from keras_dp import budget
from keras_dp import ledger

# Does not depend on TensorFlow's CPU kernel set (epsilon is arithmetic on the
# sampling rate, noise and step count):
# `make test` runs it once, with oneDNN off (the marker in pytest.ini).
pytestmark = pytest.mark.once

MNIST = dict(num_examples=60000, batch_size=256, delta=1e-5)


def direct_poisson_epsilon(num_examples, batch_size, sigma, steps, delta, accountant):
    """Epsilon straight from dp_accounting, with its own default settings."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            batch_size / num_examples, dp_accounting.GaussianDpEvent(sigma)),
        steps)
    ledger = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    return ledger.compose(event).get_epsilon(delta)


# PLD is slow for small sampling rates, so it gets the cheaper settings.
@pytest.mark.parametrize("num_examples,batch_size,epochs,sigma,accountant", [
    (1000, 20, 2, 0.8, "rdp"),
    (1000, 20, 2, 1.5, "rdp"),
    (60000, 256, 3, 1.1, "rdp"),
    (5000, 250, 2.5, 2.0, "rdp"),
    (5000, 250, 2.5, 2.0, "pld"),
    (60000, 2048, 4, 2.0, "pld"),
])
def test_matches_dp_accounting(num_examples, batch_size, epochs, sigma, accountant):
    steps = math.ceil(epochs * math.ceil(num_examples / batch_size))  # As fit runs.
    expected = direct_poisson_epsilon(num_examples, batch_size, sigma, steps, 1e-5,
                                      accountant)
    got = accounting.compute_epsilon(num_examples, batch_size, sigma, 1e-5,
                                     epochs=epochs, accountant=accountant)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-9)
    assert got == accounting.compute_epsilon(num_examples, batch_size, sigma, 1e-5,
                                             steps=steps, accountant=accountant)


def test_reference_value_to_1e_6():
    epsilon = accounting.compute_epsilon(60000, 150, 1.3, 1e-5, epochs=15)
    assert epsilon == pytest.approx(0.7242234026, rel=1e-6)


@pytest.mark.parametrize("batch_size,epochs,sigma,rdp_epsilon,pld_epsilon", [
    (256, 60, 1.1, 2.6003, 2.3852),
    (2048, 40, 2.15, 2.6390, 2.4206),
])
def test_reference_values(batch_size, epochs, sigma, rdp_epsilon, pld_epsilon):
    for accountant, expected in (("rdp", rdp_epsilon), ("pld", pld_epsilon)):
        got = accounting.compute_epsilon(60000, batch_size, sigma, 1e-5, epochs=epochs,
                                         accountant=accountant)
        assert got == pytest.approx(expected, rel=1e-3), accountant


@pytest.mark.parametrize("accountant", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])
def test_a_ledger_grown_at_its_end_composes_as_one_event(accountant):
    # A budget search asks for the same earlier segments with a growing last
    # one: each answer must equal dp_accounting composing the whole ledger.
    earlier = [ledger.Segment("shuffle", 2.0, 40, releases=3)]
    if accountant == "rdp":  # PLD is slow for Poisson sampling.
        earlier.insert(0, ledger.Segment("poisson", 1.1, 300, sampling_rate=0.01))
    for more in (1, 5, 1, 9):
        segments = earlier + [ledger.Segment("shuffle", 3.0, more)]
        whole = dp_accounting.ComposedDpEvent([s.dp_event() for s in segments])
        direct = (rdp.RdpAccountant(accounting.RDP_ORDERS) if accountant == "rdp"
                  else pld.PLDAccountant()).compose(whole).get_epsilon(1e-5)
        assert budget.epsilon(segments, 1e-5, accountant)[0] == direct


def _random_event(rng, depth=0):
    """A random tree of the events keras-dp's ledger composes, and others."""
    gaussian = dp_accounting.GaussianDpEvent(float(rng.choice([0.0, 0.6, 1.1, 4.0])))
    leaves = [
        gaussian,
        dp_accounting.PoissonSampledDpEvent(float(rng.choice([0.01, 0.25, 1.0])), gaussian),
        dp_event.ZCDpEvent(0.1, 0.01),
        dp_event.RepeatAndSelectDpEvent(gaussian, 3.0, 1.0),
        dp_accounting.NoOpDpEvent(),
        dp_accounting.NonPrivateDpEvent(),
    ]
    kind = rng.integers(0 if depth < 3 else 2, 4)
    if kind == 0:
        return dp_accounting.ComposedDpEvent(
            tuple(_random_event(rng, depth + 1) for _ in range(rng.integers(0, 4))))
    if kind == 1:
        return dp_accounting.SelfComposedDpEvent(_random_event(rng, depth + 1),
                                                 int(rng.choice([1, 7, 3000])))
    nonprivate = rng.random() < 0.1  # Rare: it makes the whole epsilon inf.
    return leaves[5 if nonprivate else rng.integers(0, 5)]


def test_rdp_epsilon_is_dp_accountings_composition_exactly():
    # Each event's RDP is computed once and scaled by its count: the epsilon
    # must be the same float as dp_accounting composing the whole tree.
    rng = np.random.default_rng(7)
    for _ in range(60):
        event = _random_event(rng)
        direct = rdp.RdpAccountant(accounting.RDP_ORDERS).compose(event).get_epsilon(1e-5)
        got = accounting.epsilon_of_event(event, 1e-5, "rdp")
        assert got == direct or (math.isnan(got) and math.isnan(direct)), event
    unsupported = dp_accounting.SelfComposedDpEvent(
        dp_event.TruncatedSubsampledGaussianDpEvent(1000, 0.05, 80, 1.1), 3)
    with pytest.raises(dp_accounting.UnsupportedEventError):
        accounting.epsilon_of_event(unsupported, 1e-5, "rdp")


def test_rdp_events_equal_by_value_but_not_by_type_are_not_confused():
    # dp_accounting composes an int noise inside a Poisson-sampled
    # composition without the sqrt(count) step of a float one, yet the two
    # events are equal and hash alike: a cache by value alone answered the
    # second with the first's (0.257 for 1.214).
    def sampled(noise):
        return dp_accounting.PoissonSampledDpEvent(
            0.01, dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise), 4))

    for first, second in ((sampled(2), sampled(2.0)), (sampled(2.0), sampled(2))):
        accounting.epsilon_of_event(first, 1e-5, "rdp")
        for event in (second, dp_accounting.SelfComposedDpEvent(second, 100)):
            direct = rdp.RdpAccountant(accounting.RDP_ORDERS).compose(event).get_epsilon(1e-5)
            assert accounting.epsilon_of_event(event, 1e-5, "rdp") == direct


@pytest.mark.parametrize("count, error", [(0, ValueError), (-5, ValueError), (2.5, TypeError)])
def test_rdp_refuses_the_counts_dp_accounting_refuses(count, error):
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0), count)
    with pytest.raises(error):
        rdp.RdpAccountant(accounting.RDP_ORDERS).compose(event)
    with pytest.raises(error):
        accounting.epsilon_of_event(event, 1e-5, "rdp")


def test_zero_noise_is_infinite_and_zero_steps_free():
    assert accounting.compute_epsilon(noise_multiplier=0.0, epochs=1, **MNIST) == math.inf
    assert accounting.compute_epsilon(noise_multiplier=1.0, steps=0, **MNIST) == 0.0
    assert accounting.compute_epsilon(noise_multiplier=0.0, epochs=0, **MNIST) == 0.0


def test_shuffle_is_unamplified_gaussian_per_pass():
    gaussian = dp_accounting.GaussianDpEvent(1.1)

    def passes_epsilon(passes):
        event = dp_accounting.SelfComposedDpEvent(gaussian, passes)
        return rdp.RdpAccountant().compose(event).get_epsilon(1e-5)

    by_epochs = accounting.compute_epsilon(noise_multiplier=1.1, epochs=2.5,
                                           sampling="shuffle", **MNIST)
    assert by_epochs == pytest.approx(passes_epsilon(3), rel=1e-9)
    # 234 full batches of 256 fit in 60000: 235 steps may span two passes.
    by_steps = accounting.compute_epsilon(noise_multiplier=1.1, steps=235,
                                          sampling="shuffle", **MNIST)
    assert by_steps == pytest.approx(passes_epsilon(2), rel=1e-9)
    poisson = accounting.compute_epsilon(noise_multiplier=1.1, epochs=2.5, **MNIST)
    assert by_epochs > 5 * poisson


# Time limits: RDP (the default) calibrates in well under 2 s; PLD needs a
# few PLD evaluations of about half a second to a second each. CPU time, not
# wall time: other processes on a shared machine must not fail the test.
@pytest.mark.parametrize("accountant,sampling,setting,seconds", [
    ("rdp", "poisson", dict(num_examples=60000, batch_size=256, epochs=60), 2.0),
    ("rdp", "poisson", dict(num_examples=60000, batch_size=2048, epochs=40), 2.0),
    ("rdp", "shuffle", dict(num_examples=60000, batch_size=256, epochs=60), 2.0),
    ("pld", "poisson", dict(num_examples=60000, batch_size=2048, epochs=40), 6.0),
])
def test_calibration_round_trip(accountant, sampling, setting, seconds):
    accounting.clear_cache()  # Time the real work.
    start = time.process_time()
    sigma = accounting.calibrate_noise_multiplier(3.0, delta=1e-5, accountant=accountant,
                                                  sampling=sampling, **setting)
    elapsed = time.process_time() - start
    epsilon = accounting.compute_epsilon(noise_multiplier=sigma, delta=1e-5,
                                         accountant=accountant, sampling=sampling,
                                         **setting)
    assert 0.99 * 3.0 <= epsilon <= 3.0
    # 1% less noise must overshoot, or sigma was not (nearly) the smallest.
    assert accounting.compute_epsilon(noise_multiplier=0.99 * sigma, delta=1e-5,
                                      accountant=accountant, sampling=sampling,
                                      **setting) > 3.0
    assert elapsed < seconds


# 1e-4 is below what RDP can certify; 1e9 is met by almost no noise.
@pytest.mark.parametrize("target", [0.0, -1.0, math.nan, math.inf, 1e-4, 1e9])
def test_calibration_rejects_target(target):
    with pytest.raises(ValueError, match="target_epsilon"):
        accounting.calibrate_noise_multiplier(target, epochs=60, **MNIST)


def test_calibration_rejects_epochs():
    with pytest.raises(ValueError, match="epochs"):
        accounting.calibrate_noise_multiplier(3.0, epochs=0, **MNIST)


GOOD = dict(num_examples=60000, batch_size=256, noise_multiplier=1.1, delta=1e-5,
            epochs=1)


@pytest.mark.parametrize("change,name", [
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(delta=-1e-5), "delta"),
    (dict(delta=math.nan), "delta"),
    (dict(delta=math.inf), "delta"),
    (dict(noise_multiplier=-0.5), "noise_multiplier"),
    (dict(noise_multiplier=math.nan), "noise_multiplier"),
    (dict(noise_multiplier=math.inf), "noise_multiplier"),
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=-8), "batch_size"),
    (dict(batch_size=60001), "batch_size"),
    (dict(batch_size=2.5), "batch_size"),
    (dict(num_examples=0), "num_examples"),
    (dict(num_examples=-100), "num_examples"),
    (dict(accountant="moments"), "accountant"),
    (dict(sampling="uniform"), "sampling"),
    (dict(steps=10), "steps"),
    (dict(epochs=None), "epochs"),
    (dict(epochs=-1), "epochs"),
    (dict(epochs=math.nan), "epochs"),
    (dict(epochs=None, steps=-1), "steps"),
    (dict(epochs=None, steps=1.5), "steps"),
])
def test_bad_input_names_the_parameter(change, name):
    with pytest.raises(ValueError, match=name):
        accounting.compute_epsilon(**{**GOOD, **change})


def test_default_delta_and_check_delta():
    assert accounting.default_delta(60000) == pytest.approx(60000 ** -1.1)
    assert accounting.default_delta(60000) < 1 / 60000
    accounting.check_delta(accounting.default_delta(60000), 60000)
    for delta in (0.0, -1e-6, 1 / 60000, 1e-3, math.nan):
        with pytest.raises(ValueError, match="delta.*default_delta"):
            accounting.check_delta(delta, 60000)
    with pytest.raises(ValueError, match="num_examples"):
        accounting.default_delta(0)


def test_privacy_statement():
    text = accounting.privacy_statement(2.5967, 1e-5)
    for phrase in ("(2.597, 1e-05)", "e^2.597 = 13.5,", "one training example", "Poisson",
                   "training data only", "Renyi DP"):
        assert phrase in text
    shuffled = accounting.privacy_statement(57.0, 1e-5, accountant="pld",
                                            sampling="shuffle")
    assert "unamplified" in shuffled and "privacy loss distribution" in shuffled
    assert "No differential privacy" in accounting.privacy_statement(math.inf, 1e-5)
    with pytest.raises(ValueError, match="sampling"):
        accounting.privacy_statement(1.0, 1e-5, sampling="uniform")


def test_calibration_for_the_steps_fit_runs():
    # 3,600 examples in batches of 256 for 2 epochs: fit runs 2 * 15 = 30
    # steps, one more than ceil(2 * 3600 / 256) = 29; epochs=2 means those 30.
    sigma = accounting.calibrate_noise_multiplier(2.5, 3600, 256, None, 1e-4, steps=30)
    assert accounting.compute_epsilon(3600, 256, sigma, 1e-4, steps=30) <= 2.5
    assert sigma == accounting.calibrate_noise_multiplier(2.5, 3600, 256, 2, 1e-4)
    assert accounting.compute_epsilon(3600, 256, sigma, 1e-4, epochs=2) == (
        accounting.compute_epsilon(3600, 256, sigma, 1e-4, steps=30))
    with pytest.raises(ValueError, match="steps"):
        accounting.calibrate_noise_multiplier(2.5, 3600, 256, 2, 1e-4, steps=30)


def test_privacy_statement_rounds_its_bounds_up():
    text = accounting.privacy_statement(2.600339, 5.5471e-06)
    assert "(2.601, 5.55e-06)" in text and "at most 5.55e-06." in text
    assert f"e^2.601 = {math.exp(2.601):.3g}" in text  # 13.5, not below e^2.600339.


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_calibration_logs_no_rdp_non_convergence():
    # examples/fashion_mnist.py's setting (q = 0.139, 40 epochs): the search
    # tries sigma = 1, where dp_accounting's RDP series for orders 1.1 to 1.6
    # do not converge; it excludes those orders and logs a warning for each.
    records = _Records()
    logger = absl_logging.get_absl_logger()
    logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accounting.clear_cache()
            sigma = accounting.calibrate_noise_multiplier(3.0, 58800, 8192, 40, 1e-5)
            assert records.messages == [] and caught == []
            # The same value as before the warnings were silenced.
            assert sigma == 3.881152461904258
            # Outside a search the same evaluation still warns: the filter is the search's.
            accounting.clear_cache()
            accounting.compute_epsilon(58800, 8192, 1.0, 1e-5, epochs=40)
    finally:
        logger.removeHandler(records)
    assert sum("failed to converge" in message for message in records.messages) == 6


def _bisection(fits):
    """The most k with fits(k), by doubling then bisection (the reference)."""
    if not fits(0):
        return 0
    low, high = 0, 1
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _counted(function):
    calls = []

    def probe(steps):
        calls.append(steps)
        return function(steps)
    return probe, calls


@pytest.mark.parametrize("curve", [
    lambda k: math.sqrt(k) / 100, lambda k: k / 1000, lambda k: (k / 1000) ** 2,
    lambda k: math.log1p(k), lambda k: 0.0 if k < 777 else 5.0, lambda k: 1.0 + k,
    lambda k: 0.0 if k < 50 else math.inf])
@pytest.mark.parametrize("target", [0.5, 3.0])
def test_the_budget_search_finds_the_bisections_answer_on_any_rising_curve(curve, target):
    probe, calls = _counted(curve)
    want = _bisection(lambda k: curve(k) <= target)
    assert budget.max_steps_within(probe, target) == want
    # Logarithmic however the curve bends: bisection takes about 2 log2(k).
    assert len(calls) <= 3 * math.log2(3 + want) + 2


def test_the_budget_search_probes_dp_accountings_epsilon_half_as_often():
    q, sigma, target, cache = 0.1, 2.0, 2.0, {}

    def epsilon(steps):
        if steps not in cache:
            cache[steps] = accounting.compute_epsilon(
                1000, int(1000 * q), sigma, 1e-5, steps=steps) if steps else 0.0
        return cache[steps]

    probe, calls = _counted(epsilon)
    bisection_probes = []
    want = _bisection(lambda k: bisection_probes.append(k) or epsilon(k) <= target)
    assert budget.max_steps_within(probe, target) == want == 59
    assert epsilon(want) <= target < epsilon(want + 1)
    assert 2 * len(calls) <= len(bisection_probes) + 3, (calls, bisection_probes)
