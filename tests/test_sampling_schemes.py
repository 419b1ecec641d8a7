"""Sampling schemes: each type's event, release rule and row, and truncated Poisson sampling."""

import random

import dp_accounting
import keras
import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import keras_dp
from keras_dp import budget
from keras_dp import ledger
from keras_dp import noise
from keras_dp import sampling_schemes
from keras_dp.ledger import Segment

# Does not depend on TensorFlow's CPU kernel set (accounting of sampling
# schemes): `make test` runs it once, with oneDNN on, which balances its two
# runs (the markers in pytest.ini).
pytestmark = [pytest.mark.once, pytest.mark.with_onednn_on]

DELTA = 1e-5

# One segment of each scheme, with parameters its row must carry.
SEGMENTS = {
    "poisson": Segment("poisson", 1.1, 0, sampling_rate=0.01, num_examples=1000),
    "shuffle": Segment("shuffle", 1.1, 0, steps_per_pass=3.0, num_examples=30),
    "cyclic_poisson": Segment("cyclic_poisson", 1.1, 0, sampling_rate=0.04, steps_per_pass=4.0,
                              num_examples=1000),
    "unknown": Segment("unknown", 1.1, 0),
    "truncated_poisson": Segment("truncated_poisson", 1.1, 0, sampling_rate=0.05,
                                 num_examples=100, max_batch_size=8),
    "statistics": Segment("statistics", 1.1, 0, extra_delta=1e-7),
}


def test_every_scheme_has_a_segment_here_and_a_code_of_its_own():
    assert sorted(SEGMENTS) == sorted(scheme.name for scheme in sampling_schemes.SCHEMES)
    codes = [scheme.code for scheme in sampling_schemes.SCHEMES]
    assert sorted(codes) == [float(code) for code in range(len(codes))]


@pytest.mark.parametrize("name", sorted(SEGMENTS))
def test_the_row_names_the_scheme_and_its_parameters(name):
    segment = SEGMENTS[name]
    back = Segment.from_row(segment.row(), 7, segment.scheme.releases(7))
    assert back.scheme == segment.scheme
    assert back == Segment(**{**segment.__dict__, "steps": 7,
                              "releases": segment.scheme.releases(7)})


def test_a_table_saved_before_the_max_batch_size_column_reads_as_before():
    segment = SEGMENTS["poisson"]
    old_row = np.asarray(segment.row())[None, :-1]  # The width before the column.
    state = {"table": ledger.rows.with_all_columns(old_row), "counts": np.array([[5, 5]])}
    assert ledger.rows.segments_of(state) == [Segment(**{**segment.__dict__, "steps": 5,
                                                           "releases": 5})]


# The graph rule's cases: every scheme, and shuffled passes of an epoch and of one step.
GRAPH_CASES = {**SEGMENTS,
               "shuffle_epoch": Segment("shuffle", 1.1, 0, steps_per_pass=0.0),
               "shuffle_one_step": Segment("shuffle", 1.1, 0, steps_per_pass=1.0)}


@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_the_graph_records_the_releases_the_scheme_counts(name):
    """The in-graph ledger's rule, step by step, is the scheme's `releases`
    (which the budget's look-ahead reads)."""
    segment = GRAPH_CASES[name]
    privacy_ledger = ledger.PrivacyLedger()
    row = tf.constant(segment.row(), tf.float64)
    rng = random.Random(name)
    for _ in range(6):
        if rng.random() < 0.3:
            privacy_ledger.start_pass()
        left = privacy_ledger.steps_left_in_open_pass() if privacy_ledger.segments() else 0.0
        before = sum(s.releases for s in privacy_ledger.segments())
        steps = rng.randint(1, 4)
        for _ in range(steps):
            privacy_ledger.record_step(row)
        after = sum(s.releases for s in privacy_ledger.segments())
        assert after - before == segment.scheme.releases(steps, left)


def _expected_event(name, sigma, releases):
    """Each scheme's event, built here from dp_accounting's types directly."""
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    events = {
        "poisson": dp_accounting.PoissonSampledDpEvent(0.01, gaussian),
        "shuffle": gaussian,
        "cyclic_poisson": dp_accounting.PoissonSampledDpEvent(0.04, gaussian),
        "unknown": gaussian,
        "truncated_poisson": dp_accounting.TruncatedSubsampledGaussianDpEvent(
            100, 0.05, 8, sigma),
        "statistics": gaussian,
    }
    return dp_accounting.SelfComposedDpEvent(events[name], releases)


# Truncated Poisson's PLD takes 10 s: its fit's test below compares it too.
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name == "truncated_poisson" else name
    for name in sorted(SEGMENTS)])
