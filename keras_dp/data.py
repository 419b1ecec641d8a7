"""Poisson-sampled datasets: the batching that DP-SGD's privacy analysis assumes.

The accountant amplifies privacy by subsampling under the assumption that
every example joins every batch independently with probability q = B / N.
Shuffling and slicing into fixed-size batches is a different mechanism, for
which reporting the Poisson epsilon is unsound. `poisson_dataset` draws
batches the honest way (in O(B) a batch: the gaps between sampled examples
are independent geometric draws, `_sampled_slots`) and pads each one with
rows of sample weight 0 (copies of a real row of the batch), which
contribute exactly zero gradient, up to the
next multiple of a padding bucket (about B / 16 rows): a few percent of
extra rows instead of padding every batch to its largest size. The batch
dimension is unknown to the traced train step (traced once per fit); XLA
compiles one program per bucket it meets.

A Poisson batch is larger than a cap P with a tiny probability eta per step.
Such a batch is truncated to P rows; the truncated mechanism differs from
the untruncated one only on an event of probability eta, so it is
(epsilon, delta + eta)-DP per step, and T steps add T * eta to delta. The
per-step eta is `SamplingInfo.extra_delta`.
"""

import dataclasses
import hashlib
import math
import secrets
import weakref

import numpy as np
import tensorflow as tf

from keras_dp import sampling_schemes

# Default bound on the per-step probability that a batch exceeds its padding.
DEFAULT_TRUNCATION_PROBABILITY = 1e-12

# The most bytes of examples `poisson_dataset` copies out of a tf.data.Dataset.
DEFAULT_MAX_DATASET_BYTES = 2 * 1024**3
# Examples read from a tf.data.Dataset at a time while copying it.
_COPY_CHUNK = 1024

# Where the seed of a dataset's draws came from (`SamplingInfo.seed_source`):
# given by the user, drawn from numpy's global generator (which
# `keras.utils.set_random_seed` fixes, so anyone who knows that seed can
# recompute the batches), or drawn from OS entropy (`secrets`).
SEED_SOURCES = ("user", "numpy", "os")

# What a guarantee protects (`SamplingInfo.unit`): one example (row), or every
# row of one user.
UNITS = ("example", "user")

# Rows a user brings to a step unless told otherwise (`user_dataset`).
DEFAULT_MAX_EXAMPLES_PER_USER = 8
# Tells the random stream of `user_dataset`'s row selection from its batches'.
_SELECTION_STREAM = 0x5E1EC7

# Sampling description of each dataset made by `poisson_dataset`. Weak keys:
# the entry disappears with the dataset.
_SAMPLING_INFO = weakref.WeakKeyDictionary()


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
            return sampling_schemes.CyclicPoissonSampling(self.sampling_rate, self.participation_groups)
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


def truncation_probability(num_examples, expected_batch_size, physical_batch_size):
    """Probability that one Poisson batch has more than `physical_batch_size` rows.

    That is P(Binomial(N, q) > P) with q = B / N, computed in log space.

    Args:
        num_examples: N, the number of training examples.
        expected_batch_size: B, the expected batch size.
        physical_batch_size: P >= B, the padded batch size.

    Returns:
        A float: the per-step probability that the batch is truncated, i.e.
        the delta added by each step. Rounding aside, it is never
        under-estimated.

    Example:
    ```python
    eta = keras_dp.data.truncation_probability(60000, 256, 400)
    ```
    """
    _check_int("num_examples", num_examples, minimum=1)
    _check_int("expected_batch_size", expected_batch_size, minimum=1,
               maximum=num_examples, maximum_name="num_examples")
    _check_int("physical_batch_size", physical_batch_size,
               minimum=expected_batch_size, minimum_name="expected_batch_size")
    return _binomial_upper_tail(num_examples, expected_batch_size / num_examples,
                                physical_batch_size + 1)


