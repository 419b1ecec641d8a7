"""User-level Poisson sampling: every row of a sampled user, at most k of them."""

import dataclasses
import hashlib

import numpy as np
import tensorflow as tf

from keras_dp.data.examples import to_tensors
from keras_dp.data.info import attach
from keras_dp.data.info import check_int
from keras_dp.data.info import sampling_info_of
from keras_dp.data.info import seed_and_source
from keras_dp.data.poisson import sampled_batches


# Rows a user brings to a step unless told otherwise (`user_dataset`).
DEFAULT_MAX_EXAMPLES_PER_USER = 8


# Tells the random stream of `user_dataset`'s row selection from its batches'.
_SELECTION_STREAM = 0x5E1EC7


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
    data, num_rows = to_tensors(x, y, sample_weight)
    check_int("max_examples_per_user", max_examples_per_user, minimum=1)
    users, num_users = user_indices(user_ids, num_rows)
    seeds = seed_and_source(seed, secure_mode)
    unit_rows = _rows_of_users(users, num_users, max_examples_per_user, seeds[0])
    dataset = sampled_batches(
        data, num_users, expected_users_per_batch, seeds=seeds,
        max_batch_size=max_users_per_batch, steps_per_epoch=steps_per_epoch,
        num_microbatches=None, accumulation_steps=accumulation_steps,
        num_replicas=num_replicas, padding_multiple=padding_multiple,
        unit_rows=unit_rows)
    attach(dataset, dataclasses.replace(sampling_info_of(dataset),
                                        users_digest=user_digest(user_ids)))
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
        ValueError: for ids that are not one per row, or that do not name
            one user each (`_check_no_nan`, `_grouped`).
    """
    _check_one_kind(user_ids)
    ids = np.asarray(user_ids)
    if ids.ndim != 1 or len(ids) != num_rows:
        raise ValueError(
            f"user_ids must give one user per row: a 1-D array of length {num_rows} "
            f"(the rows of x); received shape {ids.shape}. Pass the user id of "
            "every example, in the order of x.")
    _check_no_nan(ids)
    unique, indices = _grouped(ids)
    return indices.astype(np.int64).reshape(-1), len(unique)


def _check_one_kind(user_ids):
    """Refuses a list or tuple of ids of several kinds (ints, floats,
    strings, ...): numpy makes them one type, which merges ids Python tells
    apart (review round 104: [1, "1"] became two strings "1", and 2**53 and
    2**53 + 1 beside a float one float; an added user joined another's unit,
    2 C moved)."""
    if isinstance(user_ids, (list, tuple)):
        kinds = {_kind(user_id) for user_id in user_ids}
        if len(kinds) > 1:
            raise ValueError(
                f"user_ids mixes ids of several kinds ({', '.join(sorted(kinds))}), which "
                "numpy would make one type, merging ids that differ (1 and '1'). Pass ids "
                "of one kind: all ints or all strings.")


def _kind(user_id):
    if isinstance(user_id, (bool, np.bool_)):
        return "bool"
    if isinstance(user_id, (int, np.integer)):
        return "int"
    if isinstance(user_id, (float, np.floating)):
        return "float"
    if isinstance(user_id, (str, bytes, np.str_, np.bytes_)):
        return "str"
    return type(user_id).__name__


def _check_no_nan(ids):
    """Refuses an id not equal to itself (NaN): it names no user, and in an
    array of objects it breaks the sort that groups ids (review round 64:
    NaN among Python ints split one user into 3 units, each clipped to C)."""
    if np.any(np.asarray(ids != ids, dtype=bool)):
        raise ValueError(
            "user_ids hold NaN (or another value not equal to itself), which names no "
            "user. Give every row the id of its user: e.g. a new id of its own for each "
            "row whose user is unknown.")


def _grouped(ids):
    """np.unique of `ids` with the index of each, refused unless every id
    fell in one group: the sort of an array of objects trusts their order,
    which ids of mixed or partially ordered types (sets) may not have."""
    try:
        unique, indices = np.unique(ids, return_inverse=True)
    except TypeError:
        unique, indices = None, None
    if unique is None or (unique.dtype == object and len(set(unique.tolist())) != len(unique)):
        raise ValueError(
            "user_ids could not be grouped: ids of these types have no consistent order, "
            "so one user could fall into several groups. Pass ids of one type that sorts: "
            "ints or strings.")
    return unique, indices


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
