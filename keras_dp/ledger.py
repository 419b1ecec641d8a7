"""The privacy ledger: the mechanism of every private step, as it ran.

A private model's ledger is a short list of segments. A segment is a run of
consecutive steps with one mechanism: how batches were sampled, the noise
multiplier, the sensitivity (in multiples of the clipping norm C) and the
per-step truncation delta. The private train step appends to it in the
graph: a step whose mechanism equals the last segment's extends it, any
other starts a new segment. So every path that trains (fit, train_on_batch,
a custom loop calling `train_step`) is recorded, and a changed noise
multiplier, sampling rate or batch size shows up as a new segment. The
step hands its DP optimizer a `step_recorder`; fit() states how its
batches are drawn (`sampling_mechanism`, `PrivacyLedger.using_sampling`)
and where each pass over the data starts (`with_pass_starts`).

Epsilon is the `dp_accounting` composition (`ComposedDpEvent`) of the
segments' events. The ledger lives in model variables, so it is saved with
the model and its checkpoints; the private model refuses to let a restore
(`set_weights`, `load_weights`) lower it.
"""

import contextlib
import dataclasses
import math
import weakref

import dp_accounting
import keras
import numpy as np
import tensorflow as tf

from keras_dp import accounting
from keras_dp import clipping

# Columns of the segment table (float64).
FIELDS = ("sampling", "sampling_rate", "steps_per_pass", "noise_multiplier",
          "sensitivity", "extra_delta", "batch_size", "num_examples", "num_weights")
_COLUMN = {name: i for i, name in enumerate(FIELDS)}
_SAMPLING_CODES = {"poisson": 0.0, "shuffle": 1.0}
# Segments a ledger holds: each change of mechanism starts one.
CAPACITY = 256


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive private steps that ran with one mechanism.

    Args:
        sampling: `"poisson"` (each example joins each batch independently
            with probability `sampling_rate`) or `"shuffle"` (each example
            is in at most one batch per pass; accounted without
            amplification, one Gaussian release per pass).
        noise_multiplier: sigma: the noise std divided by the clipping norm C.
        steps: private (logical) steps taken.
        sampling_rate: q for `"poisson"`; 0.0 for `"shuffle"`.
        releases: Gaussian releases of one example: `steps` for Poisson,
            the passes the steps touched for shuffled batches. None means
            `steps` (every step counted as a full release).
        sensitivity: how many multiples of C one example can change the
            clipped sum by: 1, or 2 when microbatches hold several examples.
        extra_delta: per-step delta added by truncating padded batches.
        steps_per_pass: logical steps in one pass (shuffle; 0 if unbounded).
        batch_size: expected logical batch size (for reports; 0 if unknown).
        num_examples: training examples N (for the default delta; 0 if
            unknown).
        num_weights: weights the step noised, for the delta of the noise
            sampler's tail cap (`keras_dp.clipping.noise_tail_probability`);
            0 leaves that term out (a statement of prior spending).

    Example:
    ```python
    # A statement of prior spending: 1,000 Poisson steps, q = 0.01, sigma 1.1.
    prior = keras_dp.ledger.Segment("poisson", 1.1, 1000, sampling_rate=0.01,
                                    num_examples=60000)
    private = keras_dp.make_private(model, prior_ledger=[prior])
    ```
    """

    sampling: str
    noise_multiplier: float
    steps: int
    sampling_rate: float = 0.0
    releases: int | None = None
    sensitivity: float = 1.0
    extra_delta: float = 0.0
    steps_per_pass: float = 0.0
    batch_size: int = 0
    num_examples: int = 0
    num_weights: int = 0

    def __post_init__(self):
        if self.sampling not in _SAMPLING_CODES:
            raise ValueError(f'Segment sampling must be "poisson" or "shuffle"; '
                             f"received {self.sampling!r}.")
        if self.sampling == "poisson" and not 0 < self.sampling_rate <= 1:
            raise ValueError("A Poisson segment needs a sampling_rate in (0, 1]; "
                             f"received {self.sampling_rate!r}.")
        if self.releases is None:
            object.__setattr__(self, "releases", self.steps)

    def dp_event(self):
        """This segment as a `dp_accounting` event."""
        gaussian = dp_accounting.GaussianDpEvent(self.noise_multiplier / self.sensitivity)
        if self.sampling == "poisson":
            return dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(self.sampling_rate, gaussian),
                self.steps)
        return dp_accounting.SelfComposedDpEvent(gaussian, self.releases)

    def step_delta(self):
        """Delta each step adds: truncated batches, and the noise tail cap,
        which only a step that uses the example can reveal."""
        if not self.num_weights or self.noise_multiplier == 0:
            return self.extra_delta
        uses_example = self.sampling_rate if self.sampling == "poisson" else 1.0
        return self.extra_delta + uses_example * clipping.noise_tail_probability(
            self.num_weights, self.noise_multiplier, self.sensitivity)

    def same_mechanism(self, other):
        """True when `other` ran with this segment's mechanism."""
        return self.row() == other.row()

    def row(self):
        """The table row of this segment's mechanism (without counts)."""
        values = dict(dataclasses.asdict(self), sampling=_SAMPLING_CODES[self.sampling])
        return tuple(float(values[name]) for name in FIELDS)

    @classmethod
    def from_row(cls, row, steps, releases):
        values = dict(zip(FIELDS, (float(v) for v in row)))
        sampling = {code: name for name, code in _SAMPLING_CODES.items()}[values.pop("sampling")]
        return cls(sampling, values.pop("noise_multiplier"), int(steps),
                   releases=int(releases),
                   batch_size=int(values.pop("batch_size")),
                   num_examples=int(values.pop("num_examples")),
                   num_weights=int(values.pop("num_weights")), **values)


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


