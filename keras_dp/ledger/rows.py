"""The ledger's row format: what one segment of private steps records.

Pure Python (no TensorFlow): a `Segment` is a run of consecutive steps with
one mechanism, and its `row()` is the float64 row the in-graph table
(`keras_dp.ledger.table`) holds. The format follows dp_accounting's
stability rule: columns are only added, at the end, and a table saved
before a column existed reads that column as 0.0 (`with_all_columns`), the
value that keeps its old meaning.
"""

import dataclasses

import dp_accounting
import numpy as np

from keras_dp import noise
from keras_dp import sampling_schemes

# Columns of the segment table (float64). Only ever added at the end: a table
# saved before a column existed reads it as 0.0 (`with_all_columns`).
FIELDS = ("sampling", "sampling_rate", "steps_per_pass", "noise_multiplier",
          "sensitivity", "extra_delta", "batch_size", "num_examples", "num_weights", "unit",
          "max_batch_size")
COLUMN = {name: i for i, name in enumerate(FIELDS)}
# What one segment's guarantee protects. Ledgers saved before the column
# existed read as 0.0: examples.
_UNIT_CODES = {"example": 0.0, "user": 1.0}
# Segments a ledger holds: each change of mechanism starts one.
CAPACITY = 256


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive private steps that ran with one mechanism.

    Args:
        sampling: the name of a `keras_dp.sampling_schemes` scheme: `"poisson"`
            (each example joins each batch independently with probability
            `sampling_rate`), `"shuffle"` (each example is in at most one
            batch per pass; accounted without amplification, one Gaussian
            release per pass), `"cyclic_poisson"` (banded matrix
            factorization's cyclic Poisson sampling: examples in
            `steps_per_pass` = b fixed groups, step t samples group t mod b
            with `sampling_rate`; one Poisson-sampled Gaussian release per
            pass of b steps), `"unknown"` (every step a full release) or
            `"truncated_poisson"` (Poisson sampling truncated to
            `max_batch_size` examples). `scheme` is that type.
        noise_multiplier: sigma: the noise std divided by the clipping norm C
            (and, for correlated noise, by the strategy's largest column
            norm).
        steps: private (logical) steps taken.
        sampling_rate: q for `"poisson"` and `"cyclic_poisson"`; 0.0 for
            `"shuffle"`.
        releases: Gaussian releases of one example: `steps` for schemes
            that release every step, the passes the steps touched for the
            others. None means `steps`.
        sensitivity: how many multiples of C one example can change the
            clipped sum by: 1, or 2 when microbatches hold several examples.
        extra_delta: per-step delta added by truncating padded batches.
        steps_per_pass: logical steps in one pass (shuffle; 0 if unbounded;
            b for cyclic Poisson).
        batch_size: expected logical batch size (for reports; 0 if unknown).
        num_examples: training examples N (for the default delta; 0 if
            unknown).
        num_weights: weights the step noised, for the delta of the noise
            sampler's tail cap (`keras_dp.noise.noise_tail_probability`);
            0 leaves that term out (a statement of prior spending).
        unit: what the guarantee protects: `"example"` (one row), or
            `"user"` (all rows of one user; `sampling_rate`, `batch_size`
            and `num_examples` then count users, and `sensitivity` is per
            user).
        max_batch_size: P of `"truncated_poisson"` (0 for the others).
        history: the id of the ledger whose steps these are (random, drawn
            when the ledger is made; 0 for a statement, or a ledger saved
            before ids were): two ledgers' segments are the same history at
            two times only with the same ids (`is_prefix`). Not part of the
            mechanism, nor of comparisons between segments.

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
    max_batch_size: int = 0
    history: int = dataclasses.field(default=0, compare=False, repr=False)

    def __post_init__(self):
        if self.unit not in _UNIT_CODES:
            raise ValueError(f'Segment unit must be "example" or "user"; received '
                             f"{self.unit!r}.")
        # Review round 99: a stated segment of -20 steps (add, prior_ledger)
        # took the steps that ran out of the epsilon, 0.0 reported for 30.
        for name in ("steps", "releases", "extra_delta", "steps_per_pass", "batch_size",
                     "num_examples", "num_weights", "max_batch_size"):
            value = getattr(self, name)
            if value is not None and not (np.isfinite(value) and value >= 0):
                raise ValueError(f"Segment {name} must be a finite number >= 0; received "
                                 f"{name}={value!r}.")
        scheme = self.scheme  # Refuses a name or parameters it cannot account.
        if self.releases is None or scheme.releases_every_step:
            object.__setattr__(self, "releases", self.steps)

    @property
    def scheme(self):
        """The `keras_dp.sampling_schemes.SamplingScheme` the segment's batches were
        drawn by (its constructor refuses parameters it cannot account)."""
        return sampling_schemes.scheme_of(self.sampling, self.sampling_rate, self.steps_per_pass,
                                  self.num_examples, self.max_batch_size)

    def dp_event(self):
        """This segment as a `dp_accounting` event (its scheme's)."""
        return self.scheme.dp_event(self.noise_multiplier / self.sensitivity, self.releases)

    def accountant_refusal(self, accountant):
        """Refuses an accountant its scheme's event cannot be composed by."""
        self.scheme.accountant_refusal(accountant)

    def summary(self):
        """Its scheme in a few words (reports)."""
        return self.scheme.summary()

    def step_delta(self):
        """Delta each step adds: truncated batches, and the noise tail cap,
        which only a step that uses the example can reveal."""
        if not self.num_weights or self.noise_multiplier == 0:
            return self.extra_delta
        return self.extra_delta + self.scheme.use_probability * noise.noise_tail_probability(
            self.num_weights, self.noise_multiplier, self.sensitivity)

    def same_mechanism(self, other):
        """True when `other` ran with this segment's mechanism."""
        return self.row() == other.row()

    def row(self):
        """The table row of this segment's mechanism (without counts)."""
        values = dict(dataclasses.asdict(self), sampling=self.scheme.code,
                      unit=_UNIT_CODES[self.unit])
        return tuple(float(values[name]) for name in FIELDS)

    @classmethod
    def from_row(cls, row, steps, releases, history=0):
        values = dict(zip(FIELDS, (float(v) for v in row)))
        name = sampling_schemes.scheme_type(values.pop("sampling")).name
        unit = {code: name for name, code in _UNIT_CODES.items()}[values.pop("unit")]
        return cls(name, values.pop("noise_multiplier"), int(steps), unit=unit,
                   releases=int(releases),
                   batch_size=int(values.pop("batch_size")),
                   num_examples=int(values.pop("num_examples")),
                   num_weights=int(values.pop("num_weights")),
                   max_batch_size=int(values.pop("max_batch_size")), history=int(history),
                   **values)


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

    @property
    def batch_size(self):
        return max((s.batch_size for s in self.segments), default=0)

    @property
    def sensitivity(self):
        return max((s.sensitivity for s in self.segments if s.steps), default=1.0)

    @property
    def sampling_rate(self):
        """The smallest of the trial's (0.0 if a run of it was not amplified)."""
        return min((s.sampling_rate for s in self.segments if s.steps), default=0.0)

    def dp_event(self):
        trial = dp_accounting.ComposedDpEvent(tuple(s.dp_event() for s in self.segments))
        return dp_accounting.dp_event.RepeatAndSelectDpEvent(trial, self.mean, self.shape)

    def accountant_refusal(self, accountant):
        """Refuses an accountant that cannot compose a search's event: only
        dp_accounting's RDP accountant composes `RepeatAndSelectDpEvent`.

        Raises:
            ValueError: naming the accountant to use.
        """
        if accountant != "rdp":
            raise ValueError(
                "This privacy ledger holds the trial a hyperparameter search kept "
                "(RepeatAndSelectDpEvent), which dp_accounting composes with its RDP "
                f"accountant only, not accountant={accountant!r}: pass accountant='rdp'.")
        for segment in self.segments:
            segment.accountant_refusal(accountant)

    def summary(self):
        return (f"the best of a search of {self.mean:g} trials on average (shape "
                f"{self.shape:g}), each {len(self.segments)} runs of steps")

    def same_mechanism(self, other):
        return False


