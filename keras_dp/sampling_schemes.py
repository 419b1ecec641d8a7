"""Sampling schemes: how the batches of private steps are drawn, and what that costs.

Each scheme is one frozen type, the one home of what its batches mean for
privacy:

* its name and table code (the ledger's row names the scheme, with its
  parameters in the row's columns);
* its `dp_event`: the `dp_accounting` event of a number of Gaussian releases;
* its release rule: how many releases some more steps cost (`releases`,
  in Python), and whether each step is one (`releases_every_step`, which
  the in-graph ledger reads per code from `RELEASES_EVERY_STEP`);
* the probability that a step uses a given example (`use_probability`,
  which scales the delta of the noise sampler's tail cap);
* what its guarantee assumes, in words (`assumption`);
* its refusals: parameters it cannot account are refused on construction.

Adding a scheme is one type here (plus, if keras-dp draws its batches, the
code that draws them in `keras_dp.data`). Nothing here imports TensorFlow.

Example:
```python
scheme = keras_dp.sampling_schemes.PoissonSampling(sampling_rate=256 / 60000)
event = scheme.dp_event(noise_multiplier=1.1, releases=scheme.releases(14070))
```
"""

import dataclasses
import math
import numbers
from typing import ClassVar

import dp_accounting


@dataclasses.dataclass(frozen=True)
class SamplingScheme:
    """How the batches of a run of private steps were drawn.

    Subclasses set `name`, `code`, `releases_every_step`,
    `random_batch_size`, `accountants` and `assumption`, give `from_columns`
    and `summary`, and override `dp_event` unless their releases are
    unamplified Gaussians.
    """

    name: ClassVar[str]
    code: ClassVar[float]
    # True: every step is a Gaussian release of each example it may hold.
    # False: a release per pass of `steps_per_pass` steps, in which each
    # example joins at most one step.
    releases_every_step: ClassVar[bool]
    # True: the batch size is random, so a step divides its noisy sum by
    # the expected one (the realised size would leak).
    random_batch_size: ClassVar[bool]
    # The dp_accounting accountants that can compose its event.
    accountants: ClassVar[tuple] = ("rdp", "pld")
    # The neighbouring datasets its guarantee compares, and what it
    # assumes of the batches, in words (`keras_dp.accounting.privacy_statement`).
    neighbours: ClassVar[str] = "adding or removing any single example"
    assumption: ClassVar[str]

    @property
    def sampling_rate(self):
        """q, the probability that a step samples a given example (0.0
        for schemes without amplification by sampling)."""
        return 0.0

    @property
    def steps_per_pass(self):
        """Steps in one pass (pass-counted schemes; 0.0: a pass lasts an epoch)."""
        return 0.0

    @property
    def max_batch_size(self):
        """The cap on a batch that the accounting includes (0: none)."""
        return 0

    @property
    def use_probability(self):
        """The probability that one step uses a given example."""
        return self.sampling_rate or 1.0

    @classmethod
    def from_columns(cls, sampling_rate, steps_per_pass, num_examples, max_batch_size):
        """The scheme of a ledger row, from the row's columns (each scheme
        reads those it owns)."""
        return cls()

    def summary(self):
        """The scheme and its parameters in a few words (reports)."""
        raise NotImplementedError

    def dp_event(self, noise_multiplier, releases):
        """The `dp_accounting` event of `releases` Gaussian releases: by
        default unamplified, `SelfComposedDpEvent(GaussianDpEvent(s), releases)`.

        Args:
            noise_multiplier: sigma over the step's sensitivity (in
                multiples of C).
            releases: how many releases of one example ran (`releases`).
        """
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(noise_multiplier), releases)

    def releases(self, steps, left_in_pass=0.0):
        """The Gaussian releases `steps` more steps cost, by the rule the
        in-graph ledger applies step by step: every step for
        `releases_every_step` schemes; otherwise one per pass the steps
        open beyond the `left_in_pass` steps of the pass already counted,
        a pass of unknown length (an epoch) opening one."""
        if self.releases_every_step:
            return steps
        beyond = steps - left_in_pass
        if beyond <= 0:
            return 0
        if self.steps_per_pass:
            return math.ceil(beyond / self.steps_per_pass)
        return 1

    def accountant_refusal(self, accountant):
        """Refuses an accountant that cannot compose this scheme's event.

        Raises:
            ValueError: naming the accountant to use.
        """
        if accountant not in self.accountants:
            raise ValueError(
                f"{type(self).__name__} is accounted by the {' or '.join(self.accountants)} "
                f"accountant only (dp_accounting composes its event there), not "
                f"accountant={accountant!r}: pass accountant={self.accountants[0]!r}.")