def mechanism(sampling, sampling_rate=0.0, steps_per_pass=0.0, extra_delta=0.0,
              batch_size=0, num_examples=0):
    """The sampling part of a table row (noise and sensitivity come from the step)."""
    return [_SAMPLING_CODES[sampling], sampling_rate, steps_per_pass, 0.0, 0.0,
            extra_delta, batch_size or 0, num_examples or 0, 0.0]


# Outside fit(), nothing is known of how batches were chosen: every step is a
# full Gaussian release (a pass of one step), without amplification.
UNKNOWN_SAMPLING = mechanism("shuffle", steps_per_pass=1.0)


def sampling_mechanism(info, accumulation_steps):
    """The sampling part of a table row for batches drawn as `info` says.

    Args:
        info: the `keras_dp.data.SamplingInfo` of a fit's batches.
        accumulation_steps: physical batches per private step (the
            optimizer's gradient accumulation).

    Returns:
        The row, as `mechanism(...)` gives it. Shuffled batches of a known
        number of examples and batch size have a known number of steps per
        pass; otherwise a pass is an epoch, or a step when an epoch may see
        an example more than once.
    """
    if info.sampling == "poisson":
        return mechanism("poisson", sampling_rate=info.sampling_rate,
                         extra_delta=info.extra_delta, batch_size=info.batch_size,
                         num_examples=info.num_examples)
    steps_per_pass = 0  # Unknown: one pass per epoch.
    if not info.epoch_is_one_pass:
        steps_per_pass = 1
    elif info.num_examples and info.batch_size:
        steps_per_pass = math.ceil(math.ceil(info.num_examples / info.batch_size)
                                   / accumulation_steps)
    return mechanism("shuffle", steps_per_pass=steps_per_pass, batch_size=info.batch_size,
                     num_examples=info.num_examples)


def next_segment_of(model):
    """The mechanism of a private model's next step.

    Args:
        model: a keras-dp private model, compiled with a DP optimizer; its
            `sampling_info` (set by fit) gives the batch size.

    Returns:
        A `Segment` of 0 steps: what the next step would record.
    """
    info = model.sampling_info
    batch_size = info and (info.physical_batch_size or info.batch_size)
    if batch_size:
        batch_size //= info.num_replicas  # One replica's, as the step records it.
    return model.privacy_ledger.next_segment(
        model.optimizer.noise_multiplier, *_sensitivity_and_weights(model, batch_size))


def step_recorder(model, batch_size):
    """The `record_step` a private model's step gives its DP optimizer.

    Args:
        model: a keras-dp private model, compiled with a DP optimizer.
        batch_size: this replica's physical batch size (an int tensor).

    Returns:
        A function of the step's clipped sums, called in the graph before
        each private step changes the weights. It returns the step's noise
        block (the steps recorded before it) and an op that appends the step
        to the model's ledger once the clipped sums exist: a step that fails
        before them (a bad label) is not recorded, and the caller changes the
        weights only after that op (a full ledger stops the step first).
    """
    privacy_ledger, optimizer = model.privacy_ledger, model.optimizer

    def record_step(clipped_sums):
        block = privacy_ledger.total_steps()
        with tf.control_dependencies(clipped_sums):
            recorded = privacy_ledger.record_step(
                optimizer._noise_multiplier, *_sensitivity_and_weights(model, batch_size))
        return block, recorded

    return record_step


