"""The noise of DP-SGD: the keyed sampler and the bound on its tail."""

import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from keras_dp import noise


@pytest.mark.parametrize("jit_compile", [False, True])  # XLA draws other Philox words.
def test_noise_sampler_draws_independent_standard_gaussians(jit_compile):
    # 200,001 draws asked for, 200,032 given (a multiple of 32). Standard
    # errors: std 0.16%, skewness 0.0055, excess kurtosis 0.011, an empirical
    # CDF value <= 0.0011, a correlation 0.0032; each tolerance is 5-10 of them.
    gaussian = tf.function(noise.gaussian, jit_compile=jit_compile, autograph=False)
    num, key = 200_032, tf.constant(2**40 + 5, tf.int64)
    draws = gaussian(num - 31, 2.0, key, tf.constant(9, tf.int64)).numpy() / 2.0
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
    pairs = num // 2
    first, second = draws[:pairs], draws[pairs:]
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.02
    assert abs(np.corrcoef(first**2, second**2)[0, 1]) < 0.02
    # Same block, same draws; the next block, fresh ones.
    again = gaussian(num, 2.0, key, tf.constant(9, tf.int64)).numpy() / 2.0
    np.testing.assert_array_equal(draws, again)
    other = gaussian(num, 2.0, key, tf.constant(10, tf.int64)).numpy() / 2.0
    assert abs(np.corrcoef(draws, other)[0, 1]) < 0.02
    # Not a shifted copy either (overlapping Philox counter ranges would share
    # most values; independent float32 draws share a few by chance).
    assert len(np.intersect1d(draws, other)) < 0.01 * num


def box_muller(high, low, angle_word):
    """One standard draw (the cosine member) from explicit Philox words."""
    words = [tf.constant([w], tf.uint32) for w in (high, low, angle_word)]
    v = noise.uniform_from_words(*words[:2])
    return float(noise.box_muller(v, words[2], 1.0)[0, 0])


def test_the_noise_reaches_9_4_standard_deviations_before_its_cap():
    # Float32 uniforms capped every noise value at 5.65 sigma*C.
    assert box_muller(0, 0, 2**32 - 1) == pytest.approx(noise.MAX_NOISE_STDDEVS, rel=1e-6)
    assert noise.MAX_NOISE_STDDEVS == pytest.approx(9.42, abs=0.01)
    # The next cell of the refined range is also below the coarse grid's floor.
    assert math.sqrt(-2 * math.log(2**-32)) < box_muller(0, 1, 0) < noise.MAX_NOISE_STDDEVS
    # The coarse grid: high word 1 gives v = 2^-31, whatever the low word.
    assert box_muller(1, 0, 0) == box_muller(1, 2**31, 0)
    assert box_muller(1, 0, 0) == pytest.approx(math.sqrt(62 * math.log(2)), rel=1e-6)


def test_a_block_with_a_zero_radius_word_draws_the_refining_words(monkeypatch):
    # About 1 block in 13,000 of the MLP's size has one: force it by making
    # Philox words small (a radius word of 0 is then likely), and check that
    # exactly those pairs take the refined tail and the rest are unchanged.
    real = noise._philox_words
    monkeypatch.setattr(noise, "_philox_words",
                        lambda sizes, key, counter: [w % 4 for w in real(sizes, key, counter)])
    key, block = tf.constant(3, tf.int64), tf.constant(5, tf.int64)
    draws = noise.gaussian(64, 1.0, key, block).numpy()
    high, angle = (w.numpy() % 4 for w in real([32, 32], key, block))
    low = real([32], key, -1 - block)[0].numpy() % 4
    assert (high == 0).any() and (high != 0).any()
    expected = noise.box_muller(noise.uniform_from_words(high, low), angle, 1.0)
    np.testing.assert_array_equal(draws, tf.reshape(expected, [-1]).numpy())
    assert np.abs(draws[:32][high == 0]).max() > 6.7  # Beyond the coarse grid's 6.66.


def test_the_noise_tail_adds_a_negligible_delta():
    # 663K weights (the benchmark MLP), 60,000 examples, batch 256, 60 epochs.
    steps, rate = 60 * math.ceil(60000 / 256), 256 / 60000
    per_step = noise.noise_tail_probability(663_000, 1.1)
    assert steps * rate * per_step < 1e-5 * 1e-5  # 0.001% of delta = 1e-5.
    # More noise or fewer weights: never more; a 2C sensitivity: more.
    assert noise.noise_tail_probability(663_000, 4.0) <= per_step
    assert noise.noise_tail_probability(1000, 1.1) <= per_step
    assert noise.noise_tail_probability(663_000, 1.1, sensitivity=2.0) > per_step
    assert noise.noise_tail_probability(10, 0.0) == 1.0