@dataclasses.dataclass(frozen=True)
class PoissonSampled(SamplingScheme):
    """A scheme that includes each example independently with probability
    q, amplifying each release: `SelfComposedDpEvent(PoissonSampledDpEvent(q,
    GaussianDpEvent(s)), releases)`.

    Args:
        rate: q in (0, 1].
    """

    rate: float = 1.0

    def __post_init__(self):
        if not 0 < self.rate <= 1:
            raise ValueError(f"A {self.name} segment needs a sampling_rate in (0, 1]; "
                             f"received {self.rate!r}.")

    @property
    def sampling_rate(self):
        return self.rate

    def dp_event(self, noise_multiplier, releases):
        return dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            self.rate, dp_accounting.GaussianDpEvent(noise_multiplier)), releases)


@dataclasses.dataclass(frozen=True)
class PoissonSampling(PoissonSampled):
    """Each example joins each batch independently with probability q.

    DP-SGD's amplification by subsampling: each step is a
    Poisson-subsampled Gaussian mechanism, and T steps compose T of them:
    `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(s)), T)`.

    Args:
        rate: q in (0, 1] (over users for user-level sampling).
    """

    name: ClassVar[str] = "poisson"
    code: ClassVar[float] = 0.0
    releases_every_step: ClassVar[bool] = True
    random_batch_size: ClassVar[bool] = True
    assumption: ClassVar[str] = (
        "It assumes every batch was drawn by Poisson sampling (each example "
        "included independently with probability batch_size / num_examples).")

    @classmethod
    def from_columns(cls, sampling_rate, steps_per_pass, num_examples, max_batch_size):
        return cls(sampling_rate)

    def summary(self):
        return f"Poisson sampling q = {self.rate:.4g}"


@dataclasses.dataclass(frozen=True)
class CyclicPoissonSampling(PoissonSampled):
    """Banded matrix factorization's cyclic Poisson sampling.

    The examples are split into b fixed groups; step t samples only group
    t mod b, each of its examples with probability q = b B / N. An example
    joins at most one of any b consecutive steps, so a pass of b steps is
    one Poisson-subsampled Gaussian release (Choquette-Choo et al. 2023):
    `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(s)),
    passes)`, with s already divided by the strategy's largest column norm.

    Args:
        rate: q in (0, 1].
        groups: b >= 1, the steps of one cycle.
    """

    groups: int = 1
    name: ClassVar[str] = "cyclic_poisson"
    code: ClassVar[float] = 2.0
    releases_every_step: ClassVar[bool] = False
    random_batch_size: ClassVar[bool] = True
    assumption: ClassVar[str] = (
        "It assumes the examples were split into fixed groups sampled in turn, "
        "each example of a group included independently with probability "
        "q (cyclic Poisson sampling).")

    def __post_init__(self):
        super().__post_init__()
        if self.groups < 1:
            raise ValueError(f"A cyclic Poisson scheme needs groups >= 1; received "
                             f"groups={self.groups!r}.")

    @classmethod
    def from_columns(cls, sampling_rate, steps_per_pass, num_examples, max_batch_size):
        return cls(sampling_rate, int(steps_per_pass))

    def summary(self):
        return f"cyclic Poisson sampling of {self.groups} groups, q = {self.rate:.4g}"

    @property
    def steps_per_pass(self):
        return float(self.groups)