def poisson_dataset(x, y=None, sample_weight=None, *, expected_batch_size, seed=None,
                    max_batch_size=None, steps_per_epoch=None, num_microbatches=None,
                    accumulation_steps=1, num_replicas=1, padding_multiple=None,
                    secure_mode=False, participation_groups=1,
                    max_dataset_bytes=DEFAULT_MAX_DATASET_BYTES):
    """A `tf.data.Dataset` of Poisson-sampled batches, padded to a few sizes.

    In each batch every example is included independently with probability
    q = expected_batch_size / N. The included rows come first, followed by
    padding rows with sample weight 0 (copies of the batch's first real row,
    so that preprocessing layers see real values) up to the next multiple of
    `padding_multiple`, never beyond the cap `max_batch_size`. With
    microbatches, each microbatch is a fixed group of examples (see
    `num_microbatches`), laid out the same way within its own slots, all
    padded to the cap. Each pass over
    the dataset yields `steps_per_epoch` batches and draws fresh ones: passes
    differ from each other, yet the whole sequence is reproducible with a
    `seed`. Train with `fit(dataset, epochs=...)`; the private model reads the
    sampling from `sampling_info_of(dataset)`.

    Args:
        x: inputs: a numpy array, or a dict / list / tuple of arrays, all
            with the same first dimension N. Or an UNBATCHED, finite
            `tf.data.Dataset` of examples, `(x, y)`, `(x, y, sample_weight)`
            or `x` alone (as `keras.utils.image_dataset_from_directory(...,
            batch_size=None)` gives), with `y` and `sample_weight` None: its
            examples, after every map of the pipeline, are copied into
            memory once (at most `max_dataset_bytes`) and sampled like
            arrays, with the epsilon of the same arrays. A map with a random
            op (augmentation) then runs once per example: put augmentation
            in the model instead.
        y: targets, structured like Keras targets, or None.
        sample_weight: per-example weights (an array or a structure of arrays
            matching y), or None for weight 1.0 on every real row.
        expected_batch_size: B, the expected number of examples per batch,
            1 <= B <= N. The private step divides the noisy gradient sum by B.
        seed: int for reproducible batches. Without it a seed is drawn from
            numpy's global generator (so `keras.utils.set_random_seed` makes
            runs reproducible), or from OS entropy with `secure_mode`. The
            privacy analysis assumes the adversary does not know which
            examples were sampled: do not publish it.
        max_batch_size: the cap P >= B on the rows of a (logical) batch;
            sampled examples beyond it are dropped. By default the smallest
            P whose per-step truncation probability is at most
            `DEFAULT_TRUNCATION_PROBABILITY` (1e-12).
        steps_per_epoch: batches per pass; default ceil(N / B), so a pass
            sees each example once in expectation.
        num_microbatches: None, or the optimizer's `num_microbatches` m
            (per replica). Each physical batch is then m (per replica)
            microbatches whose members do not depend on which other
            examples were sampled: example i belongs to group
            i mod (m * accumulation_steps * num_replicas), each group has its
            own slots, and one example joining or
            leaving changes one microbatch only (sensitivity 2C: the clipped
            mean of a group with and without it). The truncation
            probability is the sum over the groups.
        accumulation_steps: k, the optimizer's `gradient_accumulation_steps`.
            Each Poisson batch (of expected size B, the LOGICAL batch) is
            split into k consecutive physical batches of P / k rows, so an
            example joins at most one of the k batches whose clipped sums are
            noised together. The dataset then yields k * steps_per_epoch
            batches per pass.
        num_replicas: R, the replicas of a `tf.distribute` strategy
            (`strategy.num_replicas_in_sync`). Each physical batch is split
            into R equal consecutive blocks of rows, one per replica (as the
            strategy splits it), and with microbatches each block holds
            `num_microbatches` whole groups. Under several workers, give
            every worker the same seed: each takes its replicas' blocks of
            the same draw.
        padding_multiple: the padding bucket, a multiple of
            `accumulation_steps * num_replicas` (so every physical batch and
            replica share is equal). Default: B / 16 rounded to a multiple of
            lcm(8, `accumulation_steps * num_replicas`), at least one (B =
            256: 16 rows, 3% padding on average, and the batches fall in
            about ten sizes). A value >= P pads every batch to P: one shape,
            whose running time shows nothing of the batch size. With
            `num_microbatches` the batches are always padded to P: a
            microbatch's loss is a mean over its slots, so slots that varied
            with the draw would let one example move every microbatch.
        secure_mode: True draws the seed from OS entropy (`secrets`), so
            that no seed set elsewhere (`keras.utils.set_random_seed`)
            reveals which examples each batch holds; `seed` must then be
            None. Required by an optimizer with `secure_mode=True` (see
            `check_secure_sampling`).
        participation_groups: b >= 1. With b > 1 (cyclic Poisson sampling,
            for `keras_dp.BandedMF(bands=b)`), the examples are split into b
            fixed groups by a permutation drawn from `seed`; the t-th logical
            batch of a pass samples only group t mod b, each of its examples
            with probability q = b * B / N (so b * B <= N), so an example
            joins at most one of any b consecutive logical batches. The
            default `steps_per_epoch` is rounded up to a multiple of b, and
            a given one must be one, so the cycle runs on across passes.
        max_dataset_bytes: the most bytes of examples copied out of a
            `tf.data.Dataset` `x` (default `DEFAULT_MAX_DATASET_BYTES`, 2 GiB).

    Returns:
        A `tf.data.Dataset` whose elements are `(x, y, sample_weight)` batches
        (y is None when no targets are given) of unknown leading dimension
        (of P with microbatches or `padding_multiple` >= P).

    Example:
    ```python
    dataset = keras_dp.data.poisson_dataset(x_train, y_train,
                                            expected_batch_size=256)
    private.fit(dataset, epochs=60)
    info = keras_dp.data.sampling_info_of(dataset)  # q, P, extra_delta, ...

    # An unbatched pipeline of examples: its maps run once, before sampling.
    images = keras.utils.image_dataset_from_directory("images/", batch_size=None)
    dataset = keras_dp.data.poisson_dataset(images, expected_batch_size=256)
    ```
    """
    if isinstance(x, tf.data.Dataset) and y is None and sample_weight is None:
        x, y, sample_weight = examples_of(x, max_dataset_bytes)
    data, num_examples = _to_tensors(x, y, sample_weight)
    _check_participation_groups(participation_groups, expected_batch_size, num_examples,
                                num_microbatches)
    return _sampled_batches(
        data, num_examples, expected_batch_size, seeds=_seed_and_source(seed, secure_mode),
        max_batch_size=max_batch_size,
        steps_per_epoch=steps_per_epoch, num_microbatches=num_microbatches,
        accumulation_steps=accumulation_steps, num_replicas=num_replicas,
        padding_multiple=padding_multiple, participation_groups=participation_groups)


