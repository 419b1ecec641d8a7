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
import enum
import inspect
import itertools
import math
import sys
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_dp import correlated_noise
from keras_dp import distribute
from keras_dp import ledger
from keras_dp import noise
from keras_dp import sampling_schemes
from keras_dp.clipping.contributions import MAX_CANCELLATION


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
        layout: the optimizer's `(gradient_accumulation_steps,
            num_microbatches or 0)` that fit's batches and this row were
            laid out for, or `(0, 0)` outside fit (batches that promise no
            layout).
    """

    row: tuple
    expected_batch_size: float = 0.0
    info: object = None
    layout: tuple = (0, 0)

    @property
    def rows_per_unit(self):
        """k: the consecutive rows of a batch that are one unit (user); 1
        when each row is its own unit."""
        return self.info.rows_per_unit if self.info else 1

    @classmethod
    def of_fit(cls, info, settings):
        """The sampling of a fit whose batches are drawn as `info` says, for
        an optimizer of DP `settings` (`DPSettings`)."""
        expected = info.batch_size / info.accumulation_steps if info.draws_batch_size else 0.0
        steps, microbatches = layout_of(settings)
        # Only keras-dp's draws put each example in a random microbatch
        # (review round 151: shuffled batches claimed the layout, 3 C moved).
        return cls(tuple(ledger.sampling_mechanism(info, settings.accumulation_steps)),
                   expected, info, (steps, microbatches if info.draws_batch_size else 0))


def layout_of(settings):
    """`Sampling.layout` of an optimizer's DP `settings`."""
    return (settings.accumulation_steps, settings.num_microbatches or 0)


# Outside fit nothing is known of how a batch was chosen: every step is a
# full Gaussian release, divided by its own batch size.
OUTSIDE_FIT = Sampling(tuple(ledger.UNKNOWN_SAMPLING))

# The positions in the vector `fix` holds over a logical step: sigma, the
# count's multiplier z (0 without adaptive clipping), the entry point that
# opened the step, the expected physical batch, the rows per unit, the
# layout the batches were laid out for (`Sampling.layout`), the sampling
# row, then the G clipping norms.
_SIGMA, _COUNT, _OPENER, _EXPECTED, _UNIT_ROWS, _LAYOUT, _ROW = 0, 1, 2, 3, 4, 5, 7
_CLIPS = _ROW + len(ledger.FIELDS)
# The opener of steps outside fit (train_on_batch, and custom loops calling
# train_step): they may continue each other's accumulated steps, all
# accounted as full releases of sensitivity k C. The opener of a step that
# cannot be an entry point's: a train_step called directly while a fit runs.
_OUTSIDE_OPENER, _NO_OPENER = 0.0, -1.0
# The code of Keras' fit, whose loop alone makes fit's steps (`entered`).
_FIT_LOOP = inspect.unwrap(keras.Model.fit).__code__
# Frames between Keras' fit and the private fit that calls it (its wrappers).
_WRAPPERS = 3

# The other openers, one per entry point in the process: an open logical
# step lives on the optimizer, which models sharing layers may share, so a
# number per model let another model's fit join it (review round 43: 2 C
# recorded C, 4.73 reported against 10.7).
_ENTRY_POINTS = itertools.count(1)


def _made_by_fit(caller, fit_frame):
    """Whether `caller`, the frame calling the train function, is Keras' fit
    as the private model's fit (`fit_frame`) called it, through Keras'
    wrappers: not Keras' fit called by a callback on batches it chose with
    the running fit's permit (review round 122: 40 such batches recorded as
    Poisson steps, 1.13 reported against 48.8)."""
    if caller.f_code is not _FIT_LOOP:
        return False
    frame = caller.f_back
    for _ in range(_WRAPPERS):
        if frame is None or frame.f_code is _FIT_LOOP:
            return False
        if frame is fit_frame:
            return True
        frame = frame.f_back
    return False


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


class Refusal(enum.IntEnum):
    """Why a traced step applied nothing (`FixedStep.refusal`; 0: it applied).

    The step checks these itself, by data flow, on every path (fit,
    train_on_batch, a custom loop calling train_step, XLA): a step that
    cannot vouch for its mechanism records nothing, draws no noise and
    leaves the weights, the optimizer and the ledger as they were.
    """

    NONE = 0
    OTHER_ENTRY = 1
    UNCORRELATED_BATCHES = 2
    NO_GRADIENT_NOISE = 3
    JOINED_LEDGER = 4
    OTHER_UNIT = 5
    UNEVEN_ROWS = 6
    OTHER_LAYOUT = 7
    NOISE_OUT_OF_RANGE = 8
    SPLIT_MICROBATCHES = 9
    UNCHECKED_BY_BUDGET = 10

    @property
    def message(self):
        """What happened and what to do, for an error or a warning."""
        return _REFUSAL_MESSAGES[self]


_REFUSAL_MESSAGES = {
    Refusal.NONE: "The step was applied.",
    Refusal.OTHER_ENTRY: (
        "A train_step was called while another entry point's accumulated logical "
        "step was open, or directly while fit() ran with gradient accumulation, or "
        "fit's batch was the middle of a draw whose logical step had been aborted "
        "(optimizer.abort_logical_step() during the fit): it would have joined, or "
        "opened, a logical step whose batches it does not belong with. Call "
        "train_step (or train_on_batch) between fits, finish or abort "
        "(optimizer.abort_logical_step()) a logical step before starting another, "
        "and stop a fit with model.stop_training = True (it aborts its open step "
        "itself)."),
    Refusal.UNCORRELATED_BATCHES: (
        "The optimizer's noise_correlation needs batches drawn by keras-dp in its "
        "cyclic groups, and this batch was not (train_on_batch, a custom loop, or a "
        "dataset keras-dp did not sample). Train with fit() on arrays or on "
        "keras_dp.data.poisson_dataset(..., participation_groups=bands), or use "
        "noise_correlation=None."),
    Refusal.NO_GRADIENT_NOISE: (
        "AdaptiveClipping's count noise multiplier (a tenth of this step's examples) "
        "did not exceed noise_multiplier, which would leave the gradient infinite "
        "noise. Use larger batches, drop the last small batch, or set "
        "AdaptiveClipping(count_noise_multiplier=...) above noise_multiplier."),
    Refusal.JOINED_LEDGER: (
        "This traced step records into the privacy ledger its variables had before "
        "they were joined with another private model's (an ensemble, or a larger "
        "model around both), whose ledger now holds both histories. Trace the step "
        "again: a new tf.function around train_step (fit and train_on_batch retrace "
        "by themselves)."),
    Refusal.OTHER_UNIT: (
        "This traced step clips units of another number of rows than the batches its "
        "ledger row describes (a tf.function around train_step traced during a "
        "user-level fit and called outside it, or the reverse), or its unit (example "
        "or user) differs from the steps the privacy ledger holds. Trace the step "
        "again (a new tf.function around train_step) for the batches it is given; "
        "train a fresh model for privacy of another unit."),
    Refusal.UNEVEN_ROWS: (
        "The parts of this batch (inputs, labels, sample weights), or the model's "
        "outputs, do not all have the batch's number of rows: a part of fewer rows "
        "would be broadcast over the examples, one row reaching every example's "
        "gradient, and an output of more rows made one example rows of its own. "
        "Give every part one row per example, and shape every tensor of the model "
        "that meets the batch from the batch itself."),
    Refusal.OTHER_LAYOUT: (
        "The optimizer in use accumulates or splits batches differently "
        "(gradient_accumulation_steps, num_microbatches) from the one this fit's "
        "batches and accounting were laid out for (compiled again during the fit, "
        "e.g. by a callback): its logical steps would join batches drawn "
        "separately, one example in several. Compile the optimizer before fit, "
        "and fit again after compiling."),
    Refusal.NOISE_OUT_OF_RANGE: (
        "The noise's standard deviation, noise_multiplier times l2_norm_clip, is "
        "outside float32's normal range (about 1.2e-38 to 3.4e38), where the noise "
        "could not be drawn at its scale (it would round to 0 or overflow), or the "
        "step's sum of clipped gradients (l2_norm_clip times its examples, times "
        "1024 for the terms ghost clipping adds before they cancel) or its noise "
        "could pass half of float32's largest number and overflow. Rescale "
        "the loss so that an l2_norm_clip near 1 fits the gradients; under "
        "AdaptiveClipping (whose C follows the gradient norms, by steps its "
        "learning_rate sets), rescale the loss, lower its learning_rate, or use "
        "a fixed l2_norm_clip."),
    Refusal.SPLIT_MICROBATCHES: (
        "num_microbatches groups the rows of a batch keras-dp did not lay out "
        "(train_on_batch, fit with sampling='shuffle' or on batches you made, a custom "
        "loop) by their place in it, and in the replicas' shares under a strategy: one "
        "example added moves every row after it into the next group (in place of a "
        "padding row of weight 0), changing several clipped microbatch means, not "
        "one. Use num_microbatches=None (each example clipped alone, the default), or "
        "fit on arrays or a keras_dp.data.poisson_dataset, whose batches keras-dp lays "
        "out with each example in a random group."),
    Refusal.UNCHECKED_BY_BUDGET: (
        "A fit with PrivacyCallback(target_epsilon=...) runs on these weights, and "
        "this step is not one its budget check allowed: a train_step called directly "
        "(a custom loop, from a callback or from the data) is never checked, and a "
        "noise_multiplier changed while an execution of steps_per_execution batches "
        "runs (from a PyDataset, a map or another thread) would record steps the "
        "check before it did not price. Call train_on_batch (checked before its step) while "
        "such a fit runs, and change noise_multiplier between executions (in a "
        "callback's on_train_batch_begin or on_epoch_end; under "
        "gradient_accumulation_steps, where no logical step is open: on_epoch_end) or "
        "between fits."),
}


class FixedStep:
    """The mechanism of one logical step, fixed at its start (graph values).

    Args:
        values: the float64 vector `StepMechanism.fix` held.
        rows_per_unit: the consecutive rows the traced step clips as one
            unit (a Python int, static in the graph).
        admitted: whether this physical batch may open or join the logical
            step (a bool tensor; see `StepMechanism._entry`).
        even_rows: whether every part of the batch has its number of rows
            (a bool tensor).
        summed_rows: the most rows the logical step's clipped sum adds, each
            at most C (an int tensor).
        privacy_ledger: the ledger that records the step.
        sensitivity: the step's sensitivity in multiples of C for batches
            keras-dp drew (a float or a float64 tensor); batches it did not
            draw may hold an example in each of the k physical batches of an
            accumulated step, so theirs is k times that.
        num_weights: the number of weights the noise covers.
        optimizer: the DP optimizer, whose rule bounds each example with the
            held norms (`clipping_bound`).
        variables: the trainable variables.
    """

    def __init__(self, values, rows_per_unit, admitted, even_rows, summed_rows, privacy_ledger,
                 sensitivity, num_weights, optimizer, variables):
        # Each scalar read once, by one op (a slice each is four ops).
        self._held = tf.unstack(values[:_CLIPS], num=_CLIPS)
        self._sampling_row = values[_ROW:_CLIPS]
        self._clips = values[_CLIPS:]
        self._total_clip = tf.norm(self._clips)
        self.rows_per_unit = rows_per_unit
        self._ledger = privacy_ledger
        sampling = self._row_value("sampling")
        steps = optimizer.dp_settings.accumulation_steps
        grouped = tf.cast(sensitivity, tf.float64) > 1.0  # Microbatches of several rows.
        sensitivity = tf.cast(sensitivity, tf.float64) * tf.where(
            tf.equal(sampling, sampling_schemes.UnknownBatches.code),
            tf.constant(float(steps), tf.float64), 1.0)
        # The ledger records sigma: under adaptive clipping the pair
        # (gradient sum, count) is worth one Gaussian of that multiplier;
        # correlated noise divides it by its strategy's largest column norm.
        self._row = ledger.full_row_in_graph(self._sampling_row,
                                    self._held[_SIGMA] / optimizer.noise_column_norm,
                                    sensitivity, num_weights)
        self.bound = optimizer.clipping_bound(self._clips, variables)
        self.noise_stddev = self._gradient_noise_stddev()
        self._summed_rows = tf.cast(summed_rows, tf.float64)
        self.refusal = self._refusal(admitted, even_rows, grouped, optimizer)

    def also_requires(self, holds, reason):
        """Refuses the step with `reason` unless `holds` (a bool tensor, the
        same on every replica) that the clipping computes after the snapshot;
        an earlier refusal stands."""
        self.refusal = tf.where(tf.logical_or(holds, tf.not_equal(self.refusal, int(Refusal.NONE))),
                                self.refusal, tf.constant(int(reason), tf.int32))

    def _row_value(self, field):
        """The sampling row's `field` (a float64 scalar tensor)."""
        return self._held[_ROW + ledger.COLUMN[field]]

    def _refusal(self, admitted, even_rows, grouped, optimizer):
        """The first `Refusal` that holds for this step (an int32 tensor)."""
        sigma, z = self._held[_SIGMA], self._held[_COUNT]
        correlated = correlated_noise.batches_in_groups(
            optimizer.dp_settings.noise_correlation,
            self._row_value("sampling"), self._row_value("steps_per_pass"))
        # The grouping was traced; the unit the ledger records is data: they
        # must agree, and the ledger must hold steps of that unit alone.
        same_unit = tf.logical_and(
            tf.equal(self._held[_UNIT_ROWS], float(self.rows_per_unit)),
            self._ledger.holds_only_unit(self._row_value("unit")))
        checks = [(self._ledger.in_use(), Refusal.JOINED_LEDGER),
                  (admitted, Refusal.OTHER_ENTRY),
                  (even_rows, Refusal.UNEVEN_ROWS),
                  (tf.logical_or(tf.logical_not(grouped), self._held[_LAYOUT + 1] > 0.0),
                   Refusal.SPLIT_MICROBATCHES),
                  (self._laid_out_for(optimizer), Refusal.OTHER_LAYOUT),
                  (same_unit, Refusal.OTHER_UNIT),
                  (correlated, Refusal.UNCORRELATED_BATCHES),
                  (tf.logical_or(tf.equal(z, 0.0), z > sigma), Refusal.NO_GRADIENT_NOISE),
                  (self._noise_in_range(), Refusal.NOISE_OUT_OF_RANGE),
                  (self._ledger.permits(self._held[_OPENER], self._row,
                                        optimizer.closes_logical_step()),
                   Refusal.UNCHECKED_BY_BUDGET)]
        refusal = tf.constant(int(Refusal.NONE), tf.int32)
        for holds, reason in reversed(checks):
            refusal = tf.where(holds, refusal, tf.constant(int(reason), tf.int32))
        return refusal

    def _laid_out_for(self, optimizer):
        """Whether the batches were laid out for the traced optimizer's
        accumulation and microbatches, or promise no layout (a bool tensor;
        review round 37: a callback compiling k = 4 into a fit drawn for
        k = 1 joined 4 Poisson draws in a step recorded as one, 4 C)."""
        steps, microbatches = self._held[_LAYOUT], self._held[_LAYOUT + 1]
        traced_steps, traced_microbatches = layout_of(optimizer.dp_settings)
        return tf.logical_or(tf.equal(steps, 0.0), tf.logical_and(
            tf.equal(steps, float(traced_steps)),
            tf.equal(microbatches, float(traced_microbatches))))

    def _noise_in_range(self):
        """Whether the noise std is a normal float32 (or sigma is 0: no
        noise, stated), and the clipped sum and the noise each stay within
        half of float32's largest number: a smaller std loses its scale in
        the draws (review round 39: C = 1e-25 drew none, 4.70 reported), a
        sum that overflows is inf with one example and finite without (a
        huge C, as review round 76 found through normalization's scale)."""
        std, limits = self.noise_stddev, np.finfo(np.float32)
        half = float(limits.max) / 2.0
        # Ghost clipping's terms of one example total up to MAX_CANCELLATION C
        # before they cancel (review round 78: C = 1e37, its float32 matmul
        # overflowed to NaN with one example and not without).
        sum_fits = self._total_clip * self._summed_rows * MAX_CANCELLATION <= half
        noise_fits = tf.logical_and(std >= limits.tiny, std <= half / noise.MAX_NOISE_STDDEVS)
        return tf.logical_and(sum_fits, tf.logical_or(
            tf.equal(self._held[_SIGMA], 0.0), noise_fits))

    @property
    def vouched(self):
        """Whether the step may be applied (a bool tensor): no `Refusal`."""
        return tf.equal(self.refusal, int(Refusal.NONE))

    @property
    def l2_norm_clip(self):
        """C, as float32: sqrt(sum_l C_l^2) under per-layer clipping, the
        norm bounding every example's whole contribution."""
        return tf.cast(self._total_clip, tf.float32)

    def _gradient_noise_stddev(self):
        """sigma_g * C, the noise std on the clipped sum, as float32: sigma_g
        is sigma, or (sigma^-2 - z^-2)^(-1/2) beside adaptive clipping's count
        of multiplier z (infinite if z <= sigma: such a step is refused,
        `Refusal.NO_GRADIENT_NOISE`)."""
        sigma, z = self._held[_SIGMA], self._held[_COUNT]
        raised = tf.where(z > sigma, sigma * z / tf.sqrt(tf.maximum(z * z - sigma * sigma, 0.0)),
                          tf.constant(float("inf"), tf.float64))
        sigma_g = tf.where(z > 0, raised, sigma)
        return tf.cast(sigma_g * self._total_clip, tf.float32)

    @property
    def count_noise_stddev(self):
        """z / 2, the noise std on adaptive clipping's count (sensitivity 1/2)."""
        return tf.cast(self._held[_COUNT] / 2.0, tf.float32)

    def divisor(self, realised_microbatches, microbatch_size):
        """What the noisy sum of one physical batch is divided by: its
        expected number of microbatches over all replicas (Poisson), or
        the realised one (fixed-size batches)."""
        expected = tf.cast(self._held[_EXPECTED], tf.float32)
        return tf.where(expected > 0, expected / tf.cast(microbatch_size, tf.float32),
                        tf.cast(realised_microbatches, tf.float32))

    @property
    def noise_stream(self):
        """The id of the ledger the step records into (a Python int): with
        its counter, which numbers that ledger's steps, it picks the step's
        noise (`DPOptimizer.privatize`)."""
        return self._ledger.history

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


def _smallest_batch(info):
    """The fewest examples a logical step of fit's batches is expected to
    hold: B, or the last short batch of fixed-size ones (None outside fit)."""
    if info is None:
        return None
    remainder = info.num_examples and not info.draws_batch_size and (
        info.num_examples % info.batch_size)
    return remainder or info.batch_size


class StepMechanism:
    """Owns what defines each private step of one private model.

    Args:
        model: the private model.
    """

    def __init__(self, model):
        self._model = model
        self._stack = [(OUTSIDE_FIT, _OUTSIDE_OPENER)]
        # The thread whose entry points are under way (None: none is).
        self._thread = None
        # The gated entry points (fits) under way: {opener: the frame of the
        # private fit that opened it}.
        self._gated = {}
        # The ledger the traced step records into.
        self._traced_ledger = None
        # The rows per unit the traced step groups (static in the graph).
        self._traced_rows_per_unit = None
        # The sampling in use and its entry point, read by the traced step
        # (a change needs no retrace).
        self._assigned = self._settings(OUTSIDE_FIT, _OUTSIDE_OPENER)
        self._pending = tf.Variable(self._assigned, dtype=tf.float64,
                                    trainable=False, name="privacy_mechanism_sampling")
        # The entry point whose train function is running (`entered`), so
        # that a train_step called from anywhere else cannot take its sampling.
        self._calling = tf.Variable(_NO_OPENER, dtype=tf.float64, trainable=False,
                                    name="privacy_mechanism_caller")
        # The fit whose train function may run once now (`permit_fit_step`):
        # fit's own loop calls it right after its callbacks' batch-begin
        # hooks; any other call of it while fit runs is a stranger's.
        self._permitted = None
        # The physical batches the current entry point's steps ran: fit's open
        # a logical step only at the first of a draw's (`_entry`).
        self._position = tf.Variable(
            tf.constant(0, tf.int64), trainable=False, name="privacy_mechanism_position",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Steps refused since the last `take_refusals`, by `Refusal`.
        self._refused = tf.Variable(
            tf.zeros([len(Refusal)], tf.int64), trainable=False, name="privacy_refused_steps",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    @property
    def variables(self):
        """The variables the traced step reads (not saved: set per fit)."""
        return [self._pending, self._calling, self._position, self._refused]

    @property
    def sampling(self):
        """The `Sampling` of the coming steps."""
        return self._stack[-1][0]

    @property
    def rows_per_unit(self):
        """k: the consecutive rows of a batch that are one unit (user) of
        the coming steps; 1 when each row is its own unit."""
        return self.sampling.rows_per_unit

    @property
    def in_fit(self):
        """Whether a fit() of the model is running."""
        return len(self._stack) > 1

    @contextlib.contextmanager
    def using(self, sampling, gated=None):
        """The steps taken inside by the model's train function draw their
        batches as `sampling` says (nested: a train_on_batch inside fit uses
        its own, then fit's again).

        The block is an entry point: a logical step opened inside is its
        own, which no other entry point can join. Steps outside fit (a
        train_on_batch loop, a custom loop) share one. `gated` (fit's: the
        frame of the private model's fit that calls Keras' fit): its train
        function is this entry point's only when `permit_fit_step` allowed
        the call and that Keras fit makes it.
        """
        self._check_same_thread()
        with self._model.privacy_ledger.training_thread(), self._entry_point(sampling, gated):
            yield

    @contextlib.contextmanager
    def _entry_point(self, sampling, gated):
        shared = sampling.info is None and not self.in_fit
        opener = _OUTSIDE_OPENER if shared else float(next(_ENTRY_POINTS))
        if len(self._stack) == 1:
            self._thread = threading.get_ident()
        self._stack.append((sampling, opener))
        self._assign(*self._stack[-1])
        # Only an entry point whose batches are laid out in draws counts them
        # (`_at_draw_start`); the others leave the count alone, and spare a
        # train_on_batch three eager variable operations (0.3 of its 4 ms).
        counts = sampling.layout[0] > 0
        outer_position = self._position.numpy() if counts else None
        if counts:
            self._position.assign(0)
        if gated is not None:
            self._gated[self._assigned[_OPENER]] = gated
        try:
            yield
        finally:
            self._gated.pop(self._stack.pop()[1], None)
            self._assign(*self._stack[-1])
            if counts:
                self._position.assign(outer_position)
            if len(self._stack) == 1:
                self._thread = None

    def _check_same_thread(self):
        """Refuses an entry point, or a call of the train function, from
        another thread while one trains the model: the sampling and the
        permit of fit's steps are the model's, one at a time (review round
        48: two fits in two threads recorded each other's sampling, 3.90
        reported against 7.41)."""
        if self._thread not in (None, threading.get_ident()):
            raise ValueError(
                "This model is training in another thread (fit or train_on_batch): its "
                "entry points take turns, one thread at a time. Wait for that training "
                "to end, or train another model.")

    def entered(self, train_function):
        """`train_function` (Keras' compiled steps) as the current entry
        point's: while it runs, its steps take the entry point's sampling;
        a train_step called at any other time (a custom loop, also from a
        callback during fit) is outside every entry point."""
        def run_as_entry(*args, **kwargs):
            self._check_same_thread()
            opener = self._assigned[_OPENER]
            in_fit = opener in self._gated
            if in_fit and (self._permitted != opener or not _made_by_fit(
                    sys._getframe(1), self._gated[opener])):
                opener = _NO_OPENER  # Not fit's loop: a callback, the data, a thread.
            self._permitted = None
            self._calling.assign(opener)
            try:
                return train_function(*args, **kwargs)
            finally:
                self._calling.assign(_NO_OPENER)
                if in_fit:
                    # A budget's check allows one execution: the steps it
                    # left are no one's (review round 159).
                    self._model.privacy_ledger.revoke()

        return run_as_entry

    def permit_fit_step(self):
        """Lets the next call of the train function (`entered`) be the
        running fit's step, if Keras' fit loop makes it: the loop calls it
        right after the last of its callbacks' batch-begin hooks
        (`callbacks.FitStepPermit`). Any other call while a fit runs (from a
        callback, from the validation data, review rounds 28 and 29; from a
        callback added to a `CallbackList` after the permit's, or from a
        function set as `model.train_function` that fit's loop calls, review
        round 111: batches a callback chose recorded as fit's Poisson steps,
        3.44 reported against 19.1) is a stranger's: it takes none of fit's
        sampling and joins none of its steps, as a train_step called
        directly; train_on_batch is an entry point of its own."""
        self._permitted = self._assigned[_OPENER]

    def _assign(self, sampling, opener):
        settings = self._settings(sampling, opener)
        if settings != self._assigned:  # A train_on_batch loop assigns nothing.
            self._pending.assign(settings)
            self._assigned = settings

    def _settings(self, sampling, opener):
        return ([0.0, 0.0, opener, float(sampling.expected_batch_size),
                 float(sampling.rows_per_unit)] + [float(v) for v in sampling.layout]
                + [float(v) for v in sampling.row])

    # -- In the train step.

    def fix(self, batch_size, even_rows):
        """The mechanism of the logical step this physical batch belongs to.

        Args:
            batch_size: this replica's physical batch size (an int tensor).
            even_rows: whether every part of the batch has `batch_size` rows
                (a bool tensor; a step whose batch has not is refused,
                `Refusal.UNEVEN_ROWS`).

        Returns:
            A `FixedStep`, read at the logical step's first physical batch.
        """
        optimizer = self._model.optimizer
        variables = self._model.trainable_variables
        clips, sigma = optimizer.privacy_settings()
        entry, may_open = self._entry()
        # Every replica's batch, not this one's: a custom loop may give each
        # replica a batch of its own size and shape.
        even_rows, total_rows, largest_rows = distribute.batches_of_replicas(
            batch_size, even_rows)
        count = optimizer.count_noise_multiplier(self._expected_count(
            entry[_EXPECTED - _OPENER], total_rows))
        settings = tf.concat([tf.stack([sigma, count]), entry, clips], 0)
        held, admitted = optimizer.held_over_logical_step(settings, variables, _OPENER,
                                                          may_open)
        self._traced_ledger = self._model.privacy_ledger
        # Static in the graph: `check_next_step` retraces fit's and
        # train_on_batch's step when it changes; any other step refuses
        # itself (`Refusal.OTHER_UNIT`).
        self._traced_rows_per_unit = self.rows_per_unit
        summed_rows = total_rows * optimizer.dp_settings.accumulation_steps
        return FixedStep(held, self._traced_rows_per_unit, admitted, even_rows, summed_rows,
                         self._traced_ledger,
                         self._sensitivity(largest_rows),
                         self._num_weights(), optimizer, variables)

    def count_refusal(self, step):
        """Counts `step`'s `Refusal` (graph code), for `take_refusals`."""
        return self._refused.assign_add(tf.one_hot(step.refusal, len(Refusal), dtype=tf.int64))

    def pending_refusals(self):
        """The steps refused since the last `take_refusals`, as
        `{Refusal: count}`, left for it (eager; empty when every step applied)."""
        return {Refusal(i): int(n) for i, n in enumerate(self._refused.numpy()) if i and n}

    def take_refusals(self):
        """The steps refused since the last call, as `{Refusal: count}`
        (eager; empty when every step applied)."""
        refused = self.pending_refusals()
        if refused:
            self._refused.assign(tf.zeros_like(self._refused))
        return refused

    def warn_refusals(self):
        """Warns of steps that applied nothing since the last check (eager)."""
        for reason, count in self.take_refusals().items():
            warnings.warn(f"{count} private step(s) applied nothing: {reason.message}",
                          stacklevel=3)

    def raise_refusals(self):
        """Raises when steps applied nothing since the last check (eager).

        Raises:
            RuntimeError: naming each `Refusal` and its fix.
        """
        refused = self.take_refusals()
        if refused:
            reasons = " ".join(f"{count} step(s): {reason.message}"
                               for reason, count in refused.items())
            raise RuntimeError(
                "Private steps applied nothing (the weights, the optimizer and the "
                f"privacy ledger are as before them): {reasons}")

    def _entry(self):
        """The opener, expected batch and sampling row of this batch, and
        whether it may open a logical step.

        The train function of the entry point that set the sampling (fit,
        train_on_batch) takes it. A train_step called directly while no fit
        runs is a step outside fit like train_on_batch's; called directly
        while a fit runs (from a callback), a full release of its own that
        may neither open nor join an accumulated step, whose batches belong
        to fit's draws. A batch of fit's opens a step only as the first of
        its draw's k (review round 65: a callback aborting fit's open step
        let the draw's second batch open one, closed by the next draw's
        first, which may hold the same example: 2 C recorded C).
        """
        pending = tf.convert_to_tensor(self._pending)
        opener = pending[_OPENER]
        ours = tf.logical_or(tf.equal(tf.convert_to_tensor(self._calling), opener),
                             tf.equal(opener, _OUTSIDE_OPENER))
        stranger = tf.constant(self._settings(OUTSIDE_FIT, _NO_OPENER), tf.float64)
        return tf.where(ours, pending, stranger)[_OPENER:], tf.logical_and(
            ours, self._at_draw_start(pending[_LAYOUT], ours))

    def _at_draw_start(self, steps_per_draw, ours):
        """Whether this batch is the first of a draw of `steps_per_draw`
        batches (0: batches that promise no layout, each may open, and are
        not counted), counting the entry point's batches (`ours`, a bool
        tensor) in the graph."""
        position = tf.convert_to_tensor(self._position)
        steps = tf.cast(steps_per_draw, tf.int64)
        self._position.assign_add(tf.cast(tf.logical_and(ours, steps > 0), tf.int64))
        return tf.logical_or(tf.equal(steps, 0),
                             tf.equal(tf.math.floormod(position, tf.maximum(steps, 1)), 0))

    def _expected_count(self, expected, rows):
        """Expected examples of a logical step (Poisson), else the realised
        ones of fixed-size batches (`rows`: of all replicas)."""
        realised = tf.cast(rows, tf.float64)
        steps = self._model.optimizer.dp_settings.accumulation_steps
        return tf.where(expected > 0, expected, realised) * steps

    def padded(self):
        """Whether the batches hold padding rows (sample weight 0), as a bool tensor."""
        return tf.convert_to_tensor(self._pending)[_EXPECTED] > 0

    # -- In Python.

    @property
    def opener(self):
        """The number of the entry point whose steps come next (graph
        steps find it in their fixed mechanism)."""
        return self._assigned[_OPENER]

    def next_segment(self):
        """What the next step would record: a `ledger.Segment` of 0 steps."""
        return ledger.segment_of_row(self.next_row())

    def next_row(self):
        """The table row the next step would record (a list of floats)."""
        info = self.sampling.info
        batch_size = info and (info.physical_batch_size or info.batch_size)
        if batch_size:
            batch_size //= info.num_replicas  # One replica's, as the step records it.
        optimizer = self._model.optimizer
        step_sensitivity = self._sensitivity(batch_size)
        if self.sampling.row[ledger.COLUMN["sampling"]] == sampling_schemes.UnknownBatches.code:
            step_sensitivity *= optimizer.dp_settings.accumulation_steps  # As `FixedStep`.
        return ledger.full_row(self.sampling.row,
                               optimizer.noise_multiplier / optimizer.noise_column_norm,
                               step_sensitivity, self._num_weights())

    def check_next_step(self):
        """Refuses, before it runs, a step the ledger could not record.

        Raises:
            ValueError: the ledger is full and the step needs a new segment,
                the optimizer is not the one fit's batches were laid out
                for (`Refusal.OTHER_LAYOUT`), the step's unit (example or
                user) or users differ from the recorded steps'
                (`ledger.PrivacyLedger.check_unit`), or
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
        layout = layout_of(self._model.optimizer.dp_settings)
        if self.sampling.layout not in ((0, 0), layout):
            raise ValueError(Refusal.OTHER_LAYOUT.message)
        correlated_noise.check_sampling(self._model.optimizer.dp_settings.noise_correlation, info)
        privacy_ledger.check_unit(self.next_segment(), info and info.users_digest)
        privacy_ledger.check_room(lambda: self.next_segment().row())
        self._model.optimizer.check_adaptive_noise(_smallest_batch(info))

    def _sensitivity(self, batch_size):
        optimizer = self._model.optimizer
        return sensitivity(optimizer.dp_settings.num_microbatches, batch_size,
                           optimizer.dp_settings.accumulation_steps)

    def _num_weights(self):
        return sum(math.prod(v.shape) for v in self._model.trainable_variables)
