"""A private model's compiled metrics, built before its first step.

Keras 3 on TensorFlow, outside a distribution strategy, builds the compiled
metrics inside the first trace of the train (or test) function. The metric
variables that trace creates make `tf.function` trace the whole function a
second time, and a private step is costly to trace: on a small model, half
of a short fit. Built beforehand from the shapes of the batches, as Keras
itself does under a strategy, the step is traced once.
"""

import tensorflow as tf
from keras.src import backend
from keras.src.trainers.data_adapters import data_adapter_utils


def build_before_first_step(model, iterator=None, data_batch=None):
    """Builds `model`'s compiled metrics from the shapes of its batches.

    Args:
        model: a compiled private model.
        iterator: Keras' epoch iterator of `fit` or `evaluate` (its dataset's
            element spec gives the shapes; no batch is drawn).
        data_batch: `(x, y, sample_weight)` of `train_on_batch` or
            `test_on_batch`, when there is no iterator.
    """
    metrics = model._compile_metrics
    if (metrics is None or metrics.built or model._distribute_strategy is not None
            or not model.built):
        return  # Under a strategy, Keras' own symbolic build made them.
    try:
        batch = _symbolic_batch(iterator, data_batch)
        if batch is None:
            return
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch)
        y_pred = backend.compute_output_spec(model, x, training=False)
        backend.compute_output_spec(model.compute_metrics, x, y, y_pred,
                                    sample_weight=sample_weight)
    except Exception:  # noqa: BLE001
        # Only a speed-up: batches Keras cannot describe symbolically (NumPy
        # strings, an unknown rank) or a model it cannot run on symbolic
        # inputs build the metrics in the first step, as before.
        return


def _symbolic_batch(iterator, data_batch):
    """Keras tensors of the batches' shapes and dtypes; None unless every
    part is a dense tensor of known rank (or the spec of one)."""
    if iterator is not None:
        dataset = getattr(iterator, "_distributed_dataset", None)
        data_batch = dataset.element_spec if isinstance(dataset, tf.data.Dataset) else None
    parts = [part for part in tf.nest.flatten(data_batch) if part is not None]
    if not parts or not all(_dense(part) for part in parts):
        return None
    return with_unknown_rows(data_batch)


def with_unknown_rows(data_batch):
    """Keras tensors of the shapes and dtypes of `data_batch`'s parts, the
    batch axis's length unknown: a model built on them never shows a layer
    the batch's size, which one added example changes (review round 192: a
    layer kept the size the metrics' build showed it and flipped every
    example's sign in the step when odd, 6.28 C; the step hides it too,
    `keras_dp.clipping.engine.with_unknown_rows`)."""
    def unknown_rows(part):
        shape = tuple(part.shape)
        return backend.KerasTensor((None, *shape[1:]) if shape else shape,
                                   backend.standardize_dtype(part.dtype))
    return tf.nest.map_structure(
        lambda part: None if part is None else unknown_rows(part), data_batch)


def _dense(part):
    if isinstance(part, tf.TypeSpec):
        return isinstance(part, tf.TensorSpec) and part.shape.rank is not None
    return (hasattr(part, "shape") and hasattr(part, "dtype")
            and not isinstance(part, (tf.RaggedTensor, tf.SparseTensor)))
