"""The mechanism of a private model's steps: one owner, fixed once per logical step.

What defines the privacy of one logical step is: the clipping norm C (one,
or one per layer) and its rule, the noise multiplier sigma (and, under
adaptive clipping, the split of it between the gradient and the count),
how its batches were drawn (the ledger's sampling row: Poisson with q,
shuffled passes, or unknown), the sensitivity, the divisor of the noisy
sum, the accumulation of physical batches, and the noise block. A private
model's `StepMechanism` owns all of them:

* the settings come from their owners' public API (C and sigma from the DP
  optimizer's setters or its adaptive update, the sampling from fit or
  train_on_batch through `StepMechanism.sampling`), and take effect at the
  next logical step;
* at the start of each logical step the train step calls `fix`, which reads
  them once into a `FixedStep` (held by the optimizer over the physical
  batches of an accumulated step); the clipping, the noise and the ledger's
  record of that step all read that one snapshot, so a change in the middle
  of an accumulated step (a callback, a setter, train_on_batch) cannot give
  one logical step two mechanisms;
* the record, the noise and the update are one unit (`FixedStep.record`):
  the noise block is the ledger's counter, advanced by the same op that
  records the step, and the update waits for both.

In Python, before a step runs, `check_next_step` refuses what the ledger
could not record, and `next_segment` tells the budget what the next step
would cost.
"""

import contextlib
import dataclasses
import math

import numpy as np
import tensorflow as tf

