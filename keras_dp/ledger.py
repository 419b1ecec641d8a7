"""The privacy ledger: the mechanism of every private step, as it ran.

A ledger is a short list of segments. A segment is a run of consecutive
steps with one mechanism: how batches were sampled, the noise multiplier,
the sensitivity (in multiples of the clipping norm C) and the per-step
truncation delta. The private train step appends to it in the graph the
row that `keras_dp.mechanism` fixed for the step: a step whose row equals
the last segment's extends it, any other starts a new segment. So every
path that trains (fit, train_on_batch, a custom loop calling `train_step`)
is recorded. fit() states where each pass over the data starts
(`PassStarts`).

The ledger belongs to the variables it protects (`for_variables`): every
private model whose trainable variables include them records into the same
ledger (a re-wrap, an alias `keras.Model(base.inputs, base.outputs)`, a
larger model around a privately trained one), and a model whose variables
carry several ledgers composes them. Its `counter` numbers the steps taken
on those variables: the noise block of each step, so it only moves forward,
on every path, also when the table of segments is full (those steps are
then counted as `unrecorded`, and epsilon is infinite: never less than what
ran). No guarantee rests on an in-graph assertion, which XLA removes.

Epsilon is the `dp_accounting` composition (`ComposedDpEvent`) of the
segments' events. The ledger is saved with the private model and its
checkpoints (not among its weights); a restore never lowers it.
"""

import dataclasses
import hashlib
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
          "sensitivity", "extra_delta", "batch_size", "num_examples", "num_weights", "unit")