@pytest.mark.parametrize("jit_compile", [False, True])
def test_every_bit_of_the_key_and_the_block_selects_the_noise(jit_compile):
    # XLA computes TensorFlow's stateless seeds from their low 32 bits; the
    # noise stream sets Philox's key and counter itself, so keys or blocks
    # differing above bit 32 draw other noise, and XLA draws what eager does.
    draw = tf.function(lambda key, block: noise.gaussian(32, 1.0, key, block),
                       jit_compile=jit_compile)
    eager = noise.gaussian(32, 1.0, tf.constant(5, tf.int64), tf.constant(7, tf.int64))
    base = draw(tf.constant(5, tf.int64), tf.constant(7, tf.int64)).numpy()
    np.testing.assert_allclose(base, eager.numpy(), rtol=1e-5, atol=1e-6)
    for key, block in [(5 + 2**40, 7), (5, 7 + 2**32), (5, 7 + 2**62), (5 - 2**63, 7)]:
        other = draw(tf.constant(key, tf.int64), tf.constant(block, tf.int64)).numpy()
        assert np.abs(np.corrcoef(base, other)[0, 1]) < 0.7, (key, block)


def test_each_tensor_takes_its_own_run_of_one_draw():
    """add_gaussian_noise draws once for all tensors: each gets a contiguous
    run of that draw, in order, and no two share a value."""
    shapes = [(3,), (2, 5), (17,), (0,), (4, 4)]
    key, block = tf.constant(7, tf.int64), tf.constant(3, tf.int64)
    noisy = noise.add_gaussian_noise([tf.zeros(s) for s in shapes], 1.0, key, block)
    # The draw's size: each tensor's rounded up to 64 bytes (16 floats).
    total = sum(-(-int(np.prod(s)) // 16) * 16 for s in shapes)
    draws = noise.gaussian(total, 1.0, key, block).numpy()
    end = 0
    for shape, piece in zip(shapes, noisy):
        assert piece.shape == shape
        run = piece.numpy().ravel()
        if run.size == 0:
            continue
        start = int(np.flatnonzero(draws == run[0])[0])
        assert start >= end, (shape, start, end)  # After the previous run.
        np.testing.assert_array_equal(run, draws[start:start + run.size])
        end = start + run.size


@pytest.mark.parametrize("stddev", [1e-25, 1e-37, 1e18])
def test_the_noise_keeps_its_scale_where_its_square_leaves_float32(stddev):
    # Review round 39: stddev squared underflowed below about 1e-19, and every
    # draw was 0 (C = 1e-25: no noise, epsilon 4.70 reported).
    draws = noise.gaussian(20_000, stddev, tf.constant(3, tf.int64),
                           tf.constant(0, tf.int64)).numpy()
    assert np.all(np.isfinite(draws))
    assert np.std(draws.astype("float64")) / stddev == pytest.approx(1.0, abs=0.03)


# A std below float32's normal range (review round 39), a sum of 8 clipped
# gradients beyond half of its largest number, with no noise at all, and one
# that ghost clipping's terms before they cancel (1024 C an example) could
# pass (review round 78: NaN with one example, finite without).
@pytest.mark.parametrize("l2_norm_clip, noise_multiplier",
                         [(1e-40, 1.0), (1e38, 0.0), (1e36, 0.0)])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_step_whose_noise_float32_cannot_hold_applies_nothing(jit_compile, l2_norm_clip,
                                                                noise_multiplier):
    keras.utils.set_random_seed(0)
    private = keras_dp.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0.
        private.compile(optimizer=keras_dp.DPKerasSGD(
            l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
            learning_rate=1e30 if l2_norm_clip < 1 else 1.0), loss="mse", jit_compile=jit_compile)
    before = [w.numpy().copy() for w in private.trainable_weights]
    with pytest.raises(RuntimeError, match="outside float32's normal range"):
        private.train_on_batch(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"))
    for old, new in zip(before, private.trainable_weights):
        np.testing.assert_array_equal(old, new.numpy())
    assert private.privacy_steps == 0
