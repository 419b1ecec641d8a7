"""What keras-dp knows of a dataset it sampled (`SamplingInfo`), and where its seed came from."""

import dataclasses
import math
import secrets
import weakref

import numpy as np

from keras_dp import sampling_schemes


# Where the seed of a dataset's draws came from (`SamplingInfo.seed_source`):
# given by the user, or drawn from OS entropy (`secrets`). "numpy" (numpy's
# global generator, which `keras.utils.set_random_seed` fixes) is no longer
# drawn, and read only in infos made by older code.
SEED_SOURCES = ("user", "numpy", "os")


# What a guarantee protects (`SamplingInfo.unit`): one example (row), or every
# row of one user.
UNITS = ("example", "user")


# Sampling description of each dataset made by `poisson_dataset`. Weak keys:
# the entry disappears with the dataset.
_SAMPLING_INFO = weakref.WeakKeyDictionary()
# The graphs of the maps a Poisson dataset's examples went through.
_SOURCE_FUNCTIONS = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class SamplingInfo:
    """How training batches are drawn: what the privacy accountant needs.

    Args:
        sampling: `"poisson"` (each example joins each batch independently
            with probability `batch_size / num_examples`) or `"shuffle"`
            (fixed-size batches of a shuffled dataset).
        batch_size: expected logical batch size B.
        num_examples: size N of the private training set, if known.
        extra_delta: probability, PER STEP, that the sampled batch was
            truncated to the cap. The accountant multiplies it by the number
            of steps and adds it to delta. 0.0 for shuffling.
        physical_batch_size: the cap P: the most rows of one padded physical
            batch, or None.
        padding_multiple: the padding bucket: a logical batch's rows are
            padded to a multiple of it (or to the cap), or None.
        steps_per_epoch: number of logical batches in one pass, or None.
        accumulation_steps: physical batches each logical batch is split
            into (for DP gradient accumulation); `batch_size` is the logical
            size and `physical_batch_size` the shape of one physical batch.
        num_replicas: replicas each physical batch is split evenly over
            (`tf.distribute`); `physical_batch_size` is over all of them.
        num_microbatches: the microbatches (per replica) whose groups the
            batches are laid out in, or None.
        epoch_is_one_pass: for shuffled batches, whether an epoch holds
            each example at most once; if not, every step is accounted as
            a pass of its own.
        seed: the seed of the draws (never printed), which every worker
            must share.
        seed_source: where `seed` came from, one of `SEED_SOURCES`, or None
            (no seed, as for shuffled batches).
        passes: the `keras_dp.data.poisson.Passes` of the dataset's draws,
            which the ledger raises past the passes spent with `seed`.
        unit: what the guarantee protects, one of `UNITS`: `"example"`
            (one row) or `"user"` (all rows of one user: `user_dataset`).
            For `"user"`, `batch_size` counts users, and each sampled user is
            `rows_per_unit` consecutive rows of a batch.
        rows_per_unit: k, the rows each sampled unit occupies (1 for
            examples; for users, their at most k rows, padded).
        num_users: the number of users U_total for `unit="user"`, else None.
        users_digest: `user_digest` of the user ids (`unit="user"`), by
            which a model's ledger refuses later fits over other users.
        participation_groups: b, the fixed groups of cyclic Poisson
            sampling (`poisson_dataset(participation_groups=b)`): logical
            step t samples only group t mod b, with q = b * B / N; 1 for
            plain Poisson sampling.
    """

    sampling: str
    batch_size: int
    num_examples: int | None = None
    extra_delta: float = 0.0
    physical_batch_size: int | None = None
    padding_multiple: int | None = None
    steps_per_epoch: int | None = None
    accumulation_steps: int = 1
    num_replicas: int = 1
    num_microbatches: int | None = None
    epoch_is_one_pass: bool = True
    seed: int | None = dataclasses.field(default=None, repr=False)
    seed_source: str | None = None
    unit: str = "example"
    rows_per_unit: int = 1
    num_users: int | None = None
    users_digest: str | None = dataclasses.field(default=None, repr=False)
    participation_groups: int = 1
    passes: object = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if sampling_schemes.scheme_type(self.sampling) not in _DRAWN_OR_STATED:
            raise ValueError(
                'sampling must be "poisson", "shuffle" or "truncated_poisson"; received '
                f"sampling={self.sampling!r}."
            )
        if self.seed_source not in (None, *SEED_SOURCES):
            raise ValueError(f"seed_source must be one of {SEED_SOURCES} or None; received "
                             f"seed_source={self.seed_source!r}.")
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}; received unit={self.unit!r}.")

    @property
    def num_units(self):
        """The number of units sampling draws from: users or examples."""
        return self.num_users if self.unit == "user" else self.num_examples

    @property
    def sampling_rate(self):
        """q = B / N over units (users for `unit="user"`; b * B / N for b
        participation groups), or None when their number is unknown."""
        if not self.num_units:
            return None
        return self.participation_groups * self.batch_size / self.num_units

    def scheme(self, accumulation_steps=1):
        """The `keras_dp.sampling_schemes.SamplingScheme` of these batches.

        Args:
            accumulation_steps: physical batches per private step (the
                optimizer's gradient accumulation), which shuffled passes
                of known length count in.

        Returns:
            Poisson sampling (cyclic with participation groups, truncated
            for `"truncated_poisson"`), or shuffled passes: of
            `ceil(ceil(N / B) / accumulation_steps)` steps when N and B are
            known, an epoch when not; unknown batches (every step a full
            release) when an epoch may see an example more than once.
        """
        kind = sampling_schemes.scheme_type(self.sampling)
        if not self.epoch_is_one_pass:  # An epoch may hold an example twice.
            return sampling_schemes.UnknownBatches()
        if kind is sampling_schemes.ShuffledPasses:
            return sampling_schemes.ShuffledPasses(self._steps_per_pass(accumulation_steps))
        if kind is sampling_schemes.TruncatedPoissonSampling:
            return sampling_schemes.TruncatedPoissonSampling(self.sampling_rate, self.batch_cap,
                                                     self.num_units)
        if self.participation_groups > 1:
            return sampling_schemes.CyclicPoissonSampling(self.sampling_rate,
                                                          self.participation_groups)
        return sampling_schemes.PoissonSampling(self.sampling_rate)

    @property
    def draws_batch_size(self):
        """Whether the batch size is random (drawn by sampling), so that a
        step divides by its expected value, never the realised one."""
        return sampling_schemes.scheme_type(self.sampling).random_batch_size

    @property
    def batch_cap(self):
        """P, the most units of one logical batch (truncated Poisson), else 0."""
        return self.physical_batch_size * self.accumulation_steps // self.rows_per_unit

    def _steps_per_pass(self, accumulation_steps):
        if self.num_examples and self.batch_size:
            return float(math.ceil(math.ceil(self.num_examples / self.batch_size)
                                   / accumulation_steps))
        return 0.0  # Unknown: one pass per epoch.


