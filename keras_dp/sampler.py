"""How a private model's fit() draws its batches, refusing any that would leak.

In-memory arrays are Poisson-sampled by default (`data.poisson_dataset`, one
draw per logical batch of the optimizer's gradient accumulation, with a seed
this model never used), or cut into Keras' shuffled fixed-size batches with
`sampling="shuffle"`. A dataset made by `data.poisson_dataset` is Poisson,
also after transformations that keep its batches (`poisson_info_of`).
Any other input keras-dp did not sample is accounted soundly: every step a
full Gaussian release, unless the user states `sampling="shuffle"` (each
epoch holds each example at most once: one release per pass), which the
warning repeats. Whatever the input, its
batches must line up with the optimizer's gradient accumulation, its
microbatches and the replicas, or one example could count twice in a step:
`fit_batches` refuses such a fit before any step.
"""

import dataclasses
import math
import secrets
import warnings

import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_dp import accounting
from keras_dp import correlated_noise
from keras_dp import data
from keras_dp.data import examples
from keras_dp import distribute
from keras_dp import mechanism
from keras_dp import preprocessing
from keras_dp import sampling_schemes
from keras_dp import validation

# What fit(sampling=...) accepts: keras-dp's Poisson draws, or the user's
# statement that a dataset's epochs are shuffled passes.
SAMPLINGS = (sampling_schemes.PoissonSampling.name, sampling_schemes.ShuffledPasses.name)
# Keras' fit batch size when none is given.
_DEFAULT_BATCH_SIZE = 32


@dataclasses.dataclass(frozen=True)
class Users:
    """fit's user-level arguments: the user of each row, and k.

    Args:
        ids: the user id of each row of fit's arrays.
        max_examples_per_user: k, the most rows a user brings to a step.
    """

    ids: object
    max_examples_per_user: int = data.DEFAULT_MAX_EXAMPLES_PER_USER

    @classmethod
    def of(cls, user_ids, max_examples_per_user):
        """fit's `user_ids` and `max_examples_per_user`, or None for
        example-level privacy (no `user_ids`)."""
        if user_ids is None:
            if max_examples_per_user is not None:
                raise ValueError(
                    f"max_examples_per_user={max_examples_per_user} applies to "
                    "user-level privacy: pass fit(..., user_ids=...) too, the user of "
                    "each row.")
            return None
        if max_examples_per_user is None:
            return cls(_by_position(user_ids))
        return cls(_by_position(user_ids), max_examples_per_user)