@dataclasses.dataclass(frozen=True)
class ShuffledPasses(SamplingScheme):
    """Fixed-size batches of shuffled passes, as the user states them.

    Each example sits in at most one batch per pass. Amplification by
    sampling is not known to hold for shuffling (Chua et al., ICML 2024),
    so each pass is one unamplified Gaussian release:
    `SelfComposedDpEvent(GaussianDpEvent(s), passes)`.

    Args:
        pass_length: steps in one pass; 0 when unknown (a pass lasts an
            epoch).
    """

    pass_length: float = 0.0
    name: ClassVar[str] = "shuffle"
    code: ClassVar[float] = 1.0
    releases_every_step: ClassVar[bool] = False
    random_batch_size: ClassVar[bool] = False
    neighbours: ClassVar[str] = "zeroing out any single example's contribution"
    assumption: ClassVar[str] = (
        "Batches were shuffled fixed-size batches, for which amplification by "
        "sampling is not known to hold, so this is the unamplified bound of one "
        "Gaussian release per pass over the data.")

    @classmethod
    def from_columns(cls, sampling_rate, steps_per_pass, num_examples, max_batch_size):
        return cls(steps_per_pass)

    def summary(self):
        length = f"{self.pass_length:g} steps" if self.pass_length else "an epoch"
        return f"shuffled fixed-size batches, unamplified, a pass of {length}"

    @property
    def steps_per_pass(self):
        return float(self.pass_length)


@dataclasses.dataclass(frozen=True)
class UnknownBatches(SamplingScheme):
    """Batches keras-dp knows nothing of (train_on_batch, a custom loop, a
    dataset it did not sample, without the user's statement).

    Any step may hold any example, so every step is a full, unamplified
    Gaussian release: `SelfComposedDpEvent(GaussianDpEvent(s), steps)`.
    """

    name: ClassVar[str] = "unknown"
    code: ClassVar[float] = 3.0
    releases_every_step: ClassVar[bool] = True
    random_batch_size: ClassVar[bool] = False
    neighbours: ClassVar[str] = "zeroing out any single example's contribution"
    assumption: ClassVar[str] = (
        "Nothing is known of how the batches were chosen, so every step is "
        "counted as a full Gaussian release of every example, without "
        "amplification.")

    def summary(self):
        return "batches keras-dp did not sample, unamplified, every step a release"


@dataclasses.dataclass(frozen=True)
class TruncatedPoissonSampling(PoissonSampled):
    """Poisson sampling with a fixed maximum batch, truncated exactly.

    Each example joins the draw independently with probability q; a draw
    larger than P keeps a uniformly random subset of P of them. Every batch
    then has P rows (one compiled shape, bounded memory), and the
    truncation is part of the mechanism, not a delta: dp_accounting's
    `TruncatedSubsampledGaussianDpEvent(N, q, P, s)` per step, composed
    `SelfComposedDpEvent(..., T)`. dp_accounting composes that event with
    its PLD accountant only.

    Args:
        rate: q in (0, 1].
        truncated_batch_size: P >= 1, the most examples of one batch.
        dataset_size: N, the examples sampled from.
    """

    truncated_batch_size: int = 1
    dataset_size: int = 1
    name: ClassVar[str] = "truncated_poisson"
    code: ClassVar[float] = 4.0
    releases_every_step: ClassVar[bool] = True
    random_batch_size: ClassVar[bool] = True
    accountants: ClassVar[tuple] = ("pld",)
    assumption: ClassVar[str] = (
        "It assumes every batch was drawn by Poisson sampling (each example "
        "included independently with probability batch_size / num_examples), "
        "then truncated to a random subset of max_batch_size examples.")

    def __post_init__(self):
        super().__post_init__()
        for name in ("truncated_batch_size", "dataset_size"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"Truncated Poisson sampling needs an integer {name} >= 1; "
                                 f"received {name}={value!r}.")

    @classmethod
    def from_columns(cls, sampling_rate, steps_per_pass, num_examples, max_batch_size):
        return cls(sampling_rate, int(max_batch_size), int(num_examples))

    def summary(self):
        return (f"truncated Poisson sampling q = {self.rate:.4g}, at most "
                f"{self.truncated_batch_size} examples")

    @property
    def max_batch_size(self):
        return self.truncated_batch_size

    def dp_event(self, noise_multiplier, releases):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.TruncatedSubsampledGaussianDpEvent(
                self.dataset_size, self.rate, self.truncated_batch_size, noise_multiplier),
            releases)


