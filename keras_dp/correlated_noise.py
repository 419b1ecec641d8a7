"""Correlated noise: banded matrix factorization with amplification (DP-MF).

DP-SGD adds independent noise z_t ~ N(0, sigma^2 C^2) to each step's clipped
sum. A matrix-factorization mechanism adds w = C^-1 z instead, for a lower
triangular strategy matrix C: the noise of step t partly cancels that of
earlier steps in the running sum of updates, which is what the weights
carry. `BandedMF(bands=b)` uses a banded Toeplitz C with coefficients
c_0 .. c_{b-1} (c_j on the j-th diagonal), so

    w_t = (z_t - sum_{j=1}^{b-1} c_j w_{t-j}) / c_0,

and the optimizer's privatizer keeps the b - 1 last w's (`BandedNoise`). b = 1 is c = [1]:
DP-SGD, step for step.

Privacy (Choquette-Choo et al. 2023, "Amplified Banded Matrix
Factorization"): releasing the noisy sums is post-processing of C x + z,
where x stacks the clipped sums. fit() splits the examples into b fixed
groups and step t Poisson-samples only group t mod b, with q = b * B / N
(`keras_dp.data.poisson_dataset(participation_groups=b)`), so one example
joins at most one of any b consecutive steps; the columns of a b-banded C at
steps b or more apart do not overlap, so its participations are independent
Poisson-sampled Gaussians of multiplier sigma / (largest column norm of C),
one per cycle of b steps: epsilon is DP-SGD's for ceil(T / b) steps at rate
q. The coefficients are normalized to column norm 1, so the multiplier is
sigma. The ledger records these steps as `"cyclic_poisson"` segments.

Segments: the noise buffer is as secret as the noise key (who knows it can
subtract the noise from released weights), so it is never saved (not an
optimizer variable, not trackable). Every fit() starts a new segment: an
empty buffer and groups drawn afresh; a restored model starts
with an empty buffer too, and so does a step whose noise std differs from
the last one's (`BandedNoise.correlate`). The segments' noises are independent (distinct
blocks of the noise stream), so their guarantees compose, and the ledger
counts each fit's ceil(T / b) releases on its own. Memory: (b - 1) floats
per weight; time: b - 1 multiply-adds per weight per logical step beside the
noise draw.
"""

import functools
import math

import keras
import numpy as np
import scipy.optimize
import scipy.signal
import tensorflow as tf

from keras_dp import noise
from keras_dp import sampling_schemes

# The number of steps the default strategy is optimized for.
DEFAULT_STEPS = 1000


@keras.saving.register_keras_serializable(package="keras_dp")
class BandedMF:
    """A banded Toeplitz matrix factorization of the noise (correlated noise).

    Given to a DP optimizer as `noise_correlation=keras_dp.BandedMF(bands=b)`.
    The coefficients c_0 .. c_{b-1} minimize the total squared error of the
    noise in the prefix sums of the updates over `steps` steps (in units of
    sigma^2 C^2): sum_{m < n} (n - m) D_m^2, with D the running sums of the
    power series of 1 / c, scaled so that the largest column norm of C,
    sqrt(sum_j c_j^2), is 1 (the accounting's sensitivity). fit() then
    samples examples in b cyclic groups (see the module docstring).

    Args:
        bands: b >= 1; 1 is DP-SGD exactly.
        steps: the number of logical steps the coefficients are optimized
            for (any number of steps is private; only the error depends on
            it). Default 1000.

    Example:
    ```python
    optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                    learning_rate=0.1,
                                    noise_correlation=keras_dp.BandedMF(bands=4))
    ```
    """

    def __init__(self, bands=1, steps=DEFAULT_STEPS):
        for name, value in (("bands", bands), ("steps", steps)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"BandedMF({name}=...) must be an integer >= 1; received "
                                 f"{name}={value!r}.")
        if steps < bands:
            raise ValueError(f"BandedMF(steps={steps}) must be at least bands={bands}.")
        self._bands = int(bands)
        self._steps = int(steps)

    # Read-only: an optimizer built its noise from them, which the sampler,
    # the checks and the ledger read again (review round 94: bands set to 1
    # on an optimizer's BandedMF(4) drew plain Poisson batches, recorded as
    # DP-SGD, while the 4-band noise was added: 19.1 reported against 46.6).
    @property
    def bands(self):
        """b, the number of bands."""
        return self._bands

    @property
    def steps(self):
        """The number of steps the coefficients are optimized for."""
        return self._steps

    @property
    def coefficients(self):
        """c_0 .. c_{b-1}, a tuple of floats with sum of squares 1."""
        return _optimized_coefficients(self.bands, self.steps)

    @property
    def column_norm(self):
        """The largest column norm of C the accountant divides sigma by:
        max(1, sqrt(sum_j c_j^2)), which is 1 for the normalized coefficients
        (a smaller true norm would only add noise)."""
        return max(1.0, math.sqrt(math.fsum(c * c for c in self.coefficients)))

    def privatizer(self):
        """The `keras_dp.noise.Privatizer` of an optimizer with this noise:
        `BandedNoise`, or for b = 1 DP-SGD's `IndependentNoise` (the same
        noise, without a buffer)."""
        return BandedNoise(self) if self.bands > 1 else noise.IndependentNoise()

    def prefix_sum_error(self, steps=None):
        """The objective: total squared noise of the n prefix sums, over
        sigma^2 C^2, at column norm 1 (DP-SGD's is n (n + 1) / 2).

        Args:
            steps: n, default `self.steps`.
        """
        return prefix_sum_error(self.coefficients, steps or self.steps)

    def get_config(self):
        return {"bands": self.bands, "steps": self.steps}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return f"BandedMF(bands={self.bands}, steps={self.steps})"

    def __eq__(self, other):
        return isinstance(other, BandedMF) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash((self.bands, self.steps))