_COLUMN = {name: i for i, name in enumerate(FIELDS)}
_SAMPLING_CODES = {"poisson": 0.0, "shuffle": 1.0, "cyclic_poisson": 2.0}
# Sampling kinds whose examples join at most one step of each pass.
_PASS_COUNTED = ("shuffle", "cyclic_poisson")
# Sampling kinds amplified by Poisson sampling at `sampling_rate`.
_POISSON_SAMPLED = ("poisson", "cyclic_poisson")
# What one segment's guarantee protects. Ledgers saved before the column
# existed read as 0.0: examples.
_UNIT_CODES = {"example": 0.0, "user": 1.0}
# Segments a ledger holds: each change of mechanism starts one.
CAPACITY = 256


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive private steps that ran with one mechanism.

    Args:
        sampling: `"poisson"` (each example joins each batch independently
            with probability `sampling_rate`) or `"shuffle"` (each example
            is in at most one batch per pass; accounted without
            amplification, one Gaussian release per pass) or
            `"cyclic_poisson"` (banded matrix factorization's cyclic
            Poisson sampling: examples in `steps_per_pass` = b fixed
            groups, step t samples group t mod b with `sampling_rate`; one
            Poisson-sampled Gaussian release per pass of b steps).
        noise_multiplier: sigma: the noise std divided by the clipping norm C
            (and, for correlated noise, by the strategy's largest column
            norm).
        steps: private (logical) steps taken.
        sampling_rate: q for `"poisson"` and `"cyclic_poisson"`; 0.0 for
            `"shuffle"`.
        releases: Gaussian releases of one example: `steps` for Poisson,
            the passes the steps touched for the others. None means
            `steps` (every step counted as a full release).
        sensitivity: how many multiples of C one example can change the
            clipped sum by: 1, or 2 when microbatches hold several examples.
        extra_delta: per-step delta added by truncating padded batches.
        steps_per_pass: logical steps in one pass (shuffle; 0 if unbounded;
            b for cyclic Poisson).
        batch_size: expected logical batch size (for reports; 0 if unknown).
        num_examples: training examples N (for the default delta; 0 if
            unknown).
        num_weights: weights the step noised, for the delta of the noise
            sampler's tail cap (`keras_dp.clipping.noise_tail_probability`);
            0 leaves that term out (a statement of prior spending).
        unit: what the guarantee protects: `"example"` (one row), or
            `"user"` (all rows of one user; `sampling_rate`, `batch_size`
            and `num_examples` then count users, and `sensitivity` is per
            user).

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
    unit: str = "example"

    def __post_init__(self):
        if self.sampling not in _SAMPLING_CODES:
            raise ValueError(f'Segment sampling must be "poisson", "shuffle" or '
                             f'"cyclic_poisson"; received {self.sampling!r}.')
        if self.unit not in _UNIT_CODES:
            raise ValueError(f'Segment unit must be "example" or "user"; received '
                             f"{self.unit!r}.")
        if self.sampling in _POISSON_SAMPLED and not 0 < self.sampling_rate <= 1:
            raise ValueError("A Poisson segment needs a sampling_rate in (0, 1]; "
                             f"received {self.sampling_rate!r}.")
        if self.releases is None:
            object.__setattr__(self, "releases", self.steps)

    def dp_event(self):
        """This segment as a `dp_accounting` event."""
        gaussian = dp_accounting.GaussianDpEvent(self.noise_multiplier / self.sensitivity)
        if self.sampling in _POISSON_SAMPLED:
            # Every Poisson step is a release; a cyclic one, every pass of b steps.
            releases = self.steps if self.sampling == "poisson" else self.releases
            return dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(self.sampling_rate, gaussian), releases)
        return dp_accounting.SelfComposedDpEvent(gaussian, self.releases)

    def step_delta(self):
        """Delta each step adds: truncated batches, and the noise tail cap,
        which only a step that uses the example can reveal."""
        if not self.num_weights or self.noise_multiplier == 0:
            return self.extra_delta
        uses_example = self.sampling_rate if self.sampling in _POISSON_SAMPLED else 1.0
        return self.extra_delta + uses_example * clipping.noise_tail_probability(
            self.num_weights, self.noise_multiplier, self.sensitivity)

    def same_mechanism(self, other):
        """True when `other` ran with this segment's mechanism."""
        return self.row() == other.row()

    def row(self):
        """The table row of this segment's mechanism (without counts)."""
        values = dict(dataclasses.asdict(self), sampling=_SAMPLING_CODES[self.sampling],
                      unit=_UNIT_CODES[self.unit])
        return tuple(float(values[name]) for name in FIELDS)

    @classmethod
    def from_row(cls, row, steps, releases):
        values = dict(zip(FIELDS, (float(v) for v in row)))
        sampling = {code: name for name, code in _SAMPLING_CODES.items()}[values.pop("sampling")]
        unit = {code: name for name, code in _UNIT_CODES.items()}[values.pop("unit", 0.0)]
        return cls(sampling, values.pop("noise_multiplier"), int(steps), unit=unit,
                   releases=int(releases),
                   batch_size=int(values.pop("batch_size")),
                   num_examples=int(values.pop("num_examples")),
                   num_weights=int(values.pop("num_weights")), **values)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The segments of one trial of a hyperparameter search that ran a
    random number of such trials and kept only the best (Papernot & Steinke,
    ICLR 2022): `dp_accounting.RepeatAndSelectDpEvent` of their composition.

    It reads as one segment (`PrivacyLedger.segments`): its steps, releases
    and deltas are the trial's, the deltas times `mean` (a union bound over
    the trials), so every reader of a ledger accounts it.

    Args:
        segments: the trial's segments, a tuple of `Segment`.
        mean: the mean number of trials.
        shape: the shape of their distribution (0 logarithmic, 1
            geometric, inf Poisson).
    """

    segments: tuple
    mean: float
    shape: float

    sampling = "selection"

    @property
    def steps(self):
        return sum(s.steps for s in self.segments)

    @property
    def releases(self):
        return sum(s.releases for s in self.segments)

    @property
    def unit(self):
        return unit_of(self.segments) or "example"

    @property
    def num_examples(self):
        return max((s.num_examples for s in self.segments), default=0)

    @property
    def noise_multiplier(self):
        return min((s.noise_multiplier for s in self.segments if s.steps), default=1.0)

    @property
    def extra_delta(self):
        return self.mean * sum(s.extra_delta * s.steps for s in self.segments) / self.steps

    def step_delta(self):
        return self.mean * sum(s.step_delta() * s.steps for s in self.segments) / self.steps

    def dp_event(self):
        trial = dp_accounting.ComposedDpEvent(tuple(s.dp_event() for s in self.segments))
        return dp_accounting.dp_event.RepeatAndSelectDpEvent(trial, self.mean, self.shape)

    def same_mechanism(self, other):
        return False


# A ledger's selection: [start, end, mean, shape, steps, releases]: segments
# start to end (excluded) are the trial, of whose last segment the first
# `steps` (`releases`) were the trial's; end == 0: none.
NO_SELECTION = np.zeros(6)


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
              batch_size=0, num_examples=0, unit="example"):
    """The sampling part of a table row (noise and sensitivity come from the step)."""
    return [_SAMPLING_CODES[sampling], sampling_rate, steps_per_pass, 0.0, 0.0,
            extra_delta, batch_size or 0, num_examples or 0, 0.0, _UNIT_CODES[unit]]


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
    if info.sampling == "poisson" and info.participation_groups > 1:
        return mechanism("cyclic_poisson", sampling_rate=info.sampling_rate,
                         steps_per_pass=info.participation_groups,
                         extra_delta=info.extra_delta, batch_size=info.batch_size,
                         num_examples=info.num_examples)
    if info.sampling == "poisson":
        # For users, q, the batch size and the count are over users.
        return mechanism("poisson", sampling_rate=info.sampling_rate,
                         extra_delta=info.extra_delta, batch_size=info.batch_size,
                         num_examples=info.num_units, unit=info.unit)
    steps_per_pass = 0  # Unknown: one pass per epoch.
    if not info.epoch_is_one_pass:
        steps_per_pass = 1
    elif info.num_examples and info.batch_size:
        steps_per_pass = math.ceil(math.ceil(info.num_examples / info.batch_size)
                                   / accumulation_steps)
    return mechanism("shuffle", steps_per_pass=steps_per_pass, batch_size=info.batch_size,
                     num_examples=info.num_examples)


def full_row(sampling_row, noise_multiplier, step_sensitivity, num_weights):
    """A table row: the sampling part (`mechanism`) with the step's noise.

    Works on Python values and on tensors (the train step's fixed row).
    """
    if isinstance(sampling_row, tf.Tensor):
        return tf.tensor_scatter_nd_update(
            sampling_row, [[_COLUMN["noise_multiplier"]], [_COLUMN["sensitivity"]],
                           [_COLUMN["num_weights"]]],
            tf.cast(tf.stack([noise_multiplier, step_sensitivity, num_weights]), tf.float64))
    row = list(sampling_row)
    row[_COLUMN["noise_multiplier"]] = float(noise_multiplier)
    row[_COLUMN["sensitivity"]] = float(step_sensitivity)
    row[_COLUMN["num_weights"]] = float(num_weights)
    return row


def segment_of_row(row):
    """The `Segment` of 0 steps that a step recording `row` would extend or start."""
    return Segment.from_row(row, 0, 0)


class PassStarts(keras.callbacks.Callback):
    """One of fit's callbacks: tells the ledger that each epoch starts a new
    pass over the data."""

    def __init__(self, privacy_ledger):
        super().__init__()
        self._ledger = privacy_ledger

    def on_epoch_begin(self, epoch, logs=None):
        self._ledger.start_pass()


def unit_of(segments):
    """What the steps of `segments` protect: `"example"`, `"user"`, or None
    without steps.

    Raises:
        ValueError: for steps of both units, whose composition has no sound
            reading (one row changed inside a user is neither adding nor
            removing a user): spending stated with `prior_ledger`, or two
            models' ledgers composed.
    """
    units = {s.unit for s in segments if s.steps}
    if len(units) > 1:
        raise ValueError(
            "A privacy ledger cannot compose example-level and user-level steps: "
            "no single guarantee covers both (one row changed inside a user is "
            "neither adding nor removing a user). State earlier spending in the unit "
            "of this model's training, or train a fresh model.")
    return units.pop() if units else None


def epsilon_key(unit):
    """The name epsilon is reported under for a ledger of `unit`: `"epsilon"`
    for examples, `"user_epsilon"` for users (History, progress bar,
    TensorBoard), so a user-level guarantee is never read as another."""
    return "user_epsilon" if unit == "user" else "epsilon"


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
        ValueError: when the truncation deltas use up `delta`, or the
            segments mix example-level and user-level steps (`unit_of`).
    """
    accounting._check_choice("accountant", accountant, accounting.ACCOUNTANTS)
    segments = [s for s in segments if s.steps]
    unit_of(segments)
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
    """The segments of the steps taken on some variables, in variables the
    train step updates.

    `table[i]` is segment i's mechanism (see `FIELDS`), `counts[i]` its
    (steps, releases), `size` the number of segments. `counter` numbers
    every step taken (the next noise block), `unrecorded` the steps that
    found the table full. `steps_left_in_pass` tells the step whether a
    shuffled pass is still open. None of them is a model weight: the private
    model saves them beside its weights (`state` / `restore`).
    """

    def __init__(self):
        def variable(name, shape, dtype):
            return tf.Variable(np.zeros(shape, dtype), dtype=dtype, trainable=False,
                               name=name)

        self.table = variable("privacy_ledger", (CAPACITY, len(FIELDS)), "float64")
        self.counts = variable("privacy_ledger_counts", (CAPACITY, 2), "int64")
        self.size = variable("privacy_ledger_size", (), "int64")
        self.counter = variable("privacy_ledger_counter", (), "int64")
        self.unrecorded = variable("privacy_ledger_unrecorded", (), "int64")
        self.steps_left_in_pass = variable("privacy_steps_left_in_pass", (), "float64")
        # The trial of a search kept as best (`select`): not updated in the step.
        self.selection = variable("privacy_ledger_selection", (6,), "float64")
        # Segments surely left, spent by every check before a step; writes
        # from Python (add, restore) reset it.
        self._room_estimate = 0
        # Seeds of the Poisson datasets trained on (`first_dataset_of_seed`).
        self._datasets_by_seed = {}
        # The user id space of the user-level fits (`check_unit`); not saved.
        self._users_digest = None
        self._unit_checked = None

    @property
    def variables(self):
        """The saved state, in a fixed order."""
        return [self.table, self.counts, self.size, self.counter, self.unrecorded,
                self.steps_left_in_pass]

    # -- In the train step.

    def next_block(self):
        """The noise block of the step about to be recorded: the counter
        (graph code; read before `record_step` advances it)."""
        return tf.convert_to_tensor(self.counter)

    def record_step(self, row):
        """Appends one private step with the table row `row` (graph code).

        Returns:
            The op that has recorded it. A step that finds the table full
            still advances the counter, and counts as unrecorded, which
            makes epsilon infinite; `check_room` refuses such a step in
            Python before it runs.
        """
        size = tf.convert_to_tensor(self.size)
        last = tf.gather(tf.convert_to_tensor(self.table), tf.maximum(size - 1, 0))
        same = tf.logical_and(size > 0, tf.reduce_all(tf.equal(last, row)))
        index = tf.where(same, size - 1, size)
        fits = index < CAPACITY
        index = tf.minimum(index, CAPACITY - 1)
        steps_per_pass = row[_COLUMN["steps_per_pass"]]
        is_poisson = tf.equal(row[_COLUMN["sampling"]], _SAMPLING_CODES["poisson"])
        left = tf.convert_to_tensor(self.steps_left_in_pass)
        # A changed mechanism re-counts the open pass: conservative.
        new_pass = tf.logical_or(tf.logical_not(same), left <= 0)
        release = tf.logical_or(is_poisson, new_pass)
        pass_length = tf.where(steps_per_pass > 0, steps_per_pass,
                               tf.constant(np.inf, tf.float64))
        table = tf.convert_to_tensor(self.table)
        counts = tf.convert_to_tensor(self.counts)
        one = tf.cast(fits, tf.int64)
        recorded = tf.group(
            self.counter.assign_add(1),
            self.unrecorded.assign_add(1 - one),
            self.steps_left_in_pass.assign(tf.where(new_pass, pass_length, left) - 1),
            self.table.assign(tf.where(fits, tf.tensor_scatter_nd_update(
                table, [[index]], [row]), table)),
            self.counts.assign(tf.tensor_scatter_nd_add(
                counts, [[index]], [tf.stack([one, one * tf.cast(release, tf.int64)])])),
            self.size.assign(tf.where(fits, index + 1, size)))
        return recorded

    # -- In Python.

    def total_steps(self):
        """Private steps taken on this ledger's variables (an int)."""
        return int(self.counter.numpy())

    def check_room(self, row_of_next_step):
        """Refuses, before a step, a step whose mechanism would need a new
        segment in a full table (its spending could not be recorded).

        A step (or an execution of steps) adds one segment at most, and every
        private model on these variables checks before each: the table is
        read only once it could be nearly full.

        Args:
            row_of_next_step: returns the table row of the next step.

        Raises:
            ValueError: naming the fix.
        """
        if self._room_estimate > 2:
            self._room_estimate -= 1
            return
        size = int(self.size.numpy())
        self._room_estimate = CAPACITY - size
        row = row_of_next_step()
        if size < CAPACITY or np.array_equal(self.table.numpy()[size - 1], row):
            return
        raise ValueError(
            f"The privacy ledger is full: {CAPACITY} segments, one per change of "
            "noise multiplier, clipping norm, sampling or batch size. Keep these "
            "settings fixed within a training run (a change takes effect per "
            "fit, not per step).")

    def first_dataset_of_seed(self, seed, dataset):
        """The first Poisson dataset trained on with `seed` in this process
        (`dataset` if none was). Weakly held: not saved."""
        first = self._datasets_by_seed.get(seed)
        if first is None or first() is None:
            self._datasets_by_seed[seed] = weakref.ref(dataset)
            return dataset
        return first()

    def unit(self):
        """What the recorded steps protect: `"example"`, `"user"`, or None
        before any step (`unit_of`)."""
        return unit_of(_segments_of(self.state()))

    def check_unit(self, segment, users_digest=None):
        """Refuses a step whose unit or user id space differs from the
        recorded steps': their composition would have no sound reading.

        Example-level steps bound one row, user-level steps one user: one row
        changed inside a user is neither, so a ledger keeps one unit. Two
        user-level fits over different users (another id mapping) would
        protect different groups of rows.

        Args:
            segment: the `Segment` the next step would record.
            users_digest: `keras_dp.data.user_digest` of the next step's
                user ids (user-level steps), kept in this process beside the
                ledger: an earlier user-level fit's must match.

        Raises:
            ValueError: naming the fix.
        """
        checked = (segment.unit, segment.num_examples, users_digest)
        if checked == self._unit_checked:  # Steps since recorded this unit only.
            return
        recorded = self.unit()
        if recorded is not None and recorded != segment.unit:
            raise ValueError(
                f"This model's privacy ledger records {recorded}-level steps, and this "
                f"step would be {segment.unit}-level: one ledger cannot soundly compose "
                "both (one row changed inside a user is neither adding nor removing a "
                f"{recorded}). Train a fresh model for {segment.unit}-level privacy; to "
                "state spending of the same unit made elsewhere, use "
                "make_private(model, prior_ledger=[keras_dp.ledger.Segment(..., "
                f"unit={segment.unit!r})]).")
        if segment.unit == "user":
            self._check_users(segment, users_digest)
        # Until a write from Python (`_write`), only steps checked here are
        # recorded: a check before every batch of fit() reads nothing again.
        self._unit_checked = checked

    def _check_users(self, segment, users_digest):
        """The user-level part of `check_unit`."""
        counts = {int(s.num_examples) for s in _segments_of(self.state()) if s.steps}
        other = counts - {segment.num_examples}
        if other or self._users_digest not in (None, users_digest):
            earlier = (f"{other.pop()} users, this fit {int(segment.num_examples)}" if other
                       else "the same number of users, but other rows per user")
            raise ValueError(
                f"This model's earlier user-level steps sampled another set of users "
                f"({earlier}): one person could then be two users, each with its own "
                "budget. Fit again with the same user_ids for the same rows, or "
                "train a fresh model.")
        self._users_digest = users_digest

    def start_pass(self):
        """Marks the start of a pass over shuffled data (each epoch)."""
        self.steps_left_in_pass.assign(0.0)

    def segments(self):
        """The segments, oldest first, as a list of `Segment`.

        Steps that found the table full come last, as a segment without
        noise: their mechanism is unknown, so epsilon is infinite for every
        reader (privacy_spent, PrivacyCallback's budget, the command line).
        """
        state = self.state()
        segments = _selected(_segments_of(state), state["selection"])
        unrecorded = self.num_unrecorded()
        if unrecorded:
            segments.append(Segment("shuffle", 0.0, unrecorded, steps_per_pass=1.0,
                                    unit=unit_of(segments) or "example"))
        return segments

    def num_unrecorded(self):
        """Steps taken when the table was full: epsilon is then infinite."""
        return int(self.unrecorded.numpy())

    def steps_left_in_open_pass(self):
        """How many more shuffled steps fall in the pass already counted
        (0 if none is open; inf for a pass that lasts the epoch)."""
        return max(float(self.steps_left_in_pass.numpy()), 0.0)

    def add(self, segments):
        """Appends segments (a statement of privacy spent elsewhere).

        Args:
            segments: a list of `Segment`, or another `PrivacyLedger`.
        """
        state = self.state()
        if isinstance(segments, PrivacyLedger):
            other = segments.state()
            segments = _segments_of(other)
            state["counter"] = max(state["counter"], other["counter"])
            state["unrecorded"] += other["unrecorded"]
            state["selection"] = _combined_selection(state, other, len(state["table"]))
        # _write keeps the counter at least the steps of all segments.
        self._write(_segments_of(state) + list(segments), state)

    def state(self):
        """The ledger's content as numpy arrays (what is saved)."""
        size = int(self.size.numpy())
        return {"table": self.table.numpy()[:size], "counts": self.counts.numpy()[:size],
                "counter": int(self.counter.numpy()),
                "unrecorded": int(self.unrecorded.numpy()),
                "left": float(self.steps_left_in_pass.numpy()),
                "selection": self.selection.numpy()}

    def select(self, start, mean, shape):
        """Marks the segments from `start` on as the trial a search of a
        random number of trials (`mean`, `shape`) kept as best
        (`Selection`); later steps count outside it.

        Raises:
            ValueError: when the ledger already holds a search's trial.
        """
        if self.selection.numpy()[1]:
            raise ValueError("This model's ledger already holds the trial of a "
                             "hyperparameter search; a ledger holds one. Search with "
                             "a fresh model (built by the hypermodel).")
        if not self.size.numpy():
            raise ValueError("This ledger holds no steps, so no trial to mark as a "
                             "search's: select after the trial's training.")
        last = _segments_of(self.state())[-1]
        self.selection.assign([start, self.size.numpy(), mean, shape, last.steps,
                               last.releases])

    def restore(self, state):
        """Merges a saved `state` into this ledger, never lowering it.

        Restoring an older state of the same history (an earlier checkpoint)
        keeps the current one; a state of another history is composed with
        this one. The counter keeps the larger value, so no noise block of
        either history is drawn again.
        """
        self._write_merged(self.state(), state)

    def _write_merged(self, ours, theirs):
        merged = _merge(_segments_of(ours), _segments_of(theirs))
        same_history = len(merged) < len(_segments_of(ours)) + len(_segments_of(theirs))
        unrecorded = (max if same_history else sum)((ours["unrecorded"], theirs["unrecorded"]))
        selection = _combined_selection(ours, theirs, 0 if same_history else len(ours["table"]))
        self._write(merged, {"counter": max(ours["counter"], theirs["counter"]),
                             "unrecorded": unrecorded,
                             "left": min(ours["left"], theirs["left"]),
                             "selection": selection})

    def _write(self, segments, state):
        unit_of(segments)  # Refuses spending of both units.
        if len(segments) > CAPACITY:
            raise ValueError(f"The privacy ledger holds at most {CAPACITY} segments; "
                             f"this would make {len(segments)}.")
        table = np.zeros((CAPACITY, len(FIELDS)))
        counts = np.zeros((CAPACITY, 2), np.int64)
        table[:len(segments)] = np.reshape([s.row() for s in segments], (-1, len(FIELDS)))
        counts[:len(segments)] = np.reshape([(s.steps, s.releases) for s in segments], (-1, 2))
        self._room_estimate = 0
        self._unit_checked = None
        self.table.assign(table)
        self.counts.assign(counts)
        self.size.assign(len(segments))
        self.counter.assign(max(state["counter"], int(counts[:, 0].sum())))
        self.unrecorded.assign(state["unrecorded"])
        self.steps_left_in_pass.assign(state["left"])
        self.selection.assign(state.get("selection", NO_SELECTION))


class LedgerCheckpoint(tf.__internal__.tracking.Trackable):
    """A ledger as a `tf.train.Checkpoint` saves and restores it.

    Keras' own saving (`model.save`, `save_weights`, `BackupAndRestore`)
    goes through the private model's `save_own_variables`; TensorFlow's
    checkpoints reach the model only through its trackable children, so a
    private model holds one of these. Restoring never lowers the ledger.

    Args:
        get_ledger: returns the ledger to save or restore into (the model's
            current one: it follows the model's variables).
    """

    def __init__(self, get_ledger):
        self._get_ledger = get_ledger
        # A child, so that checkpoints saved before it existed still restore.
        self._track_trackable(_SelectionCheckpoint(get_ledger), name="selection")

    def _serialize_to_tensors(self):
        state = self._get_ledger().state()
        return {name: tf.constant(value) for name, value in _flat_state(state).items()
                if name != "ledger_selection"}

    def _restore_from_tensors(self, restored_tensors):
        self._get_ledger().restore(_unflat_state(
            {name: tensor.numpy() for name, tensor in restored_tensors.items()}))
        return tf.no_op()


class _SelectionCheckpoint(tf.__internal__.tracking.Trackable):
    """A ledger's selection (`PrivacyLedger.select`) in TensorFlow checkpoints."""

    def __init__(self, get_ledger):
        self._get_ledger = get_ledger

    def _serialize_to_tensors(self):
        return {"ledger_selection": tf.constant(self._get_ledger().state()["selection"])}

    def _restore_from_tensors(self, restored_tensors):
        privacy_ledger = self._get_ledger()
        state = privacy_ledger.state()
        state["selection"] = _combined_selection(
            state, {"selection": restored_tensors["ledger_selection"].numpy()}, 0)
        privacy_ledger.restore(state)
        return tf.no_op()


def _flat_state(state):
    """The arrays of a saved ledger, by name: a fixed set of fixed shapes, as
    TensorFlow checkpoints need at save and restore."""
    table = np.zeros((CAPACITY, len(FIELDS)))
    counts = np.zeros((CAPACITY, 2), np.int64)
    table[:len(state["table"])], counts[:len(state["counts"])] = state["table"], state["counts"]
    return {"ledger_table": table, "ledger_counts": counts,
            "ledger_size": np.int64(len(state["table"])),
            "ledger_counter": np.int64(state["counter"]),
            "ledger_unrecorded": np.int64(state["unrecorded"]),
            "ledger_left": np.float64(state["left"]),
            "ledger_selection": np.asarray(state.get("selection", NO_SELECTION))}


def _unflat_state(arrays):
    size = int(arrays["ledger_size"])
    return {"table": _with_all_columns(np.asarray(arrays["ledger_table"])[:size]),
            "counts": np.asarray(arrays["ledger_counts"])[:size],
            "counter": int(arrays["ledger_counter"]),
            "unrecorded": int(arrays["ledger_unrecorded"]),
            "left": float(arrays["ledger_left"]),
            "selection": np.asarray(arrays.get("ledger_selection", NO_SELECTION))}


def save_to(store, privacy_ledger):
    """Writes a ledger into a Keras weights store (`save_own_variables`)."""
    for name, value in _flat_state(privacy_ledger.state()).items():
        store[name] = value


def load_from(store, privacy_ledger):
    """Merges the ledger of a Keras weights store into `privacy_ledger`.

    Returns:
        The store's other entries, as a dict (the model's own weights).
    """
    names = set(_flat_state(privacy_ledger.state()))
    present = [name for name in store.keys() if name in names]
    if present:
        privacy_ledger.restore(_unflat_state({name: store[name] for name in present}))
    return {name: store[name] for name in store.keys() if name not in names}


def extended(segments, segment, steps, releases):
    """`segments` followed by `steps` more steps (`releases` releases) of
    `segment`'s mechanism: what the ledger would hold after them."""
    if segments and segments[-1].same_mechanism(segment):
        last = segments[-1]
        return segments[:-1] + [dataclasses.replace(
            last, steps=last.steps + steps, releases=last.releases + releases)]
    return segments + [dataclasses.replace(segment, steps=steps, releases=releases)]


def releases_of(segment, steps, left_in_pass=0.0):
    """The releases `steps` more steps of `segment`'s mechanism cost, by the
    rule `PrivacyLedger.record_step` applies step by step: every Poisson
    step is one; shuffled and cyclic Poisson steps cost one per pass they
    open beyond the
    `left_in_pass` steps of the pass already counted, and a pass of unknown
    length (an epoch) opens one."""
    beyond = steps - left_in_pass
    if segment.sampling == "poisson":
        return steps
    if beyond <= 0:
        return 0
    if segment.steps_per_pass:
        return math.ceil(beyond / segment.steps_per_pass)
    return 1


def _with_all_columns(table):
    """A saved table with the columns added since as zeros (unit: examples)."""
    missing = len(FIELDS) - table.shape[1]
    return np.pad(table, ((0, 0), (0, missing))) if missing > 0 else table


def _segments_of(state):
    return [Segment.from_row(row, steps, releases)
            for row, (steps, releases) in zip(state["table"], state["counts"])]


def _selected(segments, selection):
    """`segments` with those of a search's kept trial as one `Selection`."""
    start, end, mean, shape, steps, releases = (float(v) for v in selection)
    if not end:
        return segments
    start, end = int(start), int(end)
    last = segments[end - 1]
    trial = segments[start:end - 1] + [dataclasses.replace(
        last, steps=int(steps), releases=int(releases))]
    since = [dataclasses.replace(last, steps=last.steps - int(steps),
                                 releases=last.releases - int(releases))]
    return (segments[:start] + [Selection(tuple(trial), mean, shape)]
            + since[:last.steps > steps] + segments[end:])


def _combined_selection(first, second, offset):
    """The selection of `first`'s segments followed by `second`'s (from
    `offset`): a ledger holds one search's trial.

    Raises:
        ValueError: when both hold one.
    """
    ours, theirs = np.asarray(first["selection"]), np.asarray(second["selection"])
    if ours[1] and theirs[1] and offset:
        raise ValueError("These two privacy ledgers each hold the trial of a "
                         "hyperparameter search, which one ledger cannot compose. "
                         "Keep the models apart, or train one without a search.")
    if theirs[1] and not ours[1]:
        return theirs + [offset, offset, 0.0, 0.0, 0.0, 0.0]
    return ours


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


# The ledger of each variable trained privately in this process, by id, with
# a weak reference that removes the entry when the variable goes.
_LEDGER_OF_VARIABLE = {}
# Each set of variables given to `for_variables`, with their values then:
# `(weak references, values, ledger)`.
_REGISTERED = []
# The ledger states of values private steps produced, by a digest of the
# values (`remember_values`): at most this many, the latest kept.
_REMEMBERED = {}
_MAX_REMEMBERED = 64


def for_variables(variables, prior=None):
    """The ledger of `variables`: the one that records their spending.

    Variables nobody trained privately yet join `prior` (or a new ledger),
    unless their values are those that private steps produced on another
    set of variables of the same shapes in this process (a copy:
    `keras.models.load_model` of a base model saved on its own, `clone_model`
    plus `set_weights`): they then start from a copy of that ledger. Values
    that no step changed (the initial weights of a seeded model) are never
    taken for a history. Variables that carry several ledgers (two
    privately trained models put together) get one ledger composing all of
    them: each history's spending counts, and its counter keeps the largest
    value, so no noise block of either is drawn again. Every variable then
    belongs to the result.

    Args:
        variables: the weights of a private model.
        prior: the ledger to use when none of `variables` has one.

    Returns:
        A `PrivacyLedger`.
    """
    with tf.init_scope():  # Reads values eagerly, also while a step is traced.
        return _for_variables(list(variables), prior)


def _for_variables(variables, prior):
    keys = [id(v) for v in variables]
    found = []
    for key in keys:
        entry = _LEDGER_OF_VARIABLE.get(key)
        if entry is not None and entry[0]() is not None and all(
                entry[1] is not other for other in found):
            found.append(entry[1])
    if found:
        result = found[0]
        for other in found[1:]:
            result.add(other)
    else:
        result = prior or PrivacyLedger()
        copied = _history_of_values(variables)
        if copied is not None and copied is not result:
            result.add(copied)
    new = [v for v, key in zip(variables, keys) if key not in _LEDGER_OF_VARIABLE]
    for variable, key in zip(variables, keys):
        _LEDGER_OF_VARIABLE[key] = (weakref.ref(variable, _forget(key)), result)
    if new:
        _REGISTERED.append(([weakref.ref(v) for v in variables],
                            [np.array(v.numpy()) for v in variables], result))
    return result


def remember_values(variables, privacy_ledger):
    """Remembers that `privacy_ledger`'s steps produced the variables' current
    values (at the end of a fit, and when a private model is saved), so a
    copy of them made later (a base model saved and loaded back) still
    finds that spending after the original trained on."""
    with tf.init_scope():
        values = [np.asarray(v.numpy()) for v in variables]
    if not privacy_ledger.total_steps() or _unchanged_since_registration(variables, values):
        return  # Values no step changed (a seeded model's initial weights).
    digest = _digest(values)
    _REMEMBERED.pop(digest, None)
    _REMEMBERED[digest] = privacy_ledger.state()
    while len(_REMEMBERED) > _MAX_REMEMBERED:
        _REMEMBERED.pop(next(iter(_REMEMBERED)))


def _unchanged_since_registration(variables, values):
    for references, at_registration, _ in _REGISTERED:
        if len(references) == len(variables) and all(
                reference() is variable for reference, variable in zip(references, variables)):
            return _same_arrays(values, at_registration)
    return False


def _digest(values):
    digest = hashlib.sha256()
    for value in values:
        digest.update(str((value.shape, value.dtype)).encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def _history_of_values(variables):
    """The ledger whose steps produced these variables' values, or None."""
    values = [np.asarray(v.numpy()) for v in variables]
    state = _REMEMBERED.get(_digest(values))
    if state is not None and len(state["table"]):
        remembered = PrivacyLedger()
        remembered.restore(state)
        return remembered
    # Sets whose variables are gone are forgotten.
    _REGISTERED[:] = [entry for entry in _REGISTERED
                      if all(reference() is not None for reference in entry[0])]
    for references, at_registration, privacy_ledger in _REGISTERED:
        others = [reference() for reference in references]
        if not privacy_ledger.total_steps() or len(others) != len(values):
            continue
        current = [np.asarray(other.numpy()) for other in others]
        if _same_arrays(values, current) and not _same_arrays(current, at_registration):
            return privacy_ledger
    return None


def _same_arrays(first, second):
    return all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(first, second))


def _forget(key):
    def forget(_):
        _LEDGER_OF_VARIABLE.pop(key, None)
    return forget
