"""The noise of DP-SGD: a keyed Gaussian sampler, its tail bound, its blocks.

Every private step adds N(0, sigma^2 C^2) to each coordinate of the clipped
sum, drawn from block t (the ledger's counter) of a Philox stream keyed by the
optimizer's 64-bit noise key (`gaussian`, `add_gaussian_noise`), so no step
reuses another's noise; adaptive clipping's count draws from blocks of its own
(`count_noise_block`). No draw exceeds `MAX_NOISE_STDDEVS` standard
deviations, and `noise_tail_probability` bounds what that cap can reveal (the
ledger adds it to delta).

Which noise a step gets is its optimizer's `Privatizer`: `IndependentNoise`
(DP-SGD), or the one its `noise_correlation` makes (e.g.
`keras_dp.correlated_noise.BandedNoise`). A new noise mechanism is one new
`Privatizer` subclass (see docs/architecture.md).
"""

import abc
import math

import numpy as np
import tensorflow as tf


# The radius of a Box-Muller pair is sqrt(-2 ln v) for a uniform v in (0, 1]
# built from 64 random bits, so no noise value exceeds this many stddevs.
# Float32 uniforms (24 bits) would cap it at 5.65, a tail cut that only the
# presence of an example can cross (see `noise_tail_probability`).
MAX_NOISE_STDDEVS = math.sqrt(128 * math.log(2))  # 9.42

# Float32s per 64 bytes (Eigen's alignment): tf.split hands out aligned
# pieces of a tensor's first dimension without copying them.
_ALIGNMENT = 16


