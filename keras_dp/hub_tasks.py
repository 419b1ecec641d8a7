"""Keras Hub task models made private: their preprocessor runs on each
example alone, before keras-dp samples the batches, so a preprocessed row
is still one example."""

import keras
import tensorflow as tf

from keras_dp import data
from keras_dp.data.info import attach


def preprocessed_examples(model, x, y, sample_weight):
    """`(x, y, sample_weight)` after a Keras Hub task's preprocessor
    (`model.preprocess_samples`), applied to each example alone: arrays and
    unbatched datasets become arrays of preprocessed examples; the batches of
    a dataset are mapped (a preprocessor treats each row by itself). Other
    models' data is returned as is."""
    if getattr(model, "preprocessor", None) is None or x is None:
        return x, y, sample_weight
    preprocess = model.preprocess_samples
    if isinstance(x, tf.data.Dataset) and data.is_batched(x):
        info = data.sampling_info_of(x)
        if info is not None:
            return _each_row_alone(x, preprocess, info), None, None
        return x.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE), None, None
    if not isinstance(x, tf.data.Dataset):
        packed = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        x = tf.data.Dataset.from_tensor_slices(packed)
    examples = x.map(lambda *example: preprocess(*example),
                     num_parallel_calls=tf.data.AUTOTUNE)
    return data.examples_of(examples)


def _each_row_alone(batches, preprocess, info):
    """keras-dp's Poisson `batches` with `preprocess` run on each row alone,
    one batch out per batch in. A map over the batches would be refused (a
    preprocessor's graph is not one `data.check_batch_map` can read); this
    keeps each row its example's by construction, so the batches keep `info`."""
    def rows_alone(*batch):
        rows = tf.data.Dataset.from_tensor_slices(batch).map(
            lambda *row: _weighted_alone(preprocess, *row))
        return rows.batch(tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0])

    result = batches.flat_map(rows_alone).apply(
        tf.data.experimental.assert_cardinality(batches.cardinality()))
    attach(result, info)
    return result


def _weighted_alone(preprocess, x, y, weight):
    """`preprocess` of one row `(x, y, weight)` of keras-dp's draw, its
    sample weights times the row's: a task's preprocessor may return weights
    of its own (a masked LM's mask weights, a causal LM's padding mask) in
    place of the one it was given, which gave keras-dp's padding rows
    (weight 0, copies of a real row) their weight back (review round 47:
    one example counted once per padding row, 7.7 C recorded C)."""
    x, y, own = keras.utils.unpack_x_y_sample_weight(preprocess(x, y, weight))
    weight = tf.cast(weight, tf.float32)
    if own is None:
        return x, y, weight
    return x, y, tf.nest.map_structure(lambda w: tf.cast(w, tf.float32) * weight, own)


def preprocessed_validation(model, validation_data):
    """fit's `validation_data` after a Keras Hub task's preprocessor (see
    `preprocessed_examples`): a dataset of batches stays one, examples
    become an `(x, y, sample_weight)` tuple of arrays."""
    if getattr(model, "preprocessor", None) is None:
        return validation_data
    if isinstance(validation_data, tf.data.Dataset):
        parts = (validation_data, None, None)
    else:
        parts = keras.utils.unpack_x_y_sample_weight(validation_data)
    x, y, sample_weight = preprocessed_examples(model, *parts)
    return x if isinstance(x, tf.data.Dataset) else (x, y, sample_weight)