def get(noise_correlation):
    """The `BandedMF` of an optimizer's `noise_correlation` argument: None,
    a `BandedMF` or its serialized config (from a saved optimizer)."""
    if noise_correlation is None or isinstance(noise_correlation, BandedMF):
        return noise_correlation
    if isinstance(noise_correlation, dict):
        return keras.saving.deserialize_keras_object(noise_correlation)
    raise ValueError("noise_correlation must be None or a keras_dp.BandedMF; received "
                     f"noise_correlation={noise_correlation!r}.")


def bands_of(noise_correlation):
    """b of a `BandedMF`, 1 for None (independent noise)."""
    return noise_correlation.bands if noise_correlation else 1


def prefix_sum_error(coefficients, steps):
    """Total squared error of the prefix sums of w = C^-1 z, z ~ N(0, I),
    over `steps` steps, for C scaled to column norm 1: sum_m (n - m) D_m^2,
    D the running sums of the power series of 1 / c. O(n b)."""
    c = np.asarray(coefficients, np.float64)
    impulse = np.zeros(steps)
    impulse[0] = 1.0
    inverse = scipy.signal.lfilter([1.0], c, impulse)  # C^-1's first column.
    running = np.cumsum(inverse)
    return float(np.dot(c, c) * np.dot(np.arange(steps, 0, -1), running * running))


@functools.lru_cache(maxsize=64)
def _optimized_coefficients(bands, steps):
    """c_0 = 1, c_1 .. c_{b-1} by L-BFGS from the truncated square root of
    1 / (1 - x) (the optimal Toeplitz factor of the prefix sums), then
    scaled to column norm 1."""
    if bands == 1:
        return (1.0,)
    start = np.array([math.comb(2 * j, j) / 4.0**j for j in range(1, bands)])
    scale = 1.0 / prefix_sum_error([1.0], steps)  # Puts the objective near 1.

    def objective(tail):
        # An unstable 1 / c overflows: that point is infinitely bad.
        with np.errstate(over="ignore", invalid="ignore"):
            value = scale * prefix_sum_error(np.concatenate([[1.0], tail]), steps)
        return value if math.isfinite(value) else math.inf

    tail = scipy.optimize.minimize(objective, start, method="L-BFGS-B").x
    if not objective(tail) <= objective(start):
        tail = start
    c = np.concatenate([[1.0], tail])
    c /= np.linalg.norm(c)
    while math.fsum(c * c) > 1.0:  # Rounding: keep the column norm at most 1.
        c *= 1.0 - 2.0**-52
    return tuple(float(v) for v in c)


class BandedNoise(noise.Privatizer):
    """The privatizer of a `BandedMF`: DP-SGD's draw z_t, correlated with the
    b - 1 last noises w, which it keeps and never saves.

    Its variables are not the optimizer's (Keras saves those), and this
    plain object is no trackable, so TensorFlow checkpoints do not reach
    them either (as the optimizer's accumulated sums).

    Args:
        correlation: the `BandedMF`, b >= 2.
    """

    def __init__(self, correlation):
        self._correlation = correlation
        coefficients = correlation.coefficients
        self._first = float(coefficients[0])
        self._rest = tuple(float(c) for c in coefficients[1:])

    @property
    def column_norm(self):
        return self._correlation.column_norm

    @property
    def participation_groups(self):
        return self._correlation.bands

    def build(self, variables, zeros):
        # history[j] is w_{t-1-j}.
        self.history = [zeros((len(self._rest),) + tuple(v.shape), v.dtype, "dp_noise_history")
                        for v in variables]
        # The noise std of those steps (0: none yet).
        self.stddev = zeros((), "float32", "dp_noise_history_stddev")

    def noised(self, clipped_sums, stddev, key, block):
        # The same draw z_t as DP-SGD's, correlated with earlier steps'.
        z = noise.add_gaussian_noise([tf.zeros_like(g) for g in clipped_sums], stddev, key, block)
        return [g + w for g, w in zip(clipped_sums, self.correlate(z, stddev))]

    def correlate(self, noises, stddev):
        """w_t from z_t, for each variable (graph code); remembers w_t.

        A step whose noise std differs from the last one's (a new sigma or
        C) starts a segment: were z's std to change within C's band, an
        earlier step's sum would meet rows of less noise than its own
        sigma, which the ledger records.

        Args:
            noises: the step's independent noise z_t, one tensor per variable.
            stddev: the std of z_t (float32 scalar).

        Returns:
            The list of w_t = (z_t - sum_j c_j w_{t-j}) / c_0.
        """
        same_segment = tf.equal(tf.convert_to_tensor(self.stddev), stddev)
        correlated = []
        for z, history in zip(noises, self.history):
            past = tf.where(same_segment, tf.convert_to_tensor(history), 0.0)
            w = (z - tf.tensordot(tf.constant(self._rest, past.dtype), past, 1)) / self._first
            history.assign(tf.concat([w[None], past[:-1]], 0))
            correlated.append(w)
        with tf.control_dependencies(correlated):
            self.stddev.assign(stddev)
        return correlated

    def start_segment(self):
        """Starts a segment: no earlier noise to cancel."""
        for history in self.history + [self.stddev]:
            history.assign(tf.zeros_like(history))