def gaussian(num, stddev, key, counter):
    """Independent N(0, stddev^2) draws from one block of a keyed Philox stream.

    Box-Muller on whole tensors: per pair of draws one 32-bit Philox word for
    the angle and one for the radius's uniform v (resolution 2^-32), refined
    by a third word in the cell (0, 2^-32] that the tail comes from, so the
    tail reaches `MAX_NOISE_STDDEVS`. Only a block in which some radius word
    is 0 (about 1 in 13,000 blocks of 663K draws) draws the refining words,
    from the block's mirror counter -1 - counter (never another block's), so
    most blocks draw two words per pair instead of three.

    Args:
        num: Python int, how many draws at least.
        stddev: the standard deviation.
        key: int64 scalar, the 64-bit Philox key of the stream.
        counter: int64 scalar >= 0, the block to draw from; one block per call.

    Returns:
        A float32 tensor of `num` rounded up to a multiple of 32 draws: the
        first half the cosine members of the pairs, the second half their
        sine members.
    """
    pairs = -(-num // (2 * _ALIGNMENT)) * _ALIGNMENT
    high, angle_word = _philox_words([pairs, pairs], key, counter)
    v = tf.cond(tf.reduce_min(high) > 0,
                lambda: _coarse_uniform(high),
                lambda: uniform_from_words(high, *_philox_words([pairs], key, -1 - counter)))
    return tf.reshape(box_muller(v, angle_word, stddev), [-1])


# Adaptive clipping's count draws from blocks this far above the step's: the
# ledger's counter never reaches 2^62, so neither these blocks nor their
# mirrors (-1 - block) meet any gradient block or its mirror.
_COUNT_BLOCKS = 2**62


def count_noise_block(block):
    """The block of the noise stream adaptive clipping's count draws in the
    step whose gradient draws `block` (int64 tensor): its own, never a step's."""
    return block + _COUNT_BLOCKS


def _philox_words(sizes, key, counter):
    """Consecutive runs of uint32 words of block `counter` of the stream `key`.

    Philox-4x32 is keyed by the 64 bits of `key` and counts in 128 bits: the
    high 64 are the block (`counter`'s bits), the low 64 the position in
    it, so blocks never overlap. The same words as one draw of `sum(sizes)`
    split into runs, without the copy the split would make: each run starts
    where the previous one stopped (4 words per counter value, so `sizes`
    are multiples of 4). Key and counter are set directly, not through
    StatelessRandomGetKeyCounter, which XLA computes from the low 32 bits of
    each seed (so that under jit_compile=True keys 5 and 2^40 + 5, or blocks
    0 and 2^32, drew the same noise).
    """
    philox_key = tf.reshape(tf.bitcast(tf.cast(key, tf.int64), tf.uint64), [1])
    block = tf.bitcast(tf.cast(counter, tf.int64), tf.uint64)
    runs, start = [], 0
    for size in sizes:
        philox_counter = tf.stack([tf.constant(start // 4, tf.uint64), block])
        # Philox by name: an algorithm computed from the seed would have
        # to be a compile-time constant under XLA, and with it the step
        # counter, so jit_compile=True would recompile every step.
        runs.append(tf.raw_ops.StatelessRandomUniformFullIntV2(
            shape=[size], key=philox_key, counter=philox_counter,
            alg=tf.random.Algorithm.PHILOX.value, dtype=tf.uint32))
        start += size
    return runs


def _coarse_uniform(high):
    return (tf.cast(high, tf.float32) + 1.0) * 2.0**-32


def uniform_from_words(high, low):
    """The uniform v in (0, 1] of 64 random bits: (high + 1) / 2^32, refined by
    the low word in the cell (0, 2^-32] where the tail comes from. Float32
    holds both exactly enough: its exponent reaches far below 2^-64."""
    return tf.where(high > 0, _coarse_uniform(high),
                    (tf.cast(low, tf.float32) + 1.0) * 2.0**-64)


def box_muller(v, angle_word, stddev):
    """Maps uniforms v in (0, 1] and uint32 angle words to `[2, n]` N(0, stddev^2) draws.

    The radius scales by stddev after the root: stddev squared in float32
    is 0 below about 1e-19 (review round 39: C = 1e-25 drew no noise)."""
    radius = stddev * tf.sqrt(-2.0 * tf.math.log(v))
    angle = tf.cast(angle_word, tf.float32) * (2.0 * np.pi * 2.0**-32)
    return tf.stack([radius * tf.cos(angle), radius * tf.sin(angle)])


def noise_tail_probability(num_coordinates, noise_multiplier, sensitivity=1.0):
    """Bounds the chance that one step's output shows where the noise is capped.

    No noise value exceeds `MAX_NOISE_STDDEVS` * sigma * C, so an output
    further than that from the neighbour's clipped sum could only come from
    the dataset holding the extra example. For a shift Delta of norm at most
    `sensitivity` * C, with s_j = |Delta_j| / (sigma C) and r the cap, that
    event has probability at most sum_j P(R > r - s_j), R the pair's
    radius, and P(R > r - s) = P(v < t) <= 2 t + 2^-64 for
    t = e^(-(r - s)^2 / 2) <= 2^-64 e^(r s) (the uniform v has resolution
    2^-32, and 2^-64 below 2^-32). With sum_j s_j^2 <= S^2 =
    (sensitivity / sigma)^2 and e^(r s) <= 1 + s (e^(r S) - 1) / S on [0, S],
    the sum is at most 2^-64 (3 d + 2 (e^(r S) - 1) sqrt(d)) for d
    coordinates.

    Args:
        num_coordinates: d, the number of noised values (trainable weights).
        noise_multiplier: sigma.
        sensitivity: the sensitivity in multiples of C.

    Returns:
        The per-step probability bound (a Python float, at most 1). Callers
        add it, times the probability that the example takes part in the
        step, to delta: for sigma 1.1 and 663K weights it is 5.7e-13.
    """
    if noise_multiplier == 0:
        return 1.0
    exponent = MAX_NOISE_STDDEVS * sensitivity / noise_multiplier
    if exponent > 700:  # e^exponent would overflow: the bound is vacuous.
        return 1.0
    bound = 2.0**-64 * (3 * num_coordinates
                        + 2 * math.expm1(exponent) * math.sqrt(num_coordinates))
    return min(1.0, bound)


def add_gaussian_noise(tensors, stddev, key, counter):
    """Adds independent N(0, stddev^2) noise to every entry of `tensors`.

    Args:
        tensors: list of tensors (the clipped gradient sums), of static shapes.
        stddev: noise standard deviation (sigma * C for DP-SGD).
        key: int64 scalar, the 64-bit Philox key of the noise stream.
        counter: int64 scalar >= 0, the stream block of this call: callers
            give each step its own, so no noise is ever reused (block t may
            also read the mirror block -1 - t, see `gaussian`).

    Returns:
        The list of noisy tensors.
    """
    # One draw for all tensors: a model's many small weights would otherwise
    # cost several small ops each. Each tensor takes an aligned piece, so
    # the split copies nothing.
    sizes = [t.shape.num_elements() for t in tensors]
    pieces = [-(-size // _ALIGNMENT) * _ALIGNMENT for size in sizes]
    noise = gaussian(sum(pieces), stddev, key, counter)
    # Split lengths that are not all aligned would make tf.split copy them all.
    noise = tf.split(noise, pieces + [noise.shape[0] - sum(pieces)])
    return [t + tf.cast(tf.reshape(n if size == piece else n[:size], t.shape), t.dtype)
            for t, n, size, piece in zip(tensors, noise, sizes, pieces)]


class Privatizer(abc.ABC):
    """How a DP optimizer noises a logical step's clipped sums: one type per mechanism.

    The seam of noise mechanisms. A DP optimizer holds one (its `privatizer`,
    made by `privatizer_for` from its `noise_correlation`), builds it with its
    variables and calls `noised` once per logical step with the step's std
    and its block of the keyed noise stream; the optimizer then divides.
    What the accounting must know of the mechanism is stated here, read by
    the step's mechanism and by fit()'s sampling.

    Attributes:
        column_norm: the largest column norm of the mechanism's strategy
            matrix (1 for independent noise): the ledger records sigma over it.
        participation_groups: b, the cyclic groups fit() samples the examples
            in, so that one example joins at most one of any b consecutive
            steps (1: plain Poisson sampling).
    """

    column_norm = 1.0
    participation_groups = 1

    # Not converted: a body of a docstring alone is one AutoGraph cannot
    # rewrite, which warned in every custom loop's tf.function.
    @tf.autograph.experimental.do_not_convert  # noqa: B027  A hook: stateless noise needs none.
    def build(self, variables, zeros):
        """Makes the state the noise keeps between steps (none by default).

        Args:
            variables: the trainable variables the noise covers.
            zeros: makes a variable of zeros that no save path reaches,
                `(shape, dtype, name)`: what the noise keeps is as secret as
                the noise key.
        """

    @abc.abstractmethod
    def noised(self, clipped_sums, stddev, key, block):
        """The clipped sums plus this step's noise (graph code).

        Args:
            clipped_sums: list of clipped gradient sums, of static shapes.
            stddev: sigma * C of the step (float32 scalar), the std of each
                step's independent draw.
            key: int64 scalar, the 64-bit Philox key of the noise stream.
            block: int64 scalar, the step's block of the stream (the
                ledger's counter: each step its own, see `gaussian`).

        Returns:
            The list of noisy sums.
        """

    def start_segment(self):  # noqa: B027  A hook: stateless noise needs none.
        """Forgets earlier steps' noise: the next step starts a segment (each
        fit; nothing to forget by default)."""


class IndependentNoise(Privatizer):
    """DP-SGD's noise: independent N(0, stddev^2) on every coordinate and step."""

    def noised(self, clipped_sums, stddev, key, block):
        return add_gaussian_noise(clipped_sums, stddev, key, block)


def privatizer_for(noise_correlation):
    """The `Privatizer` of a DP optimizer's `noise_correlation`: `IndependentNoise`
    for None, else the one the correlation makes (its `privatizer()`)."""
    return IndependentNoise() if noise_correlation is None else noise_correlation.privatizer()