def _sampled_batches(data, num_units, expected_batch_size, *, seeds, max_batch_size,
                     steps_per_epoch, num_microbatches, accumulation_steps, num_replicas,
                     padding_multiple, unit_rows=None, participation_groups=1):
    """`poisson_dataset` and `user_dataset`: Poisson batches over `num_units`
    units, each unit the row of `data` it indexes, or, given `unit_rows`
    (`[num_units + 1, k]` row indices, the last one all padding), k rows;
    in `participation_groups` cyclic groups (see `poisson_dataset`)."""
    unit = "example" if unit_rows is None else "user"
    _check_int("expected_batch_size", expected_batch_size, minimum=1,
               maximum=num_units, maximum_name=f"the number of {unit}s")
    _check_int("accumulation_steps", accumulation_steps, minimum=1)
    _check_int("num_replicas", num_replicas, minimum=1)
    if num_microbatches is not None:
        _check_int("num_microbatches", num_microbatches, minimum=1)
    rate = participation_groups * expected_batch_size / num_units
    # The largest population one step samples from.
    population = -(-num_units // participation_groups)
    # A draw is cut into k physical batches, each into R replica blocks.
    blocks = accumulation_steps * num_replicas
    # Without microbatches the blocks of a draw are summed unit by unit, so
    # one group (index order, then padding) serves.
    groups = num_microbatches * blocks if num_microbatches else 1
    if max_batch_size is None:
        slots = _default_group_slots(population, rate, groups)
        max_batch_size = -(-slots * groups // blocks) * blocks
    if max_batch_size % math.lcm(groups, blocks):
        raise ValueError(
            f"max_batch_size={max_batch_size} must be a multiple of "
            f"accumulation_steps={accumulation_steps} times num_replicas="
            f"{num_replicas} and of the {groups} microbatch groups, which split "
            "each batch.")
    _check_int("max_batch_size", max_batch_size, minimum=expected_batch_size,
               minimum_name="expected_batch_size")
    padding_multiple = _checked_padding_multiple(padding_multiple, expected_batch_size,
                                                 blocks, num_microbatches, max_batch_size)
    if steps_per_epoch is None:
        cycles = math.ceil(math.ceil(num_units / expected_batch_size) / participation_groups)
        steps_per_epoch = cycles * participation_groups
    _check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    if steps_per_epoch % participation_groups:
        raise ValueError(
            f"steps_per_epoch={steps_per_epoch} is not a multiple of participation_groups="
            f"{participation_groups}: the next pass would restart the cycle of groups, "
            "and an example could join two steps less than b apart. Give a multiple "
            "of it, or leave steps_per_epoch out.")
    seed, seed_source = seeds
    cyclic = None
    if participation_groups > 1:
        cyclic = (tf.constant(_members_of_participation_groups(
            _participation_groups_of(num_units, participation_groups, seed), num_units)),
                  participation_groups)

    make_batch = _batch_maker(data, num_units, rate, groups, max_batch_size // groups,
                              padding_multiple, unit_rows, cyclic)
    dataset = _draws(seed, steps_per_epoch, make_batch)
    if accumulation_steps > 1:
        # flat_map hides the length from Keras, which would then warn that
        # the input "ran out of data" at every epoch end.
        dataset = dataset.flat_map(_splitter(accumulation_steps)).apply(
            tf.data.experimental.assert_cardinality(accumulation_steps * steps_per_epoch))
    dataset = dataset.prefetch(tf.data.AUTOTUNE).with_options(_EVERY_WORKER_EVERY_BATCH)
    rows_per_unit = 1 if unit_rows is None else int(unit_rows.shape[1])
    num_rows = _num_rows_of(data)
    _SAMPLING_INFO[dataset] = SamplingInfo(
        sampling="poisson",
        batch_size=expected_batch_size,
        num_examples=num_rows,
        extra_delta=_grouped_truncation_probability(population, rate, groups,
                                                    max_batch_size // groups),
        physical_batch_size=max_batch_size * rows_per_unit // accumulation_steps,
        padding_multiple=padding_multiple * rows_per_unit,
        steps_per_epoch=steps_per_epoch,
        accumulation_steps=accumulation_steps,
        num_replicas=num_replicas,
        num_microbatches=num_microbatches,
        seed=seed,
        seed_source=seed_source,
        unit=unit,
        rows_per_unit=rows_per_unit,
        num_users=None if unit_rows is None else num_units,
        participation_groups=participation_groups,
    )
    return dataset


def examples_of(dataset, max_bytes=DEFAULT_MAX_DATASET_BYTES):
    """The examples of an unbatched, finite `tf.data.Dataset`, as tensors.

    Runs the pipeline once (every map included) and stacks its elements.

    Args:
        dataset: a `tf.data.Dataset` whose elements are single examples:
            `(x, y)`, `(x, y, sample_weight)` or `x` (a tensor or a dict).
        max_bytes: the most bytes of examples to copy.

    Returns:
        `(x, y, sample_weight)`: tensors (or structures of them) whose first
        dimension is the number of examples; y and sample_weight may be None.

    Raises:
        ValueError: for a batched, repeating or infinite dataset, one
            larger than `max_bytes`, or examples of different shapes.

    Example:
    ```python
    x, y, _ = keras_dp.data.examples_of(
        tf.data.Dataset.from_tensor_slices((images, labels)).map(preprocess))
    ```
    """
    _check_examples_dataset(dataset)
    try:
        chunks = _copied_chunks(dataset, max_bytes)
        stacked = tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *chunks)
    except tf.errors.InvalidArgumentError as error:
        raise ValueError(
            "The examples of this tf.data.Dataset differ in shape, so they cannot be "
            "stacked into one batch of examples to sample from. Give them one shape "
            "in the pipeline (image_size=..., TextVectorization(output_sequence_length="
            "...), padding).") from error
    if isinstance(stacked, tuple) and len(stacked) in (2, 3):
        return (*stacked, None) if len(stacked) == 2 else stacked
    return stacked, None, None


def _copied_chunks(dataset, max_bytes):
    """The dataset's examples in chunks of `_COPY_CHUNK`, at most `max_bytes`."""
    chunks, size = [], 0
    for chunk in dataset.batch(_COPY_CHUNK):
        size += sum(_nbytes(leaf) for leaf in tf.nest.flatten(chunk))
        if size > max_bytes:
            raise ValueError(
                f"This tf.data.Dataset holds more than max_dataset_bytes={max_bytes} bytes "
                "of examples, which poisson_dataset copies into memory to sample them. "
                "Pass poisson_dataset(..., max_dataset_bytes=...) a larger limit if "
                "memory allows, or shrink the examples in the pipeline (smaller images, "
                "uint8 pixels rescaled in the model).")
        chunks.append(chunk)
    if not chunks:
        raise ValueError("This tf.data.Dataset holds no example: poisson_dataset needs at "
                         "least one.")
    return chunks


def _check_examples_dataset(dataset):
    """Refuses a pipeline whose elements are not each one example, once."""
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "This tf.data.Dataset is infinite (it repeats), so its examples cannot be "
            "counted: the sampling rate q = B / N needs N. Drop .repeat(): each "
            "pass of keras-dp's batches draws anew.")
    if _repeats_elements(dataset):
        raise ValueError(
            "This tf.data.Dataset repeats its examples (or its graph cannot be read to "
            "tell), so one person could be several examples of the sampled set, each "
            "moving the sum by C. Drop .repeat() (each pass of keras-dp's batches "
            "draws anew), or pass the examples as arrays.")
    if is_batched(dataset):
        raise ValueError(
            "This tf.data.Dataset is batched; poisson_dataset draws its own batches "
            "from a dataset of single examples. Make it without batching "
            "(image_dataset_from_directory(..., batch_size=None), "
            "text_dataset_from_directory(..., batch_size=None), or no .batch()), or "
            "call .unbatch() on it.")


def is_batched(dataset):
    """Whether a tf.data pipeline's elements are batches, not single examples:
    it batches (or is a `poisson_dataset`) and no unbatch follows.

    Args:
        dataset: a `tf.data.Dataset`.

    Returns:
        A bool, read from the chain of transformations (not from shapes).
    """
    current = dataset
    while isinstance(current, tf.data.Dataset):
        name = type(current).__name__
        if "Unbatch" in name:
            return False
        if "Batch" in name or sampling_info_of(current) is not None:
            return True
        current = getattr(current, "_input_dataset", None)
    return False


def _repeats_elements(dataset):
    """Whether a pipeline holds a repeat (which duplicates its examples); True
    when its graph cannot be read to tell."""
    try:
        graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph(
            external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE).numpy())
    except (tf.errors.OpError, ValueError, TypeError):
        return True
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return any("Repeat" in node.op for node in nodes)


