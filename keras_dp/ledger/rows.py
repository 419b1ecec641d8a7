"""The ledger's row format: what one segment of private steps records.

Pure Python (no TensorFlow): a `Segment` is a run of consecutive steps with
one mechanism, and its `row()` is the float64 row the in-graph table
(`keras_dp.ledger.table`) holds. The format follows dp_accounting's
stability rule: columns are only added, at the end, and a table saved
before a column existed reads that column as 0.0 (`with_all_columns`), the
value that keeps its old meaning.
"""

import dataclasses
import math

import dp_accounting
import numpy as np

from keras_dp import clipping

# Columns of the segment table (float64).
FIELDS = ("sampling", "sampling_rate", "steps_per_pass", "noise_multiplier",
          "sensitivity", "extra_delta", "batch_size", "num_examples", "num_weights", "unit")
COLUMN = {name: i for i, name in enumerate(FIELDS)}
SAMPLING_CODES = {"poisson": 0.0, "shuffle": 1.0, "cyclic_poisson": 2.0}
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
        if self.sampling not in SAMPLING_CODES:
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
        values = dict(dataclasses.asdict(self), sampling=SAMPLING_CODES[self.sampling],
                      unit=_UNIT_CODES[self.unit])
        return tuple(float(values[name]) for name in FIELDS)

    @classmethod
    def from_row(cls, row, steps, releases):
        values = dict(zip(FIELDS, (float(v) for v in row)))
        sampling = {code: name for name, code in SAMPLING_CODES.items()}[values.pop("sampling")]
        unit = {code: name for name, code in _UNIT_CODES.items()}[values.pop("unit", 0.0)]
        return cls(sampling, values.pop("noise_multiplier"), int(steps), unit=unit,
                   releases=int(releases),
                   batch_size=int(values.pop("batch_size")),
                   num_examples=int(values.pop("num_examples")),
                   num_weights=int(values.pop("num_weights")), **values)


def mechanism(sampling, sampling_rate=0.0, steps_per_pass=0.0, extra_delta=0.0,
              batch_size=0, num_examples=0, unit="example"):
    """The sampling part of a table row (noise and sensitivity come from the step)."""
    return [SAMPLING_CODES[sampling], sampling_rate, steps_per_pass, 0.0, 0.0,
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
    """A table row: the sampling part (`mechanism`) with the step's noise
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


def with_all_columns(table):
    """A saved table with the columns added since as zeros (unit: examples)."""
    missing = len(FIELDS) - table.shape[1]
    return np.pad(table, ((0, 0), (0, missing))) if missing > 0 else table


def segments_of(state):
    """The segments of a saved ledger state (`PrivacyLedger.state`)."""
    return [Segment.from_row(row, steps, releases)
            for row, (steps, releases) in zip(state["table"], state["counts"])]


def merged(ours, theirs):
    """The spending of two ledgers: the longer if one is a prefix of the
    other (the same history at two times), else both."""
    if is_prefix(ours, theirs):
        return theirs
    if is_prefix(theirs, ours):
        return ours
    return ours + theirs


def is_prefix(shorter, longer):
    if len(shorter) > len(longer):
        return False
    if not shorter:
        return True
    *head, last = shorter
    other = longer[len(shorter) - 1]
    return (head == longer[:len(head)] and last.same_mechanism(other)
            and last.steps <= other.steps and last.releases <= other.releases)