def fit_batches(model, sampling, x, y, sample_weight, batch_size, validation_split,
                validation_data, steps_per_epoch, class_weight=None, users=None, epochs=1):
    """Decides how a private model's fit() draws its batches.

    Args:
        model: the private model, compiled with a DP optimizer.
        sampling: fit's `sampling`, one of `SAMPLINGS`.
        x: fit's `x`: arrays, a dataset or a generator.
        y: fit's `y`.
        sample_weight: fit's `sample_weight`.
        batch_size: fit's `batch_size`.
        validation_split: fit's `validation_split`.
        validation_data: fit's `validation_data`.
        steps_per_epoch: fit's `steps_per_epoch`.
        class_weight: fit's `class_weight`: for arrays, it becomes the
            examples' sample weights before sampling (it scales each
            example's loss before clipping, so the bound C holds).
        users: a `Users` for user-level privacy on arrays, or None.
        epochs: fit's `epochs`, for the epsilons the warning on batches
            keras-dp did not sample compares.

    Returns:
        `(info, fit_args)`: the `data.SamplingInfo` of the batches, and the
        arguments that Keras' fit then takes: `x`, `y`, `sample_weight`,
        `batch_size`, `validation_data`, and `shuffle=False` when fit draws
        Poisson batches from arrays.

    Raises:
        ValueError: for an unknown `sampling`, a non-DP optimizer, or batches
            that could hold an example twice in one step.
    """
    if sampling not in SAMPLINGS + (None,):
        raise ValueError(f'fit(sampling=...) must be "poisson" or "shuffle"; '
                         f"received sampling={sampling!r}.")
    # The scheme asked for, as a type: PoissonSampling, ShuffledPasses or None.
    sampling = sampling and sampling_schemes.scheme_type(sampling)
    x, y, sample_weight = _by_position((x, y, sample_weight))
    info = poisson_info_of(x)
    validation.check_compiled(model)
    validation.check_dp_optimizer(model.optimizer)
    _check_not_mid_logical_batch(model)
    # What fit logs and decides from the validation data (the best file a
    # checkpoint keeps, early stopping, a search's choice) reads the releases
    # its maps ran (review round 162: a search chose by validation batches a
    # released Normalization mapped, 5.35 reported against 5.74).
    preprocessing.record_releases_of(preprocessing.releases_run_by(validation_data),
                                     model.privacy_ledger)
    settings = model.optimizer.dp_settings
    correlated_noise.check_steps_per_epoch(settings.noise_correlation, steps_per_epoch,
                                           settings.accumulation_steps)
    in_memory = info is None and _is_in_memory(x)
    if users is not None:
        _check_user_level_fit(model, in_memory, sampling)
    if in_memory:
        sampling = sampling or sampling_schemes.PoissonSampling
        sample_weight = _with_class_weight(y, sample_weight, class_weight)
        distribute.check_fit_data(model.distribute_strategy, info, sampling)
        return _batches_of_arrays(model, sampling, (x, y, sample_weight), batch_size,
                                  validation_split, validation_data, steps_per_epoch, users,
                                  epochs)
    distribute.check_fit_data(model.distribute_strategy, info, sampling)
    if class_weight is not None:
        raise ValueError(
            "class_weight applies to arrays given to fit; a dataset carries its own "
            "sample weights. Pass fit(x, y, class_weight=...) on arrays, or give "
            "keras_dp.data.poisson_dataset(x, y, sample_weight=...) the weight of "
            "each example's class.")
    if info is not None:
        if sampling is sampling_schemes.ShuffledPasses:
            raise ValueError(
                'fit(sampling="shuffle") states how a dataset keras-dp did not '
                "sample was batched; this one was made by "
                "keras_dp.data.poisson_dataset and is Poisson-sampled. Drop sampling=.")
        if info.unit == "user":
            _check_user_level_fit(model, True, None)
        check_drawn_layout(model, info, steps_per_epoch)
        if isinstance(x, tf.data.Dataset):  # Its maps of batches (review round 118).
            account_maps_releases(model, x)
        draw_fresh(model, info)
        # The dataset's draws are the batches: nothing for Keras to shuffle.
        return info, _fit_args((x, y, sample_weight), batch_size, validation_data,
                               shuffle=False)
    if sampling is sampling_schemes.PoissonSampling:
        raise ValueError(
            'fit(sampling="poisson") on a dataset or generator: keras-dp can only '
            "vouch for batches it drew. Fit on arrays, or on "
            "keras_dp.data.poisson_dataset(x, y, expected_batch_size=...).")
    _check_batches_hold_examples_once(x, stated=sampling is sampling_schemes.ShuffledPasses)
    if isinstance(x, tf.data.Dataset):
        account_maps_releases(model, x)
    repeats = examples.repeats_before_batches(x)
    # A repeating dataset's length says nothing of its passes.
    batches_per_pass = None if repeats else examples.num_batches(x)
    _check_no_grouped_microbatches(model, None)
    _check_shuffled_accumulation(model.optimizer, batches_per_pass, steps_per_epoch)
    one_pass = _epoch_is_one_pass(sampling, repeats, batches_per_pass, steps_per_epoch)
    seen = examples.seen_batch_size(x) if batches_per_pass else None
    warnings.warn(unsampled_warning(
        model.optimizer.noise_multiplier, epochs, one_pass,
        repeats=repeats or steps_per_epoch not in (None, batches_per_pass),
        batch_size=seen, num_examples=seen and batches_per_pass * seen), stacklevel=3)
    info = data.SamplingInfo(sampling_schemes.ShuffledPasses.name, examples.peek_batch_size(x),
                             epoch_is_one_pass=one_pass)
    return info, _fit_args((x, y, sample_weight), batch_size, validation_data)


