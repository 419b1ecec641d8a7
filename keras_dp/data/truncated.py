"""Truncated Poisson sampling: one compiled shape, its truncation accounted exactly."""

import math

import tensorflow as tf

from keras_dp import sampling_schemes
from keras_dp.data.examples import DEFAULT_MAX_DATASET_BYTES
from keras_dp.data.examples import examples_of
from keras_dp.data.examples import function_graphs
from keras_dp.data.examples import to_tensors
from keras_dp.data.info import SamplingInfo
from keras_dp.data.info import check_int
from keras_dp.data.info import attach
from keras_dp.data.info import attach_source_functions
from keras_dp.data.info import seed_and_source
from keras_dp.data.poisson import EVERY_WORKER_EVERY_BATCH
from keras_dp.data.poisson import Passes
from keras_dp.data.poisson import batch_of_rows
from keras_dp.data.poisson import draws


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
    source_functions = ()
    if isinstance(x, tf.data.Dataset) and y is None and sample_weight is None:
        source_functions = function_graphs(x)
        x, y, sample_weight = examples_of(x, max_dataset_bytes)
    data, num_examples = to_tensors(x, y, sample_weight)
    check_int("expected_batch_size", expected_batch_size, minimum=1,
               maximum=num_examples, maximum_name="the number of examples")
    check_int("max_batch_size", max_batch_size, minimum=expected_batch_size,
               maximum=num_examples, minimum_name="expected_batch_size",
               maximum_name="the number of examples")
    if steps_per_epoch is None:
        steps_per_epoch = math.ceil(num_examples / expected_batch_size)
    check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    seed, seed_source = seed_and_source(seed, secure_mode)
    rate = expected_batch_size / num_examples

    def make_batch(step, step_seed):
        source = _truncated_draw(step_seed, num_examples, rate, max_batch_size)
        return batch_of_rows(data, source, max_batch_size)

    passes = Passes()
    dataset = draws(seed, steps_per_epoch, make_batch, passes).prefetch(tf.data.AUTOTUNE)
    dataset = dataset.with_options(EVERY_WORKER_EVERY_BATCH)
    attach(dataset, SamplingInfo(
        sampling=sampling_schemes.TruncatedPoissonSampling.name,
        batch_size=expected_batch_size, num_examples=num_examples,
        physical_batch_size=max_batch_size, padding_multiple=max_batch_size,
        steps_per_epoch=steps_per_epoch, seed=seed, seed_source=seed_source, passes=passes))
    attach_source_functions(dataset, source_functions)
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