@dataclasses.dataclass(frozen=True)
class StatisticsRelease(SamplingScheme):
    """Gaussian releases of statistics of the whole private dataset
    (`keras_dp.adapt`: a vocabulary, means, quantiles), not of batches.

    Every example may be in each release, so each is one unamplified
    Gaussian release: `SelfComposedDpEvent(GaussianDpEvent(s), releases)`;
    the threshold of a private vocabulary adds its delta as the segment's
    `extra_delta`.
    """

    name: ClassVar[str] = "statistics"
    code: ClassVar[float] = 5.0
    releases_every_step: ClassVar[bool] = True
    random_batch_size: ClassVar[bool] = False
    assumption: ClassVar[str] = (
        "The preprocessing statistics were released with Gaussian noise on sums "
        "over every example.")

    def summary(self):
        return "Gaussian releases of preprocessing statistics (keras_dp.adapt)"


# Every scheme, by table code (a code is never reused).
SCHEMES = (PoissonSampling, ShuffledPasses, CyclicPoissonSampling, UnknownBatches,
           TruncatedPoissonSampling, StatisticsRelease)
_BY_CODE = {scheme.code: scheme for scheme in SCHEMES}
_BY_NAME = {scheme.name: scheme for scheme in SCHEMES}
# `releases_every_step` of each code, in code order: what the in-graph
# ledger gathers by a row's code.
RELEASES_EVERY_STEP = tuple(float(_BY_CODE[float(code)].releases_every_step)
                            for code in range(len(SCHEMES)))


def scheme_of(name_or_code, sampling_rate=0.0, steps_per_pass=0.0, num_examples=0,
              max_batch_size=0):
    """The scheme a ledger row (or a `Segment`) names, with its parameters.

    Args:
        name_or_code: a scheme's `name` (`"poisson"`, `"shuffle"`,
            `"cyclic_poisson"`, `"unknown"`, `"truncated_poisson"`) or
            table `code`.
        sampling_rate: the row's q (Poisson schemes).
        steps_per_pass: the row's steps per pass (shuffled passes; b for
            cyclic Poisson).
        num_examples: the row's N (truncated Poisson).
        max_batch_size: the row's P (truncated Poisson).

    Returns:
        A `SamplingScheme`.

    Raises:
        ValueError: for an unknown name or code, or parameters the scheme
            refuses.
    """
    return scheme_type(name_or_code).from_columns(sampling_rate, steps_per_pass,
                                                  num_examples, max_batch_size)


def scheme_type(name_or_code):
    """The `SamplingScheme` subclass of a name or table code.

    Raises:
        ValueError: naming the known schemes.
    """
    known = _BY_CODE if isinstance(name_or_code, numbers.Real) else _BY_NAME
    key = float(name_or_code) if known is _BY_CODE else name_or_code
    if key not in known:
        raise ValueError(f"Unknown sampling {name_or_code!r}; use one of "
                         f"{', '.join(repr(name) for name in _BY_NAME)}.")
    return known[key]