def _check_batches_hold_examples_once(x, stated):
    """Refuses batches keras-dp did not sample that may hold an example twice
    (each copy moves the clipped sum by C); batches it cannot read (a
    generator's) train only on the user's statement, `sampling="shuffle"`."""
    problem = isinstance(x, tf.data.Dataset) and examples.batches_problem(x)
    if problem:
        raise ValueError(
            f"This tf.data.Dataset {problem}, so one batch can hold an example "
            "twice, or one example reach the others, and move the clipped sum by more "
            "than l2_norm_clip. Map each single example instead, before any "
            ".batch() (keras_dp.data.poisson_dataset(examples.map(f), "
            "expected_batch_size=B), examples from tf.data.Dataset.from_tensor_slices "
            "without .batch(): a FeatureSpace or TextVectorization runs on single "
            "examples too), or fit on arrays; weight a class with sample weights "
            "instead of oversampling it.")
    if stated:
        return
    unread = type(x).__name__
    if isinstance(x, tf.data.Dataset):
        source = examples.unread_source(x)
        if source is None:
            return
        unread = f"tf.data pipeline of a {source}"
    raise ValueError(
        f"keras-dp cannot read whether the batches of this {unread} hold each example "
        "at most once (a copy moves the clipped sum by another l2_norm_clip). If each "
        'epoch holds each example at most once, say so: fit(..., sampling="shuffle"). '
        "Or fit on arrays or on keras_dp.data.poisson_dataset(...), which keras-dp "
        "samples itself.")


def _check_user_level_fit(model, in_memory, sampling):
    """Refuses user-level privacy where keras-dp cannot account it soundly."""
    if not in_memory:
        raise ValueError(
            "fit(user_ids=...) samples users from in-memory arrays; this input is a "
            "dataset or generator (or a keras_dp.data.poisson_dataset, which samples "
            "examples). Pass arrays, or fit on keras_dp.data.user_dataset(x, y, "
            "user_ids=..., expected_users_per_batch=...) without user_ids.")
    if sampling is sampling_schemes.ShuffledPasses:
        raise ValueError(
            'fit(user_ids=..., sampling="shuffle"): user-level privacy is accounted '
            "for Poisson sampling over users only. Drop sampling=.")
    microbatches = model.optimizer.dp_settings.num_microbatches
    if microbatches is not None:
        raise ValueError(
            f"User-level privacy clips each user's summed gradient once; the "
            f"optimizer's num_microbatches={microbatches} would clip groups of rows "
            "that mix users, with no sound per-user sensitivity. Use an optimizer "
            "with num_microbatches=None.")
    correlation = model.optimizer.dp_settings.noise_correlation
    if model.optimizer.privatizer.participation_groups > 1:
        raise ValueError(
            f"fit(user_ids=...) with noise_correlation={correlation!r}: correlated noise "
            "is accounted for cyclic groups of examples, not of users. Use "
            "noise_correlation=None for user-level privacy.")


