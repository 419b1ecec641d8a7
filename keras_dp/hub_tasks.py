"""Keras Hub task models made private: their preprocessor runs on each
example alone, before keras-dp samples the batches, so a preprocessed row
is still one example."""

import keras
import tensorflow as tf

from keras_dp import data


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
        return x.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE), None, None
    if not isinstance(x, tf.data.Dataset):
        packed = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        x = tf.data.Dataset.from_tensor_slices(packed)
    examples = x.map(lambda *example: preprocess(*example),
                     num_parallel_calls=tf.data.AUTOTUNE)
    return data.examples_of(examples)


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