# A ledger's selection: [start, end, mean, shape, steps, releases]: segments
# start to end (excluded) are the trial, of whose last segment the first
# `steps` (`releases`) were the trial's; end == 0: none.
NO_SELECTION = np.zeros(6)


def sampling_row(scheme, extra_delta=0.0, batch_size=0, num_examples=0, unit="example"):
    """The sampling part of a table row: the scheme and its parameters (the
    noise and the sensitivity come from the step)."""
    row = [0.0] * len(FIELDS)
    for name, value in (("sampling", scheme.code), ("sampling_rate", scheme.sampling_rate),
                        ("steps_per_pass", scheme.steps_per_pass),
                        ("extra_delta", extra_delta), ("batch_size", batch_size or 0),
                        ("num_examples", num_examples or 0), ("unit", _UNIT_CODES[unit]),
                        ("max_batch_size", scheme.max_batch_size)):
        row[COLUMN[name]] = float(value)
    return row


# Outside fit(), nothing is known of how batches were chosen: every step is a
# full Gaussian release, without amplification.
UNKNOWN_SAMPLING = sampling_row(sampling_schemes.UnknownBatches())


def sampling_mechanism(info, accumulation_steps):
    """The sampling part of a table row for batches drawn as `info` says.

    Args:
        info: the `keras_dp.data.SamplingInfo` of a fit's batches.
        accumulation_steps: physical batches per private step (the
            optimizer's gradient accumulation).

    Returns:
        The row, as `sampling_row` gives it, of `info.scheme(...)`. For
        users, q, the batch size and the count are over users.
    """
    return sampling_row(info.scheme(accumulation_steps), extra_delta=info.extra_delta,
                        batch_size=info.batch_size, num_examples=info.num_units,
                        unit=info.unit)