from keras_dp import correlated_noise
from keras_dp import ledger


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the batches of the coming steps are drawn.

    Args:
        row: the sampling part of the ledger's row (`ledger.mechanism`).
        expected_batch_size: expected units (examples, or users for
            user-level sampling) per physical batch over all replicas, the
            divisor of the noisy sum (Poisson batches); 0 to divide by the
            realised batch (fixed-size batches).
        info: the `keras_dp.data.SamplingInfo` of fit's batches, or None
            outside fit.
    """

    row: tuple
    expected_batch_size: float = 0.0
    info: object = None

    @classmethod
    def of_fit(cls, info, accumulation_steps):
        """The sampling of a fit whose batches are drawn as `info` says."""
        expected = info.batch_size / info.accumulation_steps if info.draws_batch_size else 0.0
        return cls(tuple(ledger.sampling_mechanism(info, accumulation_steps)),
                   expected, info)


# Outside fit nothing is known of how a batch was chosen: every step is a
# full Gaussian release, divided by its own batch size.
OUTSIDE_FIT = Sampling(tuple(ledger.UNKNOWN_SAMPLING))

# The positions in the vector `fix` holds over a logical step: sigma, the
# count's multiplier z (0 without adaptive clipping), the expected physical
# batch, the sampling row, then the G clipping norms.
_SIGMA, _COUNT, _EXPECTED, _ROW = 0, 1, 2, 3
_CLIPS = _ROW + len(ledger.FIELDS)


def sensitivity(num_microbatches, batch_size, accumulation_steps=1):
    """How far one example moves a step's clipped sum, in multiples of C.

    1 when each microbatch holds one example (`num_microbatches` None, or
    equal to the physical batch size). Otherwise 2: adding or removing one
    example in a microbatch of two or more changes its clipped mean
    gradient by up to 2C. With gradient accumulation the physical batches of
    one step may differ in size, so microbatches there count as 2.

    Args:
        num_microbatches: the optimizer's `num_microbatches` (None or int).
        batch_size: physical batch size: int, int tensor or None (unknown).
        accumulation_steps: the optimizer's gradient accumulation steps.

    Returns:
        1.0 or 2.0 (a float64 tensor when `batch_size` is a tensor).
    """
    if num_microbatches is None:
        return 1.0
    if accumulation_steps > 1 or batch_size is None:
        return 2.0
    if isinstance(batch_size, (int, np.integer)):
        return 1.0 if batch_size == num_microbatches else 2.0
    return tf.where(tf.equal(tf.cast(batch_size, tf.int64), num_microbatches),
                    tf.constant(1.0, tf.float64), tf.constant(2.0, tf.float64))


def held_size(num_clip_norms):
    """The length of the vector `fix` holds, for G clipping norms."""
    return _CLIPS + num_clip_norms


class FixedStep:
    """The mechanism of one logical step, fixed at its start (graph values).

    Args:
        values: the float64 vector `StepMechanism.fix` held.
        privacy_ledger: the ledger that records the step.
        sensitivity: the step's sensitivity in multiples of C (a float or
            a float64 tensor).
        num_weights: the number of weights the noise covers.
        optimizer: the DP optimizer, whose rule bounds each example with the
            held norms (`clipping_bound`).
        variables: the trainable variables.
    """

    def __init__(self, values, privacy_ledger, sensitivity, num_weights, optimizer,
                 variables):
        self._values = values
        self._ledger = privacy_ledger
        # The ledger records sigma: under adaptive clipping the pair
        # (gradient sum, count) is worth one Gaussian of that multiplier;
        # correlated noise divides it by its strategy's largest column norm.
        self._row = ledger.full_row_in_graph(values[_ROW:_CLIPS],
                                    values[_SIGMA] / optimizer.noise_column_norm,
                                    sensitivity, num_weights)
        self.bound = optimizer.clipping_bound(values[_CLIPS:], variables)

    @property
    def l2_norm_clip(self):
        """C, as float32: sqrt(sum_l C_l^2) under per-layer clipping, the
        norm bounding every example's whole contribution."""
        return tf.cast(self._total_clip(), tf.float32)

    def _total_clip(self):
        return tf.norm(self._values[_CLIPS:])

    @property
    def noise_stddev(self):
        """sigma_g * C, the noise std on the clipped sum, as float32: sigma_g
        is sigma, or (sigma^-2 - z^-2)^(-1/2) beside adaptive clipping's count
        of multiplier z (infinite if z <= sigma, which Python refuses first)."""
        sigma, z = self._values[_SIGMA], self._values[_COUNT]
        raised = tf.where(z > sigma, sigma * z / tf.sqrt(tf.maximum(z * z - sigma * sigma, 0.0)),
                          tf.constant(float("inf"), tf.float64))
        sigma_g = tf.where(z > 0, raised, sigma)
        return tf.cast(sigma_g * self._total_clip(), tf.float32)

    @property
    def count_noise_stddev(self):
        """z / 2, the noise std on adaptive clipping's count (sensitivity 1/2)."""
        return tf.cast(self._values[_COUNT] / 2.0, tf.float32)

    def divisor(self, realised_microbatches, microbatch_size):
        """What the noisy sum of one physical batch is divided by: its
        expected number of microbatches over all replicas (Poisson), or
        the realised one (fixed-size batches)."""
        expected = tf.cast(self._values[_EXPECTED], tf.float32)
        return tf.where(expected > 0, expected / tf.cast(microbatch_size, tf.float32),
                        tf.cast(realised_microbatches, tf.float32))

    def record(self, clipped_sums):
        """Records the step in the ledger once its clipped sums exist.

        Returns:
            `(noise_block, recorded)`: the block of the noise stream the
            step draws (the ledger's counter before it) and the op that
            recorded it, which the update must wait for.
        """
        # The block depends on the counter alone, so the noise is drawn beside
        # the forward and backward passes; the record waits for the sums.
        block = self._ledger.next_block()
        with tf.control_dependencies(clipped_sums):
            return block, self._ledger.record_step(self._row)