def _nbytes(tensor):
    """Bytes of a tensor's values (of its strings' bytes for tf.string)."""
    if tensor.dtype == tf.string:
        return int(tf.reduce_sum(tf.strings.length(tensor)))
    return int(tf.size(tensor)) * tensor.dtype.size


def _draws(seed, steps_per_epoch, make_batch):
    """The dataset of a pass's `steps_per_epoch` batches, each
    `make_batch(step, stateless_seed)`, `step` its place in the pass.

    Two random 32-bit words per step form the step's stateless seed. The
    random stream is re-seeded on every pass, so each epoch draws fresh
    batches while the sequence of passes is fixed by `seed`.
    """
    return (
        tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)
        .batch(2)
        .take(steps_per_epoch)
        .enumerate()
        .map(make_batch, num_parallel_calls=tf.data.AUTOTUNE)
    )


def truncated_poisson_dataset(x, y=None, sample_weight=None, *, expected_batch_size,
                              max_batch_size, seed=None, steps_per_epoch=None,
                              secure_mode=False, max_dataset_bytes=DEFAULT_MAX_DATASET_BYTES):
    """Poisson-sampled batches truncated to a fixed maximum: one shape.

    Each example joins a draw independently with probability
    q = expected_batch_size / N; a draw of more than P = `max_batch_size`
    examples keeps a uniformly random subset of P of them. Every batch has
    exactly P rows (the draw, then padding rows of sample weight 0), so the
    private step has one compiled shape (one XLA program) and bounded
    memory, and the truncation is accounted exactly, as part of the
    mechanism (`keras_dp.sampling_schemes.TruncatedPoissonSampling`:
    dp_accounting's `TruncatedSubsampledGaussianDpEvent`), not as a delta.
    dp_accounting composes that event with its PLD accountant only: read
    the spending with `privacy_spent(accountant="pld")` and
    `PrivacyCallback(accountant="pld")`.

    Args:
        x: inputs: a numpy array, or a dict / list / tuple of arrays, all
            with the same first dimension N; or an unbatched
            `tf.data.Dataset` of examples, as for `poisson_dataset`.
        y: targets, structured like Keras targets, or None.
        sample_weight: per-example weights, or None for weight 1.0.
        expected_batch_size: B, 1 <= B <= N: the private step divides the
            noisy gradient sum by B.
        max_batch_size: P, B <= P <= N: the rows of every batch.
        seed: as for `poisson_dataset`.
        steps_per_epoch: batches per pass; default ceil(N / B).
        secure_mode: as for `poisson_dataset`.
        max_dataset_bytes: as for `poisson_dataset`.

    Returns:
        A `tf.data.Dataset` of `(x, y, sample_weight)` batches of P rows.
        Optimizers with microbatches or gradient accumulation, and
        distribution strategies of several replicas, are refused at fit:
        use `poisson_dataset` for those.

    Example:
    ```python
    dataset = keras_dp.data.truncated_poisson_dataset(
        x_train, y_train, expected_batch_size=256, max_batch_size=288)
    private.fit(dataset, epochs=10,
                callbacks=[keras_dp.PrivacyCallback(delta=1e-5, accountant="pld")])
    ```
    """
    if isinstance(x, tf.data.Dataset) and y is None and sample_weight is None:
        x, y, sample_weight = examples_of(x, max_dataset_bytes)
    data, num_examples = _to_tensors(x, y, sample_weight)
    _check_int("expected_batch_size", expected_batch_size, minimum=1,
               maximum=num_examples, maximum_name="the number of examples")
    _check_int("max_batch_size", max_batch_size, minimum=expected_batch_size,
               maximum=num_examples, minimum_name="expected_batch_size",
               maximum_name="the number of examples")
    if steps_per_epoch is None:
        steps_per_epoch = math.ceil(num_examples / expected_batch_size)
    _check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    seed, seed_source = _seed_and_source(seed, secure_mode)
    rate = expected_batch_size / num_examples

    def make_batch(step, step_seed):
        source = _truncated_draw(step_seed, num_examples, rate, max_batch_size)
        return _batch_of_rows(data, source, max_batch_size)

    dataset = _draws(seed, steps_per_epoch, make_batch).prefetch(tf.data.AUTOTUNE)
    dataset = dataset.with_options(_EVERY_WORKER_EVERY_BATCH)
    _SAMPLING_INFO[dataset] = SamplingInfo(
        sampling=sampling_schemes.TruncatedPoissonSampling.name,
        batch_size=expected_batch_size, num_examples=num_examples,
        physical_batch_size=max_batch_size, padding_multiple=max_batch_size,
        steps_per_epoch=steps_per_epoch, seed=seed, seed_source=seed_source)
    return dataset