def _sensitivity_and_weights(model, batch_size):
    """A step's sensitivity and the number of weights its noise covers."""
    optimizer = model.optimizer
    return (sensitivity(optimizer.num_microbatches, batch_size, optimizer.accumulation_steps),
            sum(math.prod(v.shape) for v in model.trainable_variables))


def with_pass_starts(callback_list, privacy_ledger):
    """Adds to fit's callbacks one that starts a pass of the ledger each epoch.

    Args:
        callback_list: fit's `callbacks`: a list, a `CallbackList` or None.
        privacy_ledger: the `PrivacyLedger` told that each epoch starts a new
            pass over the data.

    Returns:
        The callbacks with that one last (the same `CallbackList`, appended
        to, or a new list).
    """
    if isinstance(callback_list, keras.callbacks.CallbackList):
        callback_list.append(_PassStarts(privacy_ledger))
        return callback_list
    return list(callback_list or []) + [_PassStarts(privacy_ledger)]


class _PassStarts(keras.callbacks.Callback):
    """Tells the ledger that each epoch starts a new pass over the data."""

    def __init__(self, privacy_ledger):
        super().__init__()
        self._ledger = privacy_ledger

    def on_epoch_begin(self, epoch, logs=None):
        self._ledger.start_pass()


def epsilon(segments, delta, accountant="rdp"):
    """Epsilon of a sequence of segments, composed with `dp_accounting`.

    Args:
        segments: list of `Segment`.
        delta: the total delta; the segments' per-step deltas
            (`step_delta() * steps`) are taken from it first.
        accountant: `"rdp"` or `"pld"`.

    Returns:
        `(epsilon, event)`: a float (0.0 without steps, inf when a step had
        no noise, or so little that the noise sampler's tail cap uses up
        delta) and the `dp_accounting.ComposedDpEvent`.

    Raises:
        ValueError: when the truncation deltas use up `delta`.
    """
    accounting._check_choice("accountant", accountant, accounting.ACCOUNTANTS)
    segments = [s for s in segments if s.steps]
    event = dp_accounting.ComposedDpEvent(tuple(s.dp_event() for s in segments))
    delta_left(segments, delta)
    if not segments:
        return 0.0, event
    left = delta - sum(s.step_delta() * s.steps for s in segments)
    if any(s.noise_multiplier == 0 for s in segments) or left <= 0:
        return math.inf, event
    return accounting._epsilon(event, left, accountant), event


def delta_left(segments, delta):
    """The delta left once the truncation deltas of padded batches are paid.

    Raises:
        ValueError: when they use up `delta` (fix: a larger delta or
            max_batch_size).
    """
    truncation = sum(s.extra_delta * s.steps for s in segments)
    if truncation >= delta:
        raise ValueError(
            f"delta={delta:.3g} is used up by the truncation probability of padded "
            f"Poisson batches ({truncation:.3g} over the steps, from extra_delta per "
            f"step). Use a larger delta, or a larger max_batch_size for the batches.")
    return float(delta - truncation)