def _batches_of_arrays(model, sampling, arrays, batch_size, validation_split,
                       validation_data, steps_per_epoch, users=None, epochs=1):
    """`fit_batches` for in-memory `(x, y, sample_weight)` arrays (and, for
    user-level privacy, `users`: then `batch_size` counts users)."""
    if users is not None:
        data.user_indices(users.ids, _num_rows(arrays[0]))  # One id per row.
    if validation_split:
        seed = _split_seed(model)
        if users is not None:
            (*arrays, ids), validation_data = _split_off_validation(
                (*arrays, users.ids), validation_split, seed)
            users = dataclasses.replace(users, ids=ids)
            validation_data = validation_data[:3]
        else:
            arrays, validation_data = _split_off_validation(arrays, validation_split, seed)
    batch_size = batch_size or _DEFAULT_BATCH_SIZE
    if users is not None:
        dataset = _poisson_dataset(model, arrays, batch_size, users, steps_per_epoch)
        info = data.sampling_info_of(dataset)
        _check_accumulation_matches(model, info, steps_per_epoch)
        return info, _fit_args((dataset, None, None), None, validation_data, shuffle=False)
    _check_not_one_example_per_microbatch(model.optimizer, batch_size)
    if sampling is sampling_schemes.PoissonSampling:
        dataset = _poisson_dataset(model, arrays, batch_size, steps_per_epoch=steps_per_epoch)
        info = data.sampling_info_of(dataset)
        _check_accumulation_matches(model, info, steps_per_epoch)
        # Sampling is the dataset's job: Keras must not shuffle or batch.
        return info, _fit_args((dataset, None, None), None, validation_data, shuffle=False)
    num_examples = _num_rows(arrays[0])
    _check_microbatches_divide(model, num_examples, batch_size)
    _check_no_grouped_microbatches(model, batch_size)
    _check_shuffled_accumulation(model.optimizer, -(-num_examples // batch_size),
                                 steps_per_epoch)
    warnings.warn(unsampled_warning(model.optimizer.noise_multiplier, epochs, True,
                                    batch_size=batch_size, num_examples=num_examples),
                  stacklevel=4)
    return (data.SamplingInfo(sampling_schemes.ShuffledPasses.name, batch_size, num_examples),
            _fit_args(arrays, batch_size, validation_data))


# Transformations of a Poisson dataset that keep its batches as drawn: maps
# only where `data.check_batch_map` reads each row as staying its example's.
_MAPS = ("_MapDataset", "_ParallelMapDataset")
_BATCH_KEEPING = _MAPS + ("_PrefetchDataset", "_OptionsDataset", "_AssertCardinalityDataset")


def poisson_info_of(dataset):
    """The `data.SamplingInfo` of a `data.poisson_dataset`, also after
    transformations that keep its batches (`_BATCH_KEEPING`), or None for
    any other input.

    Raises:
        ValueError: for a Poisson dataset transformed in a way that changes
            its batches (cache replays one epoch's draws, take / skip /
            filter / unbatch change which draws are trained on), or by a map
            that may mix the rows of a batch or change its sample weights
            (padding rows would then count).
    """
    source, chain = _poisson_source(dataset), []
    if source is None:
        return None
    current = dataset
    while current is not source:
        chain.append(current)
        current = current._input_dataset
    _check_batches_kept(source, chain[::-1])
    _check_batches_in_order(dataset, chain)
    return data.sampling_info_of(source)


def _check_batches_in_order(dataset, chain):
    """Refuses batches that may come out of their draws' order: a logical
    step of k physical batches would then join halves of two draws, and an
    example in both moved its clipped sum by 2 C, recorded C (review round
    23: a map with deterministic=False, or the options turning determinism
    off, which also lets tf.data run any map in parallel)."""
    unordered = dataset.options().deterministic is False or any(
        type(transformed).__name__ == "_ParallelMapDataset"
        and transformed._deterministic == "false" for transformed in chain)
    if unordered:
        raise ValueError(
            "This keras_dp.data.poisson_dataset is mapped with deterministic=False (or "
            "options with deterministic=False), so its batches may come out of the order "
            "of their draws, and a logical step could join parts of two draws holding "
            "one example twice. Drop deterministic=False: a parallel map keeps its "
            "speed with num_parallel_calls alone.")


def _poisson_source(dataset):
    """The `data.poisson_dataset` a chain of unary datasets starts from, or None."""
    current = dataset
    while isinstance(current, tf.data.Dataset):
        if data.sampling_info_of(current) is not None:
            return current
        current = getattr(current, "_input_dataset", None)
    return None


def _check_batches_kept(source, chain):
    """Refuses the first transformation of `chain` (from the Poisson dataset
    `source` on) that may change its batches."""
    maps = [transformed for transformed in chain if type(transformed).__name__ in _MAPS]
    shared = data.batch_maps.shared_state_problem(maps)
    if shared:
        raise ValueError(
            f"This keras_dp.data.poisson_dataset is mapped by functions where {shared}, "
            "so a draw may repeat by position, or a value reach the next batch. Fix: "
            "keep each variable in one map (draw with keras.random and a "
            "keras.random.SeedGenerator of its own).")
    counted = data.batch_maps.position_problem(
        data.source_functions_of(source),
        readers=[m._map_func.function.graph for m in maps])
    if counted:
        raise ValueError(
            f"A map of this keras_dp.data.poisson_dataset {counted}. Fix: compute "
            "each example from its own values alone (no counter in the maps of its "
            "examples).")
    for transformed in chain:
        name = type(transformed).__name__
        if name not in _BATCH_KEEPING:
            raise ValueError(
                f"This keras_dp.data.poisson_dataset went through {name.strip('_')}, "
                "which changes its batches (a cache replays the same draws every "
                "epoch), so they are no longer Poisson samples. Apply such "
                "transformations to the arrays before poisson_dataset; only map, "
                "prefetch and with_options may follow it.")
        if name in _MAPS:
            data.check_batch_map(transformed)
        if name == "_AssertCardinalityDataset":
            _check_same_length(transformed)


def _check_same_length(asserted):
    """Refuses a cardinality assertion that changes the length Keras reads:
    an epoch would then end inside a draw of k batches, and the next epoch's
    fresh pass close its logical step (review round 66: assert_cardinality(3)
    on 4 batches a pass, 2 C recorded C)."""
    before = int(asserted._input_dataset.cardinality())
    if int(asserted.cardinality()) != before:
        raise ValueError(
            f"This keras_dp.data.poisson_dataset of {before} batches a pass was given "
            f"another length, {int(asserted.cardinality())}, by assert_cardinality: "
            "an epoch would end inside a draw, and one logical step join two draws. "
            "Leave its length as poisson_dataset made it; set fewer steps with "
            "poisson_dataset(..., steps_per_epoch=...).")


def _with_class_weight(y, sample_weight, class_weight):
    """The sample weights of arrays, with their class weights applied."""
    if class_weight is None:
        return sample_weight
    if sample_weight is not None or y is None or len(tf.nest.flatten(y)) != 1:
        raise ValueError(
            "class_weight needs a single target array and no sample_weight. Fold "
            "the class weights into sample_weight instead (multiply each "
            "example's weight by its class's).")
    return data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def _fit_args(arrays, batch_size, validation_data, **more):
    """The arguments of Keras' fit that `fit_batches` decides."""
    x, y, sample_weight = arrays
    return dict(x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                validation_data=validation_data, **more)


def _poisson_dataset(model, arrays, batch_size, users=None, steps_per_epoch=None):
    """Poisson batches of `arrays` for `model`'s optimizer and replicas.

    One Poisson draw per LOGICAL batch, split over the physical batches of
    `batch_size` expected rows (users, given `users`) that accumulate into
    it; in the cyclic groups of the optimizer's correlated noise, if any.
    Each epoch holds fit's `steps_per_epoch` physical batches (fresh
    draws), by default a pass's.
    """
    optimizer, strategy = model.optimizer, model.distribute_strategy
    k = optimizer.dp_settings.accumulation_steps
    if users is None:
        _check_logical_batch_fits(batch_size, k, _num_rows(arrays[0]), "examples")
    else:
        _check_logical_batch_fits(batch_size, k, data.user_indices(
            users.ids, _num_rows(arrays[0]))[1], "users")
    shared = dict(accumulation_steps=k, num_replicas=distribute.num_replicas(strategy),
                  seed=distribute.chief_value(strategy, _poisson_seed(model)),
                  # Logical draws; rounded up so that a steps_per_epoch that k
                  # does not divide reaches `_check_accumulation_matches`.
                  steps_per_epoch=steps_per_epoch and -(-steps_per_epoch // k))
    if users is not None:
        return data.user_dataset(
            *arrays, user_ids=users.ids, expected_users_per_batch=k * batch_size,
            max_examples_per_user=users.max_examples_per_user, **shared)
    return data.poisson_dataset(
        *arrays, expected_batch_size=k * batch_size,
        num_microbatches=optimizer.dp_settings.num_microbatches,
        participation_groups=optimizer.privatizer.participation_groups, **shared)


def _check_logical_batch_fits(batch_size, accumulation_steps, num_units, units):
    """Refuses batches expecting more units than the data has (one Poisson
    draw of q = k * batch_size / N serves the k accumulated batches)."""
    if accumulation_steps * batch_size <= num_units:
        return
    if accumulation_steps == 1:
        raise ValueError(
            f"batch_size={batch_size} expects more {units} per batch than the {num_units} "
            f"{units} of the data (each is drawn with probability batch_size / "
            f"{num_units}). Use a batch_size of at most {num_units}.")
    raise ValueError(
        f"batch_size={batch_size} with gradient_accumulation_steps={accumulation_steps} "
        f"draws logical batches of {accumulation_steps * batch_size} expected {units}, more "
        f"than the {num_units} {units} of the data: one Poisson draw serves the k physical "
        f"batches of a logical step. Use a batch_size of at most "
        f"{num_units // accumulation_steps} or fewer accumulation steps.")


def _poisson_seed(model):
    """Seed of fit's Poisson batches: never one already used by `model`.

    From OS entropy, or, with an optimizer seed, derived from the seed
    and the steps in the ledger (which only grows).
    """
    seed = model.optimizer.dp_settings.seed
    if seed is None:
        return secrets.randbits(62)
    state = np.random.SeedSequence([seed, model.privacy_steps]).generate_state(1, np.uint64)
    return int(state[0] >> np.uint64(2))


def check_drawn_layout(model, info, steps_per_epoch=None):
    """Refuses the draws of a `data.poisson_dataset` that `model` cannot
    train on soundly (in fit, or a custom loop's
    `keras_dp.custom_loops.PoissonBatches`): batches that do not line up
    with its optimizer's accumulation, microbatches or replicas, or a seed
    its `secure_mode` refuses (fit's own draws on arrays take theirs from
    OS entropy; a dataset's must be checked).

    Raises:
        ValueError: naming the fix.
    """
    _check_accumulation_matches(model, info, steps_per_epoch)
    data.check_secure_sampling(info, model.optimizer.dp_settings.secure_mode)


def account_maps_releases(model, dataset):
    """Records in the model's ledger the `keras_dp.adapt` releases of the
    layers the pipeline's maps use (review round 120: keras-io's
    FeatureSpace in a map, epsilon 1 unreported), and names what else they
    read that may have been adapted to the data: fit's data, and each pass
    a custom loop's `PoissonBatches` draws (review round 175: a
    TextVectorization mapped before `poisson_dataset`, 2.72 reported
    against 2.83)."""
    source = _poisson_source(dataset)
    released = preprocessing.released_layers_in_maps(dataset,
                                                     data.source_functions_of(source))
    preprocessing.record_releases_of([preprocessing.release_of(layer) for layer in released],
                                     model.privacy_ledger)
    examples.warn_of_vocabularies_in_maps(dataset, accounted=released)


def draw_fresh(model, info):
    """Makes a Poisson dataset draw only passes its seed never drew on the
    model's variables (`keras_dp.ledger.PrivacyLedger.draw_fresh`): two
    datasets made with one seed would otherwise draw the same batches, which
    the accountant would count as independent. A seed from OS entropy is
    recorded too: it is readable (`SamplingInfo.seed`), and given again as a
    user's seed it would replay the draws."""
    if info.passes is not None:
        model.privacy_ledger.draw_fresh(info.seed, info.passes,
                                        chosen=info.seed_source == "user")


def _check_accumulation_matches(model, info, steps_per_epoch):
    """Refuses Poisson batches that would not line up with accumulation,
    microbatches or replicas.

    Each logical batch must be one Poisson draw; were the k physical
    batches of one update drawn separately (or started mid-way, or cut by
    an epoch's end), an example could join several and contribute more
    than C.
    """
    optimizer, strategy = model.optimizer, model.distribute_strategy
    replicas = distribute.num_replicas(strategy)
    # The builder that made it (review round 154: a user-level dataset was
    # told to be built again as one of examples).
    builder = "user_dataset" if info.unit == "user" else "poisson_dataset"
    if info.num_replicas != replicas:
        raise ValueError(
            f"This Poisson dataset splits each batch over num_replicas="
            f"{info.num_replicas}, but {type(strategy).__name__} "
            f"has {replicas} replicas: with microbatches, or batches the replicas "
            "cannot split evenly, an example could count twice. Build it with "
            f"keras_dp.data.{builder}(..., num_replicas={replicas}).")
    k = optimizer.dp_settings.accumulation_steps
    if info.accumulation_steps != k:
        raise ValueError(
            f"The optimizer accumulates gradient_accumulation_steps={k} batches, "
            f"but this Poisson dataset splits each draw into "
            f"{info.accumulation_steps}. Build it with "
            f"keras_dp.data.{builder}(..., accumulation_steps={k}).")
    microbatches = optimizer.dp_settings.num_microbatches
    if info.num_microbatches != microbatches:
        # Laid out for other microbatches, one example could shift the rows
        # after it into other microbatches and move several of them.
        raise ValueError(
            f"The optimizer splits each batch into num_microbatches={microbatches}, "
            f"but this Poisson dataset lays its batches out for "
            f"num_microbatches={info.num_microbatches}. Build it with "
            f"keras_dp.data.poisson_dataset(..., num_microbatches={microbatches}).")
    if steps_per_epoch and steps_per_epoch % k:
        raise ValueError(
            f"steps_per_epoch={steps_per_epoch} is not a multiple of "
            f"gradient_accumulation_steps={k}: an epoch would end inside a logical "
            "batch. Give a multiple of it, or leave steps_per_epoch out.")


def _check_not_mid_logical_batch(model):
    """Refuses a fit that would add its batches to a logical batch that
    train_on_batch or a custom loop left open: they could hold an example
    twice (the step refuses them too, `keras_dp.mechanism.Refusal`)."""
    optimizer = model.optimizer
    if optimizer.is_mid_logical_step():
        raise ValueError(
            "The optimizer is mid-way through a logical batch (train_on_batch or a "
            "custom loop stopped inside one of gradient_accumulation_steps="
            f"{optimizer.dp_settings.accumulation_steps} batches), and this fit's batches "
            "would join it. Finish it with more train_on_batch calls, or discard it "
            "with model.optimizer.abort_logical_step().")


def _check_shuffled_accumulation(optimizer, batches_per_pass, steps_per_epoch):
    """Refuses shuffled batches whose logical batches could span two passes.

    A pass holds each example once; with gradient accumulation over k
    batches, a logical batch that straddles the end of a pass could hold
    an example twice and move the noised sum by 2C.
    """
    k = optimizer.dp_settings.accumulation_steps
    if k == 1:
        return
    fix = ("Use Poisson sampling (fit on arrays with sampling='poisson', or "
           "keras_dp.data.poisson_dataset), or a batch_size that makes the "
           f"number of batches per pass a multiple of {k}.")
    if batches_per_pass is None:
        raise ValueError(
            f"gradient_accumulation_steps={k} needs the number of shuffled "
            f"batches per pass, and this input's length is unknown (or it repeats). {fix}")
    if steps_per_epoch not in (None, batches_per_pass):
        raise ValueError(
            f"With shuffled batches and gradient_accumulation_steps={k}, an "
            f"epoch must be one pass ({batches_per_pass} batches); received "
            f"steps_per_epoch={steps_per_epoch}. {fix}")
    if batches_per_pass % k:
        raise ValueError(
            f"A pass of {batches_per_pass} shuffled batches is not a multiple "
            f"of gradient_accumulation_steps={k}, so a logical batch would "
            f"span two passes and could hold an example twice. {fix}")


def _check_not_one_example_per_microbatch(optimizer, batch_size):
    """Refuses TF Privacy's per-example setting, num_microbatches=batch_size,
    which here means fixed groups of Poisson batches (sensitivity 2C and
    the slow engine), not per-example clipping."""
    if optimizer.dp_settings.num_microbatches == batch_size:
        raise ValueError(
            f"num_microbatches={batch_size} equals batch_size: in TF Privacy that "
            "clips each example; keras-dp does so by default, exactly and on its fast "
            "engine. Drop num_microbatches (None). See "
            "docs/migrating_from_tf_privacy.md.")


def _check_microbatches_divide(model, num_examples, batch_size):
    """Refuses, before any step, a last shuffled batch whose share of
    each replica the optimizer's num_microbatches does not divide."""
    k = model.optimizer.dp_settings.num_microbatches
    replicas = distribute.num_replicas(model.distribute_strategy)
    if k and (num_examples % batch_size) % (k * replicas):
        raise ValueError(
            f"num_microbatches={k} does not divide the last batch of "
            f"{num_examples % batch_size} examples ({num_examples} examples in "
            f"batches of {batch_size}, split over {replicas} replicas). Use a "
            "number of examples that batch_size divides, sampling='poisson', or "
            "num_microbatches=None."
        )


def _check_no_grouped_microbatches(model, batch_size):
    """Refuses, before any step, microbatches of several examples in shuffled
    batches of `batch_size` (None: of a dataset keras-dp did not draw, any),
    which the step would refuse (`Refusal.SPLIT_MICROBATCHES`): grouped by
    position, one example added moves every later one (review rounds 150,
    151)."""
    k = model.optimizer.dp_settings.num_microbatches
    if k and k * distribute.num_replicas(model.distribute_strategy) != batch_size:
        raise ValueError(f"Microbatches of shuffled batches are refused before training: "
                         f"{mechanism.Refusal.SPLIT_MICROBATCHES.message}")


def _is_in_memory(x):
    """True for arrays or tensors (or structures of them), which fit can sample."""
    leaves = tf.nest.flatten(x)
    return bool(leaves) and all(hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                                and not isinstance(leaf, tf.data.Dataset)
                                for leaf in leaves)


def _num_rows(x):
    return int(tf.nest.flatten(x)[0].shape[0])


def _split_off_validation(arrays, validation_split, seed):
    """validation_split of a private fit: each row held out independently
    with probability `validation_split`, before sampling. Not Keras' last
    fraction of the rows: a split by position lets one example added in
    front push another into validation, a replacement accounted as an
    addition (review round 42: 2 C recorded C; 1.65 reported against at
    least 1.93). Coins drawn independently of the rows keep neighbours
    neighbours: every other row keeps its side, whatever is added."""
    held_out = np.random.default_rng(seed).random(_num_rows(arrays[0])) < validation_split

    def rows(indices):
        return tf.nest.map_structure(
            lambda a: None if a is None else (
                tf.gather(a, indices) if tf.is_tensor(a) else a[indices]), arrays)

    return rows(np.flatnonzero(~held_out)), rows(np.flatnonzero(held_out))


def _by_position(data):
    """`data` (fit's x, y, sample weights or user ids) with pandas' objects
    as numpy arrays, which fit samples and splits by position: pandas' `[]`
    selects by label, so the validation split of a shuffled Series of labels
    beside a numpy x paired each x with another example's label (review
    round 49: 2 C recorded C)."""
    return tf.nest.map_structure(
        lambda leaf: leaf.to_numpy() if hasattr(leaf, "to_numpy") else leaf, data)


def _split_seed(model):
    """The seed of a fit's validation split: from OS entropy, or derived
    from the optimizer's seed (reproducible) and the steps taken."""
    seed = model.optimizer.dp_settings.seed
    if seed is None:
        return secrets.randbits(64)
    return np.random.SeedSequence([seed, model.privacy_steps, 1])

def _epoch_is_one_pass(sampling, repeats, batches_per_pass, steps_per_epoch):
    """Whether an epoch of a dataset or generator is one pass over its data.

    Only on the user's statement (`sampling="shuffle"`: each epoch holds
    each example at most once), and when the input repeats nothing and
    Keras runs each epoch to its end (no `steps_per_epoch`, or exactly the
    `batches_per_pass` it holds). Otherwise every step is accounted as a
    full Gaussian release (`unsampled_warning` says which).
    """
    return (sampling is sampling_schemes.ShuffledPasses and not repeats
            and steps_per_epoch in (None, batches_per_pass))


def unsampled_warning(noise_multiplier, epochs, one_pass, repeats=False, batch_size=None,
                      num_examples=None, delta=None):
    """The one warning for batches keras-dp did not sample: how they are
    accounted, and what the one-line conversion to its Poisson sampling gives.

    Args:
        noise_multiplier: sigma.
        epochs: the epochs of the fit.
        one_pass: whether each epoch is accounted as one Gaussian release
            (on the user's statement, `sampling="shuffle"`), else each step.
        repeats: whether an epoch may hold an example more than once (the
            input repeats, or `steps_per_epoch` cuts it).
        batch_size: B, if known.
        num_examples: N (about: batches times B for a dataset), if known.
        delta: the delta of the epsilons; default
            `accounting.default_delta(num_examples)`.

    Returns:
        The warning's text. The same text is in docs/privacy_accounting.md.
    """
    if one_pass:
        how = ("on your statement that each epoch holds every example at most once, "
               "each epoch is accounted as one Gaussian release")
    else:
        how = "each step is accounted as a full Gaussian release"
        if repeats:
            how += (" (an epoch may hold an example more than once: the input repeats, "
                    "or steps_per_epoch is set)")
    figures = ""
    if batch_size and num_examples and noise_multiplier and batch_size <= num_examples:
        delta = delta or accounting.default_delta(num_examples)
        as_run = accounting.compute_epsilon(
            num_examples, batch_size, noise_multiplier, delta, epochs=epochs,
            sampling="shuffle") if one_pass else accounting.compute_epsilon(
            1, 1, noise_multiplier, delta,
            steps=math.ceil(epochs * math.ceil(num_examples / batch_size)))
        poisson = accounting.compute_epsilon(num_examples, batch_size, noise_multiplier,
                                             delta, epochs=epochs)
        figures = (f" For {epochs:g} epochs of about {num_examples} examples at delta "
                   f"{delta:.3g}: epsilon {as_run:.4g} as accounted, {poisson:.4g} with "
                   "keras-dp's Poisson sampling.")
    return (f"keras-dp did not sample these batches, so {how}: no amplification by "
            f"sampling.{figures} One line converts: fit on "
            "keras_dp.data.poisson_dataset(dataset.unbatch(), expected_batch_size="
            f"{batch_size or 'B'}) (or on arrays, sampled by default).")