def _truncated_draw(seed, num_examples, rate, max_batch_size):
    """One truncated Poisson draw: the example in each of the P slots of a
    batch (`num_examples` in a padding slot).

    Every example is included with probability q (a uniform below q); each
    included one gets a second, independent uniform key and the P smallest
    keys are kept, which is a uniformly random subset of P of the included
    examples when more than P are (and all of them otherwise). O(N) a step.
    """
    inclusion, order = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    included = tf.random.stateless_uniform([num_examples], inclusion, dtype=tf.float64) < rate
    keys = tf.where(included, tf.random.stateless_uniform([num_examples], order), 2.0)
    _, slots = tf.math.top_k(-keys, k=max_batch_size)
    return tf.where(tf.gather(included, slots), slots, num_examples)


def _num_rows_of(data):
    """The rows of the `(x, y, sample_weight)` tensors of `_to_tensors`."""
    return int(tf.nest.flatten(data[0])[0].shape[0])


def user_dataset(x, y=None, sample_weight=None, *, user_ids, expected_users_per_batch,
                 max_examples_per_user=DEFAULT_MAX_EXAMPLES_PER_USER, seed=None,
                 max_users_per_batch=None, steps_per_epoch=None, accumulation_steps=1,
                 num_replicas=1, padding_multiple=None, secure_mode=False):
    """A `tf.data.Dataset` of Poisson-sampled USERS: user-level privacy.

    Each user (all rows sharing a `user_ids` value) joins each batch
    independently with probability q = expected_users_per_batch / U_total,
    and brings at most k = `max_examples_per_user` of its rows: k
    consecutive rows of the batch, the unused ones padding rows of sample
    weight 0. The private step sums each user's row gradients, clips that
    sum once to C, noises the sum over users and divides by the expected
    number of users, so the accountant's q and sensitivity C are per user:
    the guarantee protects every row of a person at once.

    Which k rows: before any batch, the rows are shuffled uniformly (from
    the dataset's seed) and each user keeps its first k rows, for the
    whole dataset. Under a uniform permutation each user's kept rows are a
    uniform k-subset of its own rows, independent of every other user's
    data, so adding or removing one user leaves the others' selections
    unchanged in distribution: the selection composes with the user-level
    guarantee of the steps. A new dataset (each `fit` on arrays makes one)
    draws a new selection.

    Args:
        x: inputs: a numpy array, or a dict / list / tuple of arrays, all
            with the same first dimension N (rows).
        y: targets, or None.
        sample_weight: per-row weights, or None for 1.0.
        user_ids: a length-N array: the user of each row (integers or
            strings; equal values are one user).
        expected_users_per_batch: U, the expected users per logical batch,
            1 <= U <= the number of users. The private step divides the
            noisy sum by U.
        max_examples_per_user: k, the most rows a user brings to a step
            (default `DEFAULT_MAX_EXAMPLES_PER_USER`, 8). A batch holds k
            rows per user slot, so the cost of a step grows with k; the
            guarantee does not depend on it.
        seed: as for `poisson_dataset`; also fixes the selection of rows.
        max_users_per_batch: the cap on users per logical batch (default:
            truncation probability at most 1e-12 per step).
        steps_per_epoch: batches per pass; default ceil(U_total / U).
        accumulation_steps: as for `poisson_dataset`; whole users go to
            each physical batch.
        num_replicas: as for `poisson_dataset`; whole users go to each
            replica.
        padding_multiple: the padding bucket in users (default about U / 16).
        secure_mode: as for `poisson_dataset`.

    Returns:
        A `tf.data.Dataset` of `(x, y, sample_weight)` batches whose rows
        [i * k, (i + 1) * k) are user slot i. `sampling_info_of` gives its
        `SamplingInfo` (`unit="user"`, `rows_per_unit=k`, `num_users`).

    Example:
    ```python
    dataset = keras_dp.data.user_dataset(x, y, user_ids=ids,
                                         expected_users_per_batch=64,
                                         max_examples_per_user=8)
    private.fit(dataset, epochs=20)
    ```
    """
    data, num_rows = _to_tensors(x, y, sample_weight)
    _check_int("max_examples_per_user", max_examples_per_user, minimum=1)
    users, num_users = user_indices(user_ids, num_rows)
    seeds = _seed_and_source(seed, secure_mode)
    unit_rows = _rows_of_users(users, num_users, max_examples_per_user, seeds[0])
    dataset = _sampled_batches(
        data, num_users, expected_users_per_batch, seeds=seeds,
        max_batch_size=max_users_per_batch, steps_per_epoch=steps_per_epoch,
        num_microbatches=None, accumulation_steps=accumulation_steps,
        num_replicas=num_replicas, padding_multiple=padding_multiple,
        unit_rows=unit_rows)
    _SAMPLING_INFO[dataset] = dataclasses.replace(_SAMPLING_INFO[dataset],
                                                  users_digest=user_digest(user_ids))
    return dataset