class PrivacyLedger:
    """The segments of a private model, in variables the train step updates.

    `table[i]` is segment i's mechanism (see `FIELDS`), `counts[i]` its
    (steps, releases), `size` the number of segments. `steps_left_in_pass`
    tells the step whether a shuffled pass is still open. The sampling
    mechanism in use (set by `fit`, `UNKNOWN_SAMPLING` outside it) is not
    saved.
    """

    def __init__(self):
        def variable(name, shape, dtype):
            return keras.Variable(np.zeros(shape, dtype), dtype=dtype, trainable=False,
                                  name=name, autocast=False)

        self.table = variable("privacy_ledger", (CAPACITY, len(FIELDS)), "float64")
        self.counts = variable("privacy_ledger_counts", (CAPACITY, 2), "int64")
        self.size = variable("privacy_ledger_size", (), "int64")
        self.steps_left_in_pass = variable("privacy_steps_left_in_pass", (), "float64")
        self.sampling = tf.Variable(UNKNOWN_SAMPLING, dtype=tf.float64, trainable=False)

    @property
    def variables(self):
        """The saved state, in a fixed order."""
        return [self.table, self.counts, self.size, self.steps_left_in_pass]

    # -- In the train step.

    def total_steps(self):
        """Private steps recorded, as a tensor: also the next noise block."""
        return tf.reduce_sum(self.counts[:, 0])

    def record_step(self, noise_multiplier, step_sensitivity, num_weights):
        """Appends one private step (graph code; see the module docstring).

        Returns:
            The op that has appended it.
        """
        row = tf.tensor_scatter_nd_update(
            tf.convert_to_tensor(self.sampling), [[_COLUMN["noise_multiplier"]],
                                                  [_COLUMN["sensitivity"]],
                                                  [_COLUMN["num_weights"]]],
            tf.cast(tf.stack([noise_multiplier, step_sensitivity, num_weights]), tf.float64))
        size = tf.convert_to_tensor(self.size)
        last = tf.gather(tf.convert_to_tensor(self.table), tf.maximum(size - 1, 0))
        same = tf.logical_and(size > 0, tf.reduce_all(tf.equal(last, row)))
        index = tf.where(same, size - 1, size)
        full = tf.debugging.assert_less(
            index, tf.constant(CAPACITY, tf.int64),
            message=f"The privacy ledger is full: {CAPACITY} segments, one per change "
                    "of noise multiplier, sampling or batch size. Keep these settings "
                    "fixed within a training run.")
        with tf.control_dependencies([full]):
            steps_per_pass = row[_COLUMN["steps_per_pass"]]
            is_shuffle = tf.equal(row[_COLUMN["sampling"]], _SAMPLING_CODES["shuffle"])
            left = tf.convert_to_tensor(self.steps_left_in_pass)
            # A changed mechanism re-counts the open pass: conservative.
            new_pass = tf.logical_or(tf.logical_not(same), left <= 0)
            release = tf.logical_or(tf.logical_not(is_shuffle), new_pass)
            pass_length = tf.where(steps_per_pass > 0, steps_per_pass,
                                   tf.constant(np.inf, tf.float64))
            return tf.group(
                self.steps_left_in_pass.assign(tf.where(new_pass, pass_length, left) - 1),
                self.table.assign(tf.tensor_scatter_nd_update(
                    tf.convert_to_tensor(self.table), [[index]], [row])),
                self.counts.assign(tf.tensor_scatter_nd_add(
                    tf.convert_to_tensor(self.counts), [[index]],
                    [tf.stack([tf.constant(1, tf.int64), tf.cast(release, tf.int64)])])),
                self.size.assign(index + 1))

    # -- In Python.

    def start_pass(self):
        """Marks the start of a pass over shuffled data (each epoch)."""
        self.steps_left_in_pass.assign(0.0)

    @contextlib.contextmanager
    def using_sampling(self, row):
        """Records the steps taken inside with the sampling mechanism `row`
        (`mechanism(...)`, e.g. from `sampling_mechanism`); unknown after."""
        self.sampling.assign(row)
        try:
            yield
        finally:
            self.sampling.assign(UNKNOWN_SAMPLING)

    def segments(self):
        """The recorded segments, oldest first, as a list of `Segment`."""
        return _segments_of(self._state())

    def next_segment(self, noise_multiplier, step_sensitivity, num_weights):
        """The mechanism the next step would record, as a `Segment` of 0 steps."""
        row = self.sampling.numpy()
        row[_COLUMN["noise_multiplier"]] = noise_multiplier
        row[_COLUMN["sensitivity"]] = step_sensitivity
        row[_COLUMN["num_weights"]] = num_weights
        return Segment.from_row(row, 0, 0)

    def steps_left_in_open_pass(self):
        """How many more shuffled steps fall in the pass already counted
        (0 if none is open; inf for a pass that lasts the epoch)."""
        return max(float(self.steps_left_in_pass.numpy()), 0.0)

    def add(self, segments):
        """Appends segments (a statement of privacy spent elsewhere).

        Args:
            segments: a list of `Segment`, or another `PrivacyLedger`.
        """
        if isinstance(segments, PrivacyLedger):
            segments = segments.segments()
        self._write(self.segments() + list(segments),
                    float(self.steps_left_in_pass.numpy()))

    def copy(self):
        """A new ledger with the same segments."""
        other = PrivacyLedger()
        other._assign(self._state())
        return other

    @contextlib.contextmanager
    def never_lowered(self):
        """Keeps the spending through an operation that may overwrite the ledger.

        Restoring an older state of the same ledger (an earlier checkpoint,
        `EarlyStopping(restore_best_weights=True)`) keeps the current one;
        a ledger of another history is composed with this one.
        """
        before = self._state()
        try:
            yield
        finally:  # Also when the load fails after overwriting some variables.
            after = self._state()
            merged = _merge(_segments_of(before), _segments_of(after))
            self._write(merged, min(before["left"], after["left"]))

    def _state(self):
        size = int(self.size.numpy())
        return {"table": self.table.numpy()[:size], "counts": self.counts.numpy()[:size],
                "left": float(self.steps_left_in_pass.numpy())}

    def _write(self, segments, steps_left_in_pass):
        if len(segments) > CAPACITY:
            raise ValueError(f"The privacy ledger holds at most {CAPACITY} segments; "
                             f"this would make {len(segments)}.")
        self._assign({
            "table": np.reshape([s.row() for s in segments], (-1, len(FIELDS))),
            "counts": np.reshape([(s.steps, s.releases) for s in segments], (-1, 2)),
            "left": steps_left_in_pass})

    def _assign(self, state):
        size = len(state["table"])
        table = np.zeros((CAPACITY, len(FIELDS)))
        counts = np.zeros((CAPACITY, 2), np.int64)
        table[:size], counts[:size] = state["table"], state["counts"]
        self.table.assign(table)
        self.counts.assign(counts)
        self.size.assign(size)
        self.steps_left_in_pass.assign(state["left"])