def full_row(sampling_row, noise_multiplier, step_sensitivity, num_weights):
    """A table row: the sampling part (`sampling_row`) with the step's noise
    (`keras_dp.ledger.table.full_row_in_graph` in the train step)."""
    row = list(sampling_row)
    row[COLUMN["noise_multiplier"]] = float(noise_multiplier)
    row[COLUMN["sensitivity"]] = float(step_sensitivity)
    row[COLUMN["num_weights"]] = float(num_weights)
    return row


def segment_of_row(row):
    """The `Segment` of 0 steps that a step recording `row` would extend or start."""
    return Segment.from_row(row, 0, 0)


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


def extended(segments, segment, steps, releases):
    """`segments` followed by `steps` more steps (`releases` releases) of
    `segment`'s mechanism: what the ledger would hold after them."""
    if segments and segments[-1].same_mechanism(segment):
        last = segments[-1]
        return segments[:-1] + [dataclasses.replace(
            last, steps=last.steps + steps, releases=last.releases + releases)]
    return segments + [dataclasses.replace(segment, steps=steps, releases=releases)]


def releases_of(segment, steps, left_in_pass=0.0):
    """The releases `steps` more steps of `segment`'s mechanism cost, by
    its scheme's rule (`keras_dp.sampling_schemes.SamplingScheme.releases`), which
    `keras_dp.ledger.table.PrivacyLedger.record_step` applies step by step."""
    return segment.scheme.releases(steps, left_in_pass)


def with_all_columns(table):
    """A saved table with the columns added since as zeros (unit: examples)."""
    missing = len(FIELDS) - table.shape[1]
    return np.pad(table, ((0, 0), (0, missing))) if missing > 0 else table


def segments_of(state):
    """The segments of a saved ledger state (`PrivacyLedger.state`)."""
    histories = state.get("histories", np.zeros(len(state["table"]), np.int64))
    return [Segment.from_row(row, steps, releases, history)
            for row, (steps, releases), history in zip(state["table"], state["counts"],
                                                       histories)]


def merged(ours, theirs):
    """The spending of two ledgers: the longer if one is a prefix of the
    other (the same history at two times: the same segments, recorded by
    the same ledgers), else both (review round 38: another run's file of
    the same mechanism, loaded into part of a model, was taken for its own
    history; 4.22 reported against 5.39)."""
    if is_prefix(ours, theirs):
        return theirs
    if is_prefix(theirs, ours):
        return ours
    return ours + theirs


def first_continued(saved, ours):
    """The first position of `saved` from which `ours` continues it: 0
    when `ours` is a later state of `saved`'s history, `len(saved)` when it
    shares no tail of it, else where `ours` branched off (a run resumed
    from an earlier backup of `saved`'s history)."""
    return next(i for i in range(len(saved) + 1) if is_prefix(saved[i:], ours))


def is_prefix(shorter, longer):
    if len(shorter) > len(longer):
        return False
    if not shorter:
        return True
    *head, last = shorter
    other = longer[len(shorter) - 1]
    same_ledgers = all(a.history == b.history for a, b in zip(shorter, longer))
    return (same_ledgers and head == longer[:len(head)] and last.same_mechanism(other)
            and last.steps <= other.steps and last.releases <= other.releases)
