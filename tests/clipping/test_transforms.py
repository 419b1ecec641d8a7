"""The transforms of DP-SGD: the noise sampler and the bound on its tail."""

import math

import numpy as np
import pytest
import tensorflow as tf

from keras_dp import clipping


def test_noise_sampler_draws_independent_standard_gaussians():
    # 200,001 draws (odd: one Box-Muller pair is cut). Standard errors: std
    # 0.16%, skewness 0.0055, excess kurtosis 0.011, an empirical CDF value
    # <= 0.0011, a correlation 0.0032; each tolerance is 5-10 of them.
    num, key = 200_001, tf.constant(2**40 + 5, tf.int64)
    draws = clipping.gaussian(num, 2.0, key, tf.constant(9, tf.int64)).numpy() / 2.0
    assert draws.shape == (num,)
    assert abs(draws.mean()) < 5 / np.sqrt(num)
    assert abs(draws.std() - 1.0) < 0.01
    standardized = (draws - draws.mean()) / draws.std()
    assert abs(np.mean(standardized**3)) < 0.05
    assert abs(np.mean(standardized**4) - 3.0) < 0.1
    for x in (-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0):
        assert abs(np.mean(draws <= x) - 0.5 * (1 + math.erf(x / math.sqrt(2)))) < 0.005, x
    # The two members of each Box-Muller pair, draws i and pairs + i (the cos
    # and the sin half), are independent.
    pairs = (num + 1) // 2
    first, second = draws[:num - pairs], draws[pairs:]
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.02
    assert abs(np.corrcoef(first**2, second**2)[0, 1]) < 0.02
    # Same block, same draws; the next block, fresh ones.
    again = clipping.gaussian(num, 2.0, key, tf.constant(9, tf.int64)).numpy() / 2.0
    np.testing.assert_array_equal(draws, again)
    other = clipping.gaussian(num, 2.0, key, tf.constant(10, tf.int64)).numpy() / 2.0
    assert abs(np.corrcoef(draws, other)[0, 1]) < 0.02
    # Not a shifted copy either (overlapping Philox counter ranges would share
    # most values; independent float32 draws share a few by chance).
    assert len(np.intersect1d(draws, other)) < 0.01 * num


def test_the_noise_reaches_9_4_standard_deviations_before_its_cap():
    # Float32 uniforms capped every noise value at 5.65 sigma*C.
    words = tf.constant([[0, 0, 2**32 - 1], [0, 0, 0], [0, 0, 0]], tf.uint32)
    largest = clipping.box_muller(tf.transpose(words), 1.0).numpy()
    assert largest[0, 0] == pytest.approx(clipping.MAX_NOISE_STDDEVS, rel=1e-6)
    assert clipping.MAX_NOISE_STDDEVS == pytest.approx(9.42, abs=0.01)
    # The next cell of the refined range is also below the coarse grid's floor.
    next_word = clipping.box_muller(tf.constant([[0], [1], [0]], tf.uint32), 1.0).numpy()
    assert math.sqrt(-2 * math.log(2**-32)) < next_word[0, 0] < clipping.MAX_NOISE_STDDEVS
    # The coarse grid: high word 1 gives v = 2^-31.
    coarse = clipping.box_muller(tf.constant([[1], [0], [0]], tf.uint32), 1.0).numpy()
    assert coarse[0, 0] == pytest.approx(math.sqrt(62 * math.log(2)), rel=1e-6)


def test_the_noise_tail_adds_a_negligible_delta():
    # 663K weights (the benchmark MLP), 60,000 examples, batch 256, 60 epochs.
    steps, rate = 60 * math.ceil(60000 / 256), 256 / 60000
    per_step = clipping.noise_tail_probability(663_000, 1.1)
    assert steps * rate * per_step < 1e-5 * 1e-5  # 0.001% of delta = 1e-5.
    # More noise or fewer weights: never more; a 2C sensitivity: more.
    assert clipping.noise_tail_probability(663_000, 4.0) <= per_step
    assert clipping.noise_tail_probability(1000, 1.1) <= per_step
    assert clipping.noise_tail_probability(663_000, 1.1, sensitivity=2.0) > per_step
    assert clipping.noise_tail_probability(10, 0.0) == 1.0