class StepMechanism:
    """Owns what defines each private step of one private model.

    Args:
        model: the private model.
    """

    def __init__(self, model):
        self._model = model
        self._stack = [OUTSIDE_FIT]
        # The ledger the traced step records into.
        self._traced_ledger = None
        # The rows per unit the traced step groups (static in the graph).
        self._traced_rows_per_unit = None
        # The sampling in use, read by the traced step (a change needs no retrace).
        self._assigned = self._settings(OUTSIDE_FIT)
        self._pending = tf.Variable(self._assigned, dtype=tf.float64,
                                    trainable=False, name="privacy_mechanism_sampling")
        # Whether the last fit ended inside an accumulated logical step (and
        # no train_on_batch ran since): what a refused next fit names.
        self.fit_stopped_mid_step = False

    @property
    def variables(self):
        """The variables the traced step reads (not saved: set per fit)."""
        return [self._pending]

    @property
    def sampling(self):
        """The `Sampling` of the coming steps."""
        return self._stack[-1]

    @property
    def rows_per_unit(self):
        """k: the consecutive rows of a batch that are one unit (user) of
        the coming steps; 1 when each row is its own unit."""
        info = self.sampling.info
        return info.rows_per_unit if info else 1

    def trace_rows_per_unit(self):
        """`rows_per_unit`, read by the step being traced (a static value:
        `check_next_step` retraces when it changes)."""
        self._traced_rows_per_unit = self.rows_per_unit
        return self._traced_rows_per_unit

    @property
    def in_fit(self):
        """Whether a fit() of the model is running."""
        return len(self._stack) > 1

    @contextlib.contextmanager
    def using(self, sampling):
        """The steps taken inside draw their batches as `sampling` says
        (nested: a train_on_batch inside fit uses its own, then fit's again)."""
        self._stack.append(sampling)
        self._assign(sampling)
        try:
            yield
        finally:
            self._stack.pop()
            self._assign(self.sampling)

    def _assign(self, sampling):
        settings = self._settings(sampling)
        if settings != self._assigned:  # A train_on_batch loop assigns nothing.
            self._pending.assign(settings)
            self._assigned = settings

    def _settings(self, sampling):
        return [0.0, 0.0, float(sampling.expected_batch_size)] + [float(v) for v in sampling.row]

    # -- In the train step.

    def fix(self, batch_size):
        """The mechanism of the logical step this physical batch belongs to.

        Args:
            batch_size: this replica's physical batch size (an int tensor).

        Returns:
            A `FixedStep`, read at the logical step's first physical batch.
        """
        optimizer = self._model.optimizer
        variables = self._model.trainable_variables
        clips, sigma = optimizer.privacy_settings()
        sampling = tf.convert_to_tensor(self._pending)[_EXPECTED:_CLIPS]
        count = optimizer.count_noise_multiplier(self._expected_count(sampling[0], batch_size))
        settings = tf.concat([tf.stack([sigma, count]), sampling, clips], 0)
        held = optimizer.held_over_logical_step(settings, variables)
        self._traced_ledger = self._model.privacy_ledger
        return FixedStep(held, self._traced_ledger, self._sensitivity(batch_size),
                         self._num_weights(), optimizer, variables)

    def _expected_count(self, expected, batch_size):
        """Expected examples of a logical step (Poisson), else the realised
        ones of fixed-size batches (the same on every replica)."""
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context else 1
        realised = tf.cast(batch_size * replicas, tf.float64)
        steps = self._model.optimizer.dp_settings.accumulation_steps
        return tf.where(expected > 0, expected, realised) * steps

    def padded(self):
        """Whether the batches hold padding rows (sample weight 0), as a bool tensor."""
        return tf.convert_to_tensor(self._pending)[_EXPECTED] > 0

    # -- In Python.

    def next_segment(self):
        """What the next step would record: a `ledger.Segment` of 0 steps."""
        info = self.sampling.info
        batch_size = info and (info.physical_batch_size or info.batch_size)
        if batch_size:
            batch_size //= info.num_replicas  # One replica's, as the step records it.
        optimizer = self._model.optimizer
        row = ledger.full_row(self.sampling.row,
                              optimizer.noise_multiplier / optimizer.noise_column_norm,
                              self._sensitivity(batch_size), self._num_weights())
        return ledger.segment_of_row(row)

    def check_next_step(self):
        """Refuses, before it runs, a step the ledger could not record.

        Raises:
            ValueError: the ledger is full and the step needs a new segment,
                the step's unit (example or user) or users differ from the
                recorded steps' (`ledger.PrivacyLedger.check_unit`), or
                correlated noise on batches it was not accounted for.
        """
        privacy_ledger = self._model.privacy_ledger
        if self._traced_ledger is not None and self._traced_ledger is not privacy_ledger:
            # The variables' ledger changed (composed with another's): the
            # step traced for the old one must record into the new one.
            self._model.train_function = None
            self._traced_ledger = None
        if self._traced_rows_per_unit not in (None, self.rows_per_unit):
            self._model.train_function = None  # Traced for units of other rows.
            self._traced_rows_per_unit = None
        info = self.sampling.info
        correlated_noise.check_sampling(self._model.optimizer.dp_settings.noise_correlation, info)
        privacy_ledger.check_unit(self.next_segment(), info and info.users_digest)
        privacy_ledger.check_room(lambda: self.next_segment().row())
        self._model.optimizer.check_adaptive_noise(info and info.batch_size)

    def _sensitivity(self, batch_size):
        optimizer = self._model.optimizer
        return sensitivity(optimizer.dp_settings.num_microbatches, batch_size,
                           optimizer.dp_settings.accumulation_steps)

    def _num_weights(self):
        return sum(math.prod(v.shape) for v in self._model.trainable_variables)