def test_each_scheme_is_accounted_as_dp_accounting_accounts_its_event(name):
    segment = Segment(**{**SEGMENTS[name].__dict__, "steps": 40, "releases": 10,
                         "noise_multiplier": 2.2, "sensitivity": 2.0})
    expected_releases = 40 if segment.scheme.releases_every_step else 10
    assert segment.dp_event() == _expected_event(name, 2.2 / 2.0, expected_releases)
    accountant = segment.scheme.accountants[0]
    epsilon, _ = budget.epsilon([segment], DELTA, accountant)
    reference = dp_accounting.pld.PLDAccountant() if accountant == "pld" else (
        dp_accounting.rdp.RdpAccountant(keras_dp.accounting.RDP_ORDERS))
    left = DELTA - segment.step_delta() * segment.steps  # The vocabulary threshold's.
    assert epsilon == pytest.approx(reference.compose(segment.dp_event()).get_epsilon(left),
                                    rel=1e-9)


def test_truncated_poisson_is_refused_by_the_rdp_accountant_with_the_fix():
    segment = Segment(**{**SEGMENTS["truncated_poisson"].__dict__, "steps": 3})
    with pytest.raises(ValueError, match="accountant='pld'"):
        budget.epsilon([segment], DELTA, "rdp")


def test_an_unknown_scheme_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="'poisson', 'shuffle'"):
        Segment("sliced", 1.0, 3)


# --- Truncated Poisson sampling (one compiled shape).


def test_a_truncated_draw_is_a_uniform_subset_of_a_poisson_draw():
    """Batch sizes follow min(Binomial(N, q), P) and every example is kept
    equally often: a chi-square test of each, false failure below 1e-6."""
    num, steps, cap = 20, 3000, 10
    dataset = keras_dp.data.truncated_poisson_dataset(
        np.arange(num, dtype=np.float32)[:, None], np.zeros(num), expected_batch_size=10,
        max_batch_size=cap, seed=3, steps_per_epoch=steps)
    assert [spec.shape[0] for spec in dataset.element_spec] == [cap] * 3
    sizes, kept = [], np.zeros(num)
    for x, _, weight in dataset:
        real = weight.numpy() > 0
        sizes.append(real.sum())
        kept[x.numpy()[real, 0].astype(int)] += 1
    k = np.arange(num + 1)
    expected = np.bincount(np.minimum(k, cap), weights=scipy.stats.binom.pmf(k, num, 0.5))
    observed = np.bincount(sizes, minlength=cap + 1)
    pooled = expected[:7].sum()  # Sizes below 7 are too rare to test one by one.
    statistic = scipy.stats.chisquare(
        np.r_[observed[:7].sum(), observed[7:]], np.r_[pooled, expected[7:]] * steps)
    assert statistic.pvalue > 1e-6
    assert scipy.stats.chisquare(kept).pvalue > 1e-6


def _tiny_private_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras_dp.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.2,
                                                learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_fit_on_truncated_batches_records_the_truncated_event_at_the_pld_accountant():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 2, 64)
    model = _tiny_private_model()
    dataset = keras_dp.data.truncated_poisson_dataset(x, y, expected_batch_size=8,
                                                      max_batch_size=12, seed=5)
    model.fit(dataset, epochs=1, verbose=0)
    [segment] = model.privacy_ledger.segments()
    assert (segment.sampling, segment.steps, segment.max_batch_size) == (
        "truncated_poisson", 8, 12)
    epsilon, _ = model.privacy_spent(DELTA, accountant="pld")
    tail = 8 * (8 / 64) * noise.noise_tail_probability(10, 1.2)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(64, 8 / 64, 12, 1.2), 8)
    reference = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(DELTA - tail)
    assert epsilon == pytest.approx(reference, rel=1e-9)
    with pytest.raises(ValueError, match="accountant='pld'"):
        model.privacy_spent(DELTA)


def test_truncated_batches_refuse_gradient_accumulation():
    x, y = np.zeros((32, 4), "float32"), np.zeros(32)
    model = _tiny_private_model()
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                gradient_accumulation_steps=2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = keras_dp.data.truncated_poisson_dataset(x, y, expected_batch_size=8,
                                                      max_batch_size=8)
    with pytest.raises(ValueError, match="accumulation_steps"):
        model.fit(dataset, verbose=0)
    assert model.privacy_steps == 0


def test_a_truncation_cap_below_the_expected_batch_is_refused():
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= "
                                         "expected_batch_size"):
        keras_dp.data.truncated_poisson_dataset(np.zeros((10, 2)), expected_batch_size=5,
                                                max_batch_size=4)