# The schemes whose batches a SamplingInfo describes: drawn by keras-dp, or
# stated by the user (shuffled passes).
_DRAWN_OR_STATED = (sampling_schemes.PoissonSampling, sampling_schemes.ShuffledPasses,
                    sampling_schemes.TruncatedPoissonSampling)


def attach_source_functions(dataset, graphs):
    """Records the traced graphs of the maps and filters a dataset keras-dp
    made read its examples through (they ran once, when it was made, and
    are not among its inputs), weakly held as `attach`'s."""
    _SOURCE_FUNCTIONS[dataset] = tuple(graphs)


def source_functions_of(dataset):
    """The graphs `attach_source_functions` recorded for `dataset` (none for
    any other object)."""
    try:
        return _SOURCE_FUNCTIONS.get(dataset, ())
    except TypeError:  # Not weakly referenceable, so never registered.
        return ()


def attach(dataset, info):
    """Records `info` as the `SamplingInfo` of a dataset keras-dp made
    (weakly held: the entry goes with the dataset)."""
    _SAMPLING_INFO[dataset] = info


def sampling_info_of(dataset):
    """Returns the `SamplingInfo` of a dataset made by `poisson_dataset`.

    Args:
        dataset: any object.

    Returns:
        The `SamplingInfo` attached by `poisson_dataset`, or None for any other
        object, including datasets derived from a Poisson one (`.map`,
        `.repeat`, ...), whose batches may no longer be Poisson samples.
    """
    try:
        return _SAMPLING_INFO.get(dataset)
    except TypeError:  # Not weakly referenceable, so never registered.
        return None


def seed_and_source(seed, secure_mode):
    """The seed of `poisson_dataset`'s draws and its `SamplingInfo.seed_source`.

    Args:
        seed: the user's seed, or None.
        secure_mode: whether the seed must come from OS entropy.

    Returns:
        `(seed, seed_source)`.

    Raises:
        ValueError: for a seed with `secure_mode`, or a seed that is not an
            integer >= 0.
    """
    if secure_mode:
        if seed is not None:
            raise ValueError(
                "poisson_dataset(secure_mode=True) draws its seed from OS entropy, so "
                "that no known seed reveals which examples a batch holds; received "
                f"seed={seed!r}. Pass seed=None, or secure_mode=False for reproducible "
                "(not secure) batches.")
        return secrets.randbits(62), "os"
    if seed is None:  # Never a global generator's: a set seed would replay draws.
        return secrets.randbits(62), "os"
    check_int("seed", seed, minimum=0)
    return seed, "user"


def check_secure_sampling(info, secure_mode):
    """Refuses batches whose draws can be recomputed, for a `secure_mode` optimizer.

    Amplification by subsampling assumes nobody knows which examples each
    batch holds; `secure_mode=True` promises that no seed can reveal it, so
    a Poisson dataset's seed must come from OS entropy.

    Args:
        info: the `SamplingInfo` of the training data, or None (data not
            made by `poisson_dataset`, whose epsilon claims no amplification
            by Poisson sampling).
        secure_mode: the optimizer's `secure_mode`.

    Raises:
        ValueError: with `secure_mode`, for Poisson batches whose seed was
            given or drawn from numpy's global generator.
    """
    if not secure_mode or info is None or info.seed_source is None:
        return
    if info.seed_source != "os":
        origin = {"user": "was given", "numpy": "came from numpy's global generator"}.get(
            info.seed_source, "is of unknown origin")
        raise ValueError(
            f"The optimizer has secure_mode=True, but the seed of this Poisson "
            f"dataset's batches {origin}, so whoever knows it can recompute which "
            "examples each batch holds. Make the dataset with "
            "keras_dp.data.poisson_dataset(..., secure_mode=True) and no seed.")


def check_int(name, value, minimum, maximum=None, minimum_name=None, maximum_name=None):
    """Raises a ValueError naming `name` unless minimum <= value <= maximum."""
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if is_int and minimum <= value and (maximum is None or value <= maximum):
        return
    bounds = ">= " + _bound(minimum, minimum_name)
    if maximum is not None:
        bounds += " and <= " + _bound(maximum, maximum_name)
    raise ValueError(f"{name} must be an integer {bounds}; received {name}={value!r}.")


def _bound(value, name):
    return f"{name} ({value})" if name else str(value)
