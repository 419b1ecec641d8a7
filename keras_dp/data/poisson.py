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

import math

import numpy as np
import tensorflow as tf

from keras_dp.data.examples import DEFAULT_MAX_DATASET_BYTES
from keras_dp.data.examples import examples_of
from keras_dp.data.examples import function_graphs
from keras_dp.data.examples import num_rows_of
from keras_dp.data.examples import to_tensors
from keras_dp.data.info import SamplingInfo
from keras_dp.data.info import check_int
from keras_dp.data.info import attach
from keras_dp.data.info import attach_source_functions
from keras_dp.data.info import seed_and_source


# Default bound on the per-step probability that a batch exceeds its padding.
DEFAULT_TRUNCATION_PROBABILITY = 1e-12


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
    check_int("num_examples", num_examples, minimum=1)
    check_int("expected_batch_size", expected_batch_size, minimum=1,
               maximum=num_examples, maximum_name="num_examples")
    check_int("physical_batch_size", physical_batch_size,
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
    microbatches, each microbatch is a group of the batch's examples drawn
    at random (see `num_microbatches`), laid out the same way within its own
    slots, all padded to the cap. Each pass over
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
            OS entropy (never a global generator's, which
            `keras.utils.set_random_seed` would fix). The privacy analysis
            assumes the adversary does not know which examples were sampled:
            do not publish it. The model's ledger saves the passes drawn with
            each seed, so a dataset built again with the same seed (also
            after a save and load) draws passes after them, never replays.
        max_batch_size: the cap P >= B on the rows of a (logical) batch;
            sampled examples beyond it are dropped. By default the smallest
            P whose per-step truncation probability is at most
            `DEFAULT_TRUNCATION_PROBABILITY` (1e-12).
        steps_per_epoch: batches per pass; default ceil(N / B), so a pass
            sees each example once in expectation.
        num_microbatches: None, or the optimizer's `num_microbatches` m
            (per replica). Each physical batch is then m (per replica)
            microbatches, each with its own slots: at every step each
            sampled example joins one of the m * accumulation_steps *
            num_replicas groups uniformly at random, independently of its
            index and of the other examples. An example's group then never
            depends on which other examples exist or were sampled, so one
            example joining or leaving changes one microbatch only
            (sensitivity 2C: the clipped mean of a group with and without
            it). Groups fixed by index (i mod m) would not do: an example
            inserted in the middle of the data would shift every later one
            into the next group and change all m microbatches. Each of the
            G groups receives each example with probability q / G, so the
            truncation probability is the sum over the groups of the
            Binomial(N, q / G) tail beyond a group's slots.
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
        secure_mode: True refuses a `seed` (the default seed is from OS
            entropy either way), so that no known seed reveals which
            examples each batch holds. Required by an optimizer with `secure_mode=True` (see
            `check_secure_sampling`).
        participation_groups: b >= 1. With b > 1 (cyclic Poisson sampling,
            for `keras_dp.BandedMF(bands=b)`), the examples are split into b
            fixed groups, each example's drawn uniformly and alone from `seed`
            (an added example moves no other's group); the t-th logical
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
    source_functions = ()
    if isinstance(x, tf.data.Dataset) and y is None and sample_weight is None:
        source_functions = function_graphs(x)
        x, y, sample_weight = examples_of(x, max_dataset_bytes)
    data, num_examples = to_tensors(x, y, sample_weight)
    _check_participation_groups(participation_groups, expected_batch_size, num_examples,
                                num_microbatches)
    dataset = sampled_batches(
        data, num_examples, expected_batch_size, seeds=seed_and_source(seed, secure_mode),
        max_batch_size=max_batch_size,
        steps_per_epoch=steps_per_epoch, num_microbatches=num_microbatches,
        accumulation_steps=accumulation_steps, num_replicas=num_replicas,
        padding_multiple=padding_multiple, participation_groups=participation_groups)
    attach_source_functions(dataset, source_functions)
    return dataset


def sampled_batches(data, num_units, expected_batch_size, *, seeds, max_batch_size,
                     steps_per_epoch, num_microbatches, accumulation_steps, num_replicas,
                     padding_multiple, unit_rows=None, participation_groups=1):
    """`poisson_dataset` and `user_dataset`: Poisson batches over `num_units`
    units, each unit the row of `data` it indexes, or, given `unit_rows`
    (`[num_units + 1, k]` row indices, the last one all padding), k rows;
    in `participation_groups` cyclic groups (see `poisson_dataset`)."""
    unit = "example" if unit_rows is None else "user"
    check_int("expected_batch_size", expected_batch_size, minimum=1,
               maximum=num_units, maximum_name=f"the number of {unit}s")
    check_int("accumulation_steps", accumulation_steps, minimum=1)
    check_int("num_replicas", num_replicas, minimum=1)
    if num_microbatches is not None:
        check_int("num_microbatches", num_microbatches, minimum=1)
    rate = participation_groups * expected_batch_size / num_units
    seed, seed_source = seeds
    group_of_unit = (None if participation_groups == 1 else
                     _participation_groups_of(num_units, participation_groups, seed))
    # The largest population one step samples from; with cyclic groups, one
    # more, as an added unit may join the largest (review round 183: its
    # truncation 0.140 against 0.120 recorded, at N 60, b 3, 9 slots).
    population = (num_units if group_of_unit is None else int(
        np.bincount(group_of_unit, minlength=participation_groups).max()) + 1)
    # A draw is cut into k physical batches, each into R replica blocks.
    blocks = accumulation_steps * num_replicas
    # Without microbatches the blocks of a draw are summed unit by unit, so
    # one group (index order, then padding) serves; with them, each sampled
    # unit joins a group drawn at random (`_sampled_slots`).
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
    check_int("max_batch_size", max_batch_size, minimum=expected_batch_size,
               minimum_name="expected_batch_size")
    padding_multiple = _checked_padding_multiple(padding_multiple, expected_batch_size,
                                                 blocks, num_microbatches, max_batch_size)
    if steps_per_epoch is None:
        cycles = math.ceil(math.ceil(num_units / expected_batch_size) / participation_groups)
        steps_per_epoch = cycles * participation_groups
    check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    if steps_per_epoch % participation_groups:
        raise ValueError(
            f"steps_per_epoch={steps_per_epoch} is not a multiple of participation_groups="
            f"{participation_groups}: the next pass would restart the cycle of groups, "
            "and an example could join two steps less than b apart. Give a multiple "
            "of it, or leave steps_per_epoch out.")
    cyclic = None
    if group_of_unit is not None:
        cyclic = (tf.constant(_members_of_participation_groups(
            group_of_unit, participation_groups, num_units)), participation_groups)

    make_batch = _batch_maker(data, num_units, rate, groups, max_batch_size // groups,
                              padding_multiple, unit_rows, cyclic)
    passes = Passes()
    dataset = draws(seed, steps_per_epoch, make_batch, passes)
    if accumulation_steps > 1:
        # flat_map hides the length from Keras, which would then warn that
        # the input "ran out of data" at every epoch end.
        dataset = dataset.flat_map(_splitter(accumulation_steps)).apply(
            tf.data.experimental.assert_cardinality(accumulation_steps * steps_per_epoch))
    dataset = dataset.prefetch(tf.data.AUTOTUNE).with_options(EVERY_WORKER_EVERY_BATCH)
    rows_per_unit = 1 if unit_rows is None else int(unit_rows.shape[1])
    num_rows = num_rows_of(data)
    attach(dataset, SamplingInfo(
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
        passes=passes,
        unit=unit,
        rows_per_unit=rows_per_unit,
        num_users=None if unit_rows is None else num_units,
        participation_groups=participation_groups,
    ))
    return dataset


class Passes:
    """The passes over its data a Poisson dataset has drawn.

    A counter the pipeline advances once per pass (each iteration), which
    selects, with the seed, the pass's random stream. Before training, a
    private model raises it to the passes its ledger records as spent with
    that seed (`keras_dp.ledger.PrivacyLedger.draw_fresh`): a dataset built
    again with the same seed, in this process or after a save and load,
    then draws new batches instead of replaying spent ones.
    """

    def __init__(self):
        with tf.init_scope():
            self._count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name="poisson_passes")

    def take(self):
        """The index of the pass starting now (pipeline code)."""
        return self._count.assign_add(1) - 1

    def count(self):
        """Passes drawn so far (or skipped to)."""
        return int(self._count.numpy())

    def skip_to(self, passes):
        """Draws the next pass with index `passes` at least."""
        if passes > self.count():
            self._count.assign(passes)


def draws(seed, steps_per_epoch, make_batch, passes):
    """The dataset of a pass's `steps_per_epoch` batches, each
    `make_batch(step, stateless_seed)`, `step` its place in the pass.

    The step's stateless seed is (`seed`, pass) folded with the step, the
    pass the next of `passes` (a `Passes`), taken as each iteration
    starts: each epoch draws fresh batches, the sequence of passes fixed by
    `seed`, and a pass the ledger records as spent is never drawn again.
    """
    def one_pass(index):
        key = tf.stack([tf.constant(seed, tf.int64), index])
        return tf.data.Dataset.range(steps_per_epoch).map(
            lambda step: make_batch(step, tf.random.experimental.stateless_fold_in(key, step)),
            num_parallel_calls=tf.data.AUTOTUNE)

    return (tf.data.Dataset.from_tensors(0)
            .map(lambda _: passes.take())
            .flat_map(one_pass)
            .apply(tf.data.experimental.assert_cardinality(steps_per_epoch)))


def _check_participation_groups(participation_groups, expected_batch_size, num_examples,
                                num_microbatches):
    """Refuses cyclic Poisson sampling keras-dp cannot account exactly."""
    check_int("participation_groups", participation_groups, minimum=1)
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
    """The group of each example: drawn uniformly and independently for each
    from `seed` (never published, as the draws'), so an example added
    changes no other's group. Groups of N / b each (a permutation cut into
    b) made one added example move another to another group: a cycle's sums
    moved by sqrt(5) C, one participation recorded (review round 182)."""
    stream = np.random.default_rng(np.random.SeedSequence([seed, 0x6D66]))
    return stream.integers(0, participation_groups, num_examples, dtype=np.int64)


def _members_of_participation_groups(group_of_unit, participation_groups, num_units):
    """`[b, L + 1]`: row c lists the units of group c in increasing order,
    then `num_units` (padding) to its end; L is the largest group's size."""
    sizes = np.bincount(group_of_unit, minlength=participation_groups)
    members = np.full((len(sizes), sizes.max() + 1), num_units, np.int64)
    order = np.argsort(group_of_unit, kind="stable")  # By group, index order within.
    for group, units in enumerate(np.split(order, np.cumsum(sizes)[:-1])):
        members[group, :len(units)] = units
    return members


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
    check_int("padding_multiple", padding_multiple, minimum=1)
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


EVERY_WORKER_EVERY_BATCH = _every_worker_every_batch()


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
        return batch_of_rows(data, source, static_rows)

    return make_batch


def _padding_row(source, num_rows):
    """The row the padding rows of a batch repeat: its first real row (row 0
    of the data for a batch without one). Padding rows are then inputs the
    model meets anyway (a StringLookup without OOV accepts them), and their
    weight 0 makes their loss and gradient exactly zero on both engines."""
    first = tf.reduce_min(source)
    return tf.where(first < num_rows, first, tf.zeros_like(first))


def batch_of_rows(data, source, static_rows):
    """The `(x, y, sample_weight)` batch of the rows `source` indexes; an
    index past the last row is a padding row: a copy of the batch's first
    real row (`_padding_row`) of sample weight 0.

    Args:
        data: the `(x, y, sample_weight)` tensors of `to_tensors`.
        source: int indices into their rows.
        static_rows: the batch's rows if fixed (for the static shape), or None.
    """
    x, y, sample_weight = data
    num_rows = num_rows_of(data)
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
    gaps between consecutive included units are independent Geometric(q)
    counts, floor(log(U) / log(1 - q)) for U uniform on (0, 1] (in float64:
    each inclusion has probability q to ~1e-16). The first
    `groups * slots_per_group` gaps give the first sampled units in index
    order: O(slots) work for a batch, where a uniform per unit took O(N).

    With several groups (microbatches), each sampled unit then joins a group
    drawn uniformly at random, independently of its index and of the other
    units, afresh at every draw (from a seed folded out of the draw's):
    a unit's group never depends on which other units exist or were sampled,
    so adding or removing one unit changes the members of its own group only.
    A group assigned by index (i mod groups) would not: a unit inserted in
    the middle of the data shifts every later unit into the next group.
    Group g fills slots [g * slots, (g + 1) * slots) with its units in index
    order, then padding; units beyond their group's slots are dropped (the
    truncation that `SamplingInfo.extra_delta` accounts for: every group
    size is Binomial(N, q / groups), `_grouped_truncation_probability`).
    More sampled units than slots overflow some group, so the units past
    the drawn gaps are dropped only inside that event too.

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
    slots = groups * slots_per_group
    uniform = 1.0 - tf.random.stateless_uniform([slots], seed, dtype=tf.float64)
    gaps = tf.floor(tf.math.log(uniform) / tf.math.log1p(tf.constant(-rate, tf.float64)))
    # Capped where int64 holds it: a gap of N already ends the draw.
    gaps = tf.cast(tf.minimum(gaps, num_units), tf.int64)
    positions = tf.cumsum(gaps + 1) - 1  # Among the (candidate) units.
    if candidates is None:
        units = positions
    else:
        last = tf.size(candidates, out_type=tf.int64) - 1
        units = tf.gather(candidates, tf.minimum(positions, last))
    units = tf.minimum(units, num_units)
    if groups == 1:
        return units
    return _grouped(units, num_units, groups, slots_per_group,
                    tf.random.experimental.stateless_fold_in(seed, _GROUP_STREAM))


# Folded into a draw's seed for the groups of its units (any constant).
_GROUP_STREAM = 0x67726F7570


def _grouped(units, num_units, groups, slots_per_group, seed):
    """`units` (sampled units in increasing order, then `num_units`), each
    in a group drawn uniformly from [0, groups) with `seed`, laid out group
    by group: group g's first `slots_per_group` units in slots
    [g * slots_per_group, (g + 1) * slots_per_group), then `num_units`."""
    group = tf.random.stateless_uniform(tf.shape(units), seed, minval=0, maxval=groups,
                                        dtype=tf.int64)
    group = tf.where(units < num_units, group, groups)  # Padding joins no group.
    # A unit's rank among the earlier units of its group: a stable sort by
    # group keeps index order within each group.
    order = tf.argsort(group, stable=True)
    by_group = tf.gather(group, order)
    first = tf.searchsorted(by_group, tf.range(groups + 1, dtype=tf.int64), side="left",
                            out_type=tf.int64)
    rank = tf.range(tf.size(by_group, out_type=tf.int64)) - tf.gather(first, by_group)
    kept = (by_group < groups) & (rank < slots_per_group)
    destination = tf.boolean_mask(by_group * slots_per_group + rank, kept)
    return tf.tensor_scatter_nd_update(
        tf.fill([groups * slots_per_group], tf.constant(num_units, tf.int64)),
        destination[:, None], tf.boolean_mask(tf.gather(units, order), kept))


def _grouped_truncation_probability(num_examples, rate, groups, slots_per_group):
    """P(some group samples more examples than its slots), by the union bound:
    each of the `groups` groups receives each example independently with
    probability rate / groups (sampled, then that group drawn)."""
    return groups * _binomial_upper_tail(num_examples, rate / groups, slots_per_group + 1)


def _default_group_slots(num_examples, rate, groups):
    """Fewest slots per group with total truncation probability at most
    DEFAULT_TRUNCATION_PROBABILITY."""
    low = max(1, math.ceil(rate * num_examples / groups))
    high = num_examples  # A group may receive every example: nothing is dropped.
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