def user_indices(user_ids, num_rows):
    """The user of each row as an index in [0, U_total), and U_total.

    Args:
        user_ids: the user id of each row (a 1-D array-like).
        num_rows: N, the rows of the data.

    Returns:
        `(indices, num_users)`: an int64 numpy array of length N (users in
        the sorted order of their ids) and the number of distinct users.

    Raises:
        ValueError: for ids that are not one per row.
    """
    ids = np.asarray(user_ids)
    if ids.ndim != 1 or len(ids) != num_rows:
        raise ValueError(
            f"user_ids must give one user per row: a 1-D array of length {num_rows} "
            f"(the rows of x); received shape {ids.shape}. Pass the user id of "
            "every example, in the order of x.")
    unique, indices = np.unique(ids, return_inverse=True)
    return indices.astype(np.int64).reshape(-1), len(unique)


def user_digest(user_ids):
    """A digest of which rows belong to which user (the user id space), by
    which a ledger refuses a later fit over other users."""
    indices, num_users = user_indices(user_ids, len(np.asarray(user_ids)))
    return hashlib.sha256(np.int64(num_users).tobytes() + indices.tobytes()).hexdigest()


def _rows_of_users(users, num_users, max_rows, seed):
    """The `[num_users + 1, max_rows]` table of the rows each user brings:
    the first `max_rows` of its rows in a uniformly shuffled order (from
    `seed`), then N (padding); the last row, all N, is the padding user."""
    num_rows = len(users)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SELECTION_STREAM]))
    shuffled = rng.permutation(num_rows)
    by_user = shuffled[np.argsort(users[shuffled], kind="stable")]
    counts = np.bincount(users, minlength=num_users)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(num_rows) - first[users[by_user]]
    kept = rank < max_rows
    table = np.full((num_users + 1, max_rows), num_rows, np.int64)
    table[users[by_user][kept], rank[kept]] = by_user[kept]
    return tf.constant(table)


def _check_participation_groups(participation_groups, expected_batch_size, num_examples,
                                num_microbatches):
    """Refuses cyclic Poisson sampling keras-dp cannot account exactly."""
    _check_int("participation_groups", participation_groups, minimum=1)
    if participation_groups == 1:
        return
    if participation_groups * expected_batch_size > num_examples:
        raise ValueError(
            f"participation_groups={participation_groups} times the batch size "
            f"{expected_batch_size} exceeds the {num_examples} examples: each step samples "
            "one group of N / b examples with q = b * B / N, which must be at most 1. "
            "Use fewer bands or a smaller batch size.")
    if num_microbatches is not None:
        raise ValueError(
            "participation_groups > 1 (banded matrix factorization) takes one "
            "microbatch per example: use num_microbatches=None.")


def _participation_groups_of(num_examples, participation_groups, seed):
    """The group of each example: a permutation from `seed` (never published,
    as the draws'), cut into b groups of N / b examples (one more for some)."""
    stream = np.random.default_rng(np.random.SeedSequence([seed, 0x6D66]))
    return (stream.permutation(num_examples) % participation_groups).astype(np.int64)


def _members_of_participation_groups(group_of_unit, num_units):
    """`[b, L + 1]`: row c lists the units of group c in increasing order,
    then `num_units` (padding) to its end; L is the largest group's size."""
    sizes = np.bincount(group_of_unit)
    members = np.full((len(sizes), sizes.max() + 1), num_units, np.int64)
    order = np.argsort(group_of_unit, kind="stable")  # By group, index order within.
    for group, units in enumerate(np.split(order, np.cumsum(sizes)[:-1])):
        members[group, :len(units)] = units
    return members


def _seed_and_source(seed, secure_mode):
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
    if seed is None:
        return int(np.random.randint(2**31 - 1)), "numpy"
    _check_int("seed", seed, minimum=0)
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


def _checked_padding_multiple(padding_multiple, expected_batch_size, blocks,
                              num_microbatches, max_batch_size):
    """The padding bucket: the given one, checked, or the default about B / 16."""
    if num_microbatches:
        if padding_multiple is not None:
            raise ValueError(
                f"padding_multiple={padding_multiple} cannot be combined with "
                f"num_microbatches={num_microbatches}: a microbatch's loss is a "
                "mean over its slots, so slots that varied with the draw would "
                "let one example change every microbatch. Batches with "
                "microbatches are always padded to max_batch_size.")
        return max_batch_size
    if padding_multiple is None:
        # ~B/32 padding rows on average (3% of the rows, which a step's time
        # grows with); its running time then shows the batch size to within
        # B/16 rows (docs/security.md), and the +-5 sqrt(B) rows of the size's
        # spread span about ten buckets at B = 256, each one XLA program.
        unit = math.lcm(8, blocks)
        return unit * max(1, round(expected_batch_size / 16 / unit))
    _check_int("padding_multiple", padding_multiple, minimum=1)
    if padding_multiple % blocks:
        raise ValueError(
            f"padding_multiple={padding_multiple} must be a multiple of "
            f"accumulation_steps times num_replicas ({blocks}), so that each "
            "physical batch and each replica's share have equal sizes.")
    return padding_multiple