def check_sampling(noise_correlation, info):
    """Refuses, in Python before a step, a step whose batches were not
    drawn by the cyclic Poisson sampling the strategy's accounting needs.

    Args:
        noise_correlation: the optimizer's `BandedMF`, or None.
        info: the `keras_dp.data.SamplingInfo` of fit's batches, or None
            outside fit (train_on_batch).

    Raises:
        ValueError: naming the fix.
    """
    bands = bands_of(noise_correlation)
    groups = info.participation_groups if info is not None else 1
    if bands == 1 and groups == 1:
        return
    if info is None:
        raise ValueError(
            f"A step outside fit() with noise_correlation={noise_correlation!r}: its "
            "batch was not drawn in the cyclic groups the correlated noise is "
            "accounted for. Train with fit() on arrays, or use noise_correlation=None.")
    if groups != bands:  # Only keras-dp's Poisson draws have groups.
        raise ValueError(
            f"noise_correlation={noise_correlation!r} needs batches sampled in {bands} "
            f"cyclic groups (found {groups}, {info.sampling} sampling): fit on in-memory "
            "arrays (keras-dp draws them), or on keras_dp.data.poisson_dataset(..., "
            f"participation_groups={bands}); noise_correlation=None for DP-SGD on "
            "other inputs.")


def batches_in_groups(noise_correlation, sampling_code, steps_per_pass):
    """Whether a step's batch was drawn as the noise's accounting needs, in
    the traced step (bool tensor): always for independent noise; for b > 1
    bands, cyclic Poisson batches of b groups (the ledger row's sampling
    code and steps per pass; anything else a full release the banded
    accounting does not cover).
    """
    bands = bands_of(noise_correlation)
    if bands == 1:
        return tf.constant(True)
    return tf.logical_and(
        tf.equal(sampling_code, sampling_schemes.CyclicPoissonSampling.code),
        tf.equal(steps_per_pass, float(bands)))


def check_steps_per_epoch(noise_correlation, steps_per_epoch, accumulation_steps):
    """Refuses a fit whose epochs could cut a cycle of the b groups.

    Were an epoch to end mid-cycle and the next restart the dataset at
    group 0, an example could join two steps less than b apart within one
    segment, whose banded columns overlap.

    Args:
        noise_correlation: the optimizer's `BandedMF`, or None.
        steps_per_epoch: fit's `steps_per_epoch` (physical batches), or None.
        accumulation_steps: physical batches per logical step.

    Raises:
        ValueError: naming the fix.
    """
    cycle = bands_of(noise_correlation) * accumulation_steps
    if bands_of(noise_correlation) > 1 and steps_per_epoch and steps_per_epoch % cycle:
        raise ValueError(
            f"steps_per_epoch={steps_per_epoch} would end an epoch inside a cycle of the "
            f"{bands_of(noise_correlation)} groups of noise_correlation={noise_correlation!r} "
            f"({cycle} batches with accumulation). Give a multiple of {cycle}, or leave "
            "steps_per_epoch out.")


def check_clipping(noise_correlation, adaptive_clipping):
    """Refuses adaptive clipping with correlated noise: C would change every
    step, and each change of the noise std starts a segment of the strategy
    (`BandedNoise.correlate`), so no noise would ever be cancelled.

    Raises:
        ValueError: naming the fix.
    """
    if bands_of(noise_correlation) > 1 and adaptive_clipping:
        raise ValueError(
            f"noise_correlation={noise_correlation!r} needs one noise std over its bands, "
            "but AdaptiveClipping changes C every step. Give a number as l2_norm_clip, "
            "or use noise_correlation=None.")