class LedgerCheckpoint(tf.__internal__.tracking.Trackable):
    """A ledger as a `tf.train.Checkpoint` saves and restores it.

    Keras' own saving (`model.save`, `save_weights`, `BackupAndRestore`)
    sees the ledger's variables among the model's weights; TensorFlow's
    checkpoints reach the model's weights only through its optimizer, so a
    private model holds one of these. Restoring never lowers the ledger, as
    `PrivacyLedger.never_lowered` describes.
    """

    def __init__(self, privacy_ledger):
        self._ledger = privacy_ledger

    def _serialize_to_tensors(self):
        return {f"ledger_{i}": tf.convert_to_tensor(v)
                for i, v in enumerate(self._ledger.variables)}

    def _restore_from_tensors(self, restored_tensors):
        with self._ledger.never_lowered():
            for i, variable in enumerate(self._ledger.variables):
                variable.assign(restored_tensors[f"ledger_{i}"])
        return tf.no_op()


def extended(segments, segment, steps, releases):
    """`segments` followed by `steps` more steps (`releases` releases) of
    `segment`'s mechanism: what the ledger would hold after them."""
    if segments and segments[-1].same_mechanism(segment):
        last = segments[-1]
        return segments[:-1] + [dataclasses.replace(
            last, steps=last.steps + steps, releases=last.releases + releases)]
    return segments + [dataclasses.replace(segment, steps=steps, releases=releases)]


def _segments_of(state):
    return [Segment.from_row(row, steps, releases)
            for row, (steps, releases) in zip(state["table"], state["counts"])]


def _merge(ours, theirs):
    """The spending of two ledgers: the longer if one is a prefix of the
    other (the same history at two times), else both."""
    if _is_prefix(ours, theirs):
        return theirs
    if _is_prefix(theirs, ours):
        return ours
    return ours + theirs


def _is_prefix(shorter, longer):
    if len(shorter) > len(longer):
        return False
    if not shorter:
        return True
    *head, last = shorter
    other = longer[len(shorter) - 1]
    return (head == longer[:len(head)] and last.same_mechanism(other)
            and last.steps <= other.steps and last.releases <= other.releases)


# Ledgers of the models wrapped by make_private in this process.
_LEDGERS = weakref.WeakKeyDictionary()


def for_base_model(model):
    """The ledger of a model wrapped by `make_private`.

    The same model object keeps its ledger across wrappers. A model whose
    weights equal those of another wrapped model in this process (e.g.
    `keras.models.load_model` of a file saved from it) starts from a copy
    of that model's ledger: those weights carry its spending.
    """
    if model not in _LEDGERS:
        _LEDGERS[model] = _ledger_of_equal_weights(model) or PrivacyLedger()
    return _LEDGERS[model]


def _ledger_of_equal_weights(model):
    weights = [np.asarray(w) for w in model.get_weights()]
    for other, ledger in list(_LEDGERS.items()):
        if int(ledger.size.numpy()) and _same_arrays(weights, other.get_weights()):
            return ledger.copy()
    return None


def _same_arrays(first, second):
    return len(first) == len(second) and all(
        a.shape == np.shape(b) and np.array_equal(a, b) for a, b in zip(first, second))