def _padded_rows(num_sampled, padding_multiple, max_batch_size):
    """Rows of a batch of `num_sampled` examples: the next multiple of the
    bucket (one bucket when none is sampled), at most `max_batch_size`."""
    buckets = tf.maximum((num_sampled + padding_multiple - 1) // padding_multiple, 1)
    return tf.minimum(buckets * padding_multiple, max_batch_size)


def _every_worker_every_batch():
    """Dataset options for `tf.distribute`: each worker reads every batch
    and keeps its replicas' rows (sharding by batch would give each worker
    different draws, and an example could join a step twice)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    return options


_EVERY_WORKER_EVERY_BATCH = _every_worker_every_batch()


def _splitter(num_splits):
    """Returns a flat_map function splitting a batch into `num_splits` rows blocks."""
    def split(*batch):
        def reshape(leaf):
            return tf.reshape(leaf, tf.concat([[num_splits, -1], tf.shape(leaf)[1:]], 0))
        parts = tuple(None if part is None else tf.nest.map_structure(reshape, part)
                      for part in batch)
        return tf.data.Dataset.from_tensor_slices(parts)
    return split


def _batch_maker(data, num_units, rate, groups, slots_per_group, padding_multiple,
                 unit_rows=None, cyclic=None):
    """Returns the tf.data map function turning a logical step's place in
    its pass and a stateless seed into a batch.

    The batch's slots are those of `_sampled_slots`. The batch then keeps
    its first slots up to the next multiple of `padding_multiple`: with one
    group, every sampled unit that fits the cap. A unit is the example of
    its index, or, with `unit_rows`, the k rows of its row of the table,
    consecutive in the batch (a padding unit is k padding rows). With
    `cyclic`, `(members of each participation group, b)` of cyclic Poisson
    sampling, the t-th step of a pass samples only the units of group t mod b.
    """
    num_rows = _num_rows_of(data)
    rows_per_unit = 1 if unit_rows is None else int(unit_rows.shape[1])
    max_batch_size = groups * slots_per_group
    # The batch dimension stays unknown to tf.data unless every batch is full.
    static_rows = max_batch_size * rows_per_unit if padding_multiple >= max_batch_size else None

    def make_batch(step, seed):
        candidates = None
        if cyclic is not None:
            members, cycle = cyclic
            candidates = members[step % cycle]
        source = _sampled_slots(seed, num_units, rate, groups, slots_per_group, candidates)
        sampled = tf.reduce_sum(tf.cast(source < num_units, tf.int32))
        source = source[:_padded_rows(sampled, padding_multiple, max_batch_size)]
        if unit_rows is not None:  # The padding unit, num_units, is padding rows.
            source = tf.reshape(tf.gather(unit_rows, source), [-1])
        return _batch_of_rows(data, source, static_rows)

    return make_batch


def _padding_row(source, num_rows):
    """The row the padding rows of a batch repeat: its first real row (row 0
    of the data for a batch without one). Padding rows are then inputs the
    model meets anyway (a StringLookup without OOV accepts them), and their
    weight 0 makes their loss and gradient exactly zero on both engines."""
    first = tf.reduce_min(source)
    return tf.where(first < num_rows, first, tf.zeros_like(first))


def _batch_of_rows(data, source, static_rows):
    """The `(x, y, sample_weight)` batch of the rows `source` indexes; an
    index past the last row is a padding row: a copy of the batch's first
    real row (`_padding_row`) of sample weight 0.

    Args:
        data: the `(x, y, sample_weight)` tensors of `_to_tensors`.
        source: int indices into their rows.
        static_rows: the batch's rows if fixed (for the static shape), or None.
    """
    x, y, sample_weight = data
    num_rows = _num_rows_of(data)
    real = source < num_rows
    rows = tf.where(real, source, _padding_row(source, num_rows))

    def pad(leaf):
        return tf.ensure_shape(tf.gather(leaf, rows), [static_rows] + leaf.shape[1:])

    def zero_padding(leaf):
        batch = pad(leaf)
        mask = tf.reshape(real, [-1] + [1] * (leaf.shape.rank - 1))
        return tf.where(mask, batch, tf.zeros_like(batch))

    def pad_all(structure, pad_leaf=pad):
        return None if structure is None else tf.nest.map_structure(pad_leaf, structure)

    if sample_weight is None:
        weights = tf.cast(real, tf.float32)
    else:
        weights = pad_all(sample_weight, zero_padding)
    return pad_all(x), pad_all(y), weights


def _sampled_slots(seed, num_units, rate, groups, slots_per_group, candidates=None):
    """One Poisson draw: the unit in each of the `groups * slots_per_group`
    slots of a batch (`num_units` where a slot is left empty: padding).

    Each unit is included independently with probability q = `rate`, so the
    gaps between consecutive included units of a group are independent
    Geometric(q) counts, floor(log(U) / log(1 - q)) for U uniform on (0, 1]
    (in float64: each inclusion has probability q to ~1e-16). A group's
    first `slots_per_group` gaps give its first sampled units in index
    order, the ones it keeps: O(slots) work for a batch, where a uniform per
    unit took O(N). Unit i belongs to group i mod `groups` and group g fills
    slots [g * slots, (g + 1) * slots) with its sampled units in index order,
    then padding; units of a group beyond its slots are dropped (the
    truncation that `SamplingInfo.extra_delta` accounts for).

    Args:
        seed: the draw's stateless seed.
        num_units: N.
        rate: q.
        groups: the microbatch groups.
        slots_per_group: the slots of each group.
        candidates: None (all N units), or the units this draw samples from
            (one participation group), in increasing order and followed by
            `num_units` (with `groups` = 1).

    Returns:
        `[groups * slots_per_group]` int64 units.
    """
    uniform = 1.0 - tf.random.stateless_uniform([groups, slots_per_group], seed,
                                                dtype=tf.float64)
    gaps = tf.floor(tf.math.log(uniform) / tf.math.log1p(tf.constant(-rate, tf.float64)))
    # Capped where int64 holds it: a gap of N already ends every group.
    gaps = tf.cast(tf.minimum(gaps, num_units), tf.int64)
    positions = tf.cumsum(gaps + 1, axis=1) - 1  # Among the group's (candidate) units.
    if candidates is None:
        units = positions * groups + tf.range(groups, dtype=tf.int64)[:, None]
    else:
        last = tf.size(candidates, out_type=tf.int64) - 1
        units = tf.gather(candidates, tf.minimum(positions, last))
    return tf.reshape(tf.minimum(units, num_units), [-1])


def _to_tensors(x, y, sample_weight):
    """Converts (x, y, sample_weight) to tensors and returns them with N."""
    data = []
    num_examples = None
    for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        if value is None:
            if name == "x":
                raise ValueError("x is required; received x=None.")
            data.append(None)
            continue
        if isinstance(value, tf.data.Dataset):
            raise ValueError(
                f"poisson_dataset samples examples from in-memory arrays or from one "
                f"unbatched tf.data.Dataset of examples; {name} is a tf.data.Dataset "
                "beside other data. Pass the dataset of (x, y) examples alone as x, or "
                "arrays.")
        # tf.data stacks a list output into one tensor; tuples stay structures.
        tensors = tf.nest.map_structure(tf.convert_to_tensor, _lists_to_tuples(value))
        for leaf in tf.nest.flatten(tensors):
            if not leaf.shape.rank:
                raise ValueError(f"{name} has a scalar where an array of examples "
                                 f"was expected: {leaf!r}.")
            if num_examples is None:
                num_examples = leaf.shape[0]
            if leaf.shape[0] != num_examples:
                raise ValueError(
                    f"Every array of x, y and sample_weight must have the same first "
                    f"dimension (the number of examples, {num_examples} from x); "
                    f"{name} has an array of shape {tuple(leaf.shape)}."
                )
        data.append(tensors)
    return tuple(data), num_examples


def _lists_to_tuples(structure):
    if isinstance(structure, (list, tuple)):
        return tuple(_lists_to_tuples(s) for s in structure)
    if isinstance(structure, dict):
        return {k: _lists_to_tuples(v) for k, v in structure.items()}
    return structure


def _check_int(name, value, minimum, maximum=None, minimum_name=None, maximum_name=None):
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


def _grouped_truncation_probability(num_examples, rate, groups, slots_per_group):
    """P(some group samples more examples than its slots), by the union bound."""
    small, extra = divmod(num_examples, groups)  # `extra` groups have one more.
    return (extra * _binomial_upper_tail(small + 1, rate, slots_per_group + 1)
            + (groups - extra) * _binomial_upper_tail(small, rate, slots_per_group + 1))


def _default_group_slots(num_examples, rate, groups):
    """Fewest slots per group with total truncation probability at most
    DEFAULT_TRUNCATION_PROBABILITY."""
    low = max(1, math.ceil(rate * num_examples / groups))
    high = -(-num_examples // groups)  # The largest group: nothing is dropped.
    while low < high:  # The tail shrinks as the slots grow: bisect.
        middle = (low + high) // 2
        if (_grouped_truncation_probability(num_examples, rate, groups, middle)
                <= DEFAULT_TRUNCATION_PROBABILITY):
            high = middle
        else:
            low = middle + 1
    return low


def _binomial_upper_tail(n, p, k):
    """P(X >= k) for X ~ Binomial(n, p) and k > n * p, as an upper bound.

    Past the mode the pmf decreases with ratios
    r(j) = pmf(j + 1) / pmf(j) = (n - j) p / ((j + 1)(1 - p)) that shrink as j
    grows. We sum the terms of a window wide enough for the tail to have
    decayed far below double precision, then bound the rest by a geometric
    series with the last ratio.
    """
    if k > n:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_ratio_p = math.log(p) - math.log1p(-p)
    log_first = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                 + k * math.log(p) + (n - k) * math.log1p(-p))
    # ~40 standard deviations beyond k: the terms have fallen by e^-800 there.
    last = min(n, k + int(40 * math.sqrt(n * p) + 100))
    j = np.arange(k, last, dtype=np.float64)
    log_ratios = np.log(n - j) - np.log(j + 1) + log_ratio_p
    log_terms = log_first + np.concatenate([[0.0], np.cumsum(log_ratios)])
    # log_first is the largest term: factor it out of the sum (log-sum-exp).
    tail = math.exp(log_first) * float(np.sum(np.exp(log_terms - log_first)))
    if last < n:
        ratio = math.exp(math.log(n - last) - math.log(last + 1) + log_ratio_p)
        tail += math.exp(log_terms[-1]) * ratio / (1.0 - ratio)
    return tail
