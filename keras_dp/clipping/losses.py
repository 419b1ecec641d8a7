"""Per-example losses built from a model's compiled loss.

The ghost engine differentiates the sum of per-example losses; entry i
must equal the compiled loss of the batch made of example i alone, which is
what the vectorized engine differentiates with one microbatch per example.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from keras.src.losses.losses import LossFunctionWrapper  # Not exported by keras.losses.

from keras_dp.clipping.captures import batch_source
from keras_dp.clipping.captures import last_op_id
from keras_dp.clipping.captures import reads_from_before
from keras_dp.clipping.recorder import PATCH_LOCK
from keras_dp.clipping.registry import UnsupportedModelError



# Keras loss functions whose value for row i depends on row i alone, as long
# as they reduce over no axis but the last (see `_is_row_wise`). Any other loss
# (Circle, Dice and Tversky with axis=None, a user's function or Loss
# subclass) may compare the rows of a batch, so it is evaluated on each
# example alone: exactly what the vectorized engine differentiates.
# Not hinge and squared_hinge: they map labels {0, 1} to {-1, 1} only when
# every label of the batch is 0 or 1, so one example's label decides the
# others' (review round 59: one added example zeroed every other gradient,
# 8 C at B = 8, 16 C through fit); they are evaluated per example.
_ROW_WISE_FUNCTIONS = frozenset([
    keras.losses.binary_crossentropy, keras.losses.binary_focal_crossentropy,
    keras.losses.categorical_crossentropy, keras.losses.categorical_focal_crossentropy,
    keras.losses.categorical_hinge, keras.losses.cosine_similarity, keras.losses.ctc,
    keras.losses.huber, keras.losses.kl_divergence,
    keras.losses.log_cosh, keras.losses.mean_absolute_error,
    keras.losses.mean_absolute_percentage_error, keras.losses.mean_squared_error,
    keras.losses.mean_squared_logarithmic_error, keras.losses.poisson,
    keras.losses.sparse_categorical_crossentropy,
])


# Losses whose labels are one rank below the predictions (class ids): for
# any other, such labels broadcast against the last axis of the predictions
# (review round 29: labels [B] against mse's [B, d] predictions, 8 C at B = 8).
_SPARSE_LABELS = frozenset([keras.losses.sparse_categorical_crossentropy, keras.losses.ctc])


def _is_row_wise(loss, y_true, y_pred):
    """True when `loss.call` on a batch gives row i's value from row i alone.

    Only Keras' own `call` (that of `LossFunctionWrapper`, applying `fn`) is
    known to: a subclass overriding it (hard-example mining, normalizing by
    the batch mean) may compare the rows however it inherits `fn`. Labels of
    another rank than the predictions' (or one less for class ids) would be
    broadcast against them across the batch (review round 24: labels
    [B, 1, d] against predictions [B, d] gave every example every
    prediction, B C).
    """
    if getattr(type(loss), "call", None) is not LossFunctionWrapper.call:
        return False
    if getattr(loss, "fn", None) not in _ROW_WISE_FUNCTIONS:
        return False
    # Rank-1 predictions: the last axis IS the batch axis.
    rank = min(len(t.shape) for t in tf.nest.flatten(y_pred))
    label_ranks = {len(t.shape) for t in tf.nest.flatten(y_true)}
    ranks = {rank, rank - 1} if loss.fn in _SPARSE_LABELS else {rank}
    axis = getattr(loss, "_fn_kwargs", {}).get("axis", -1)
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    return (rank >= 2 and label_ranks <= ranks
            and all(a is not None and a % rank != 0 for a in axes))


# Activations whose input Keras' cross-entropies read in place of their
# output (`_get_logits` in Keras' TensorFlow backend).
_LOGIT_ACTIVATIONS = frozenset(["Softmax", "Sigmoid"])


def _logits_of(y_pred):
    """The logits Keras' cross-entropies read for each output of `y_pred`
    made by a softmax or sigmoid: that op's input. Its rows are the
    examples wherever the output's are (the op keeps rows apart, and the
    forward pass is read through it). A `_keras_logits` attribute naming any
    other tensor is not among them, so a loss reading one is refused."""
    return [t.op.inputs[0] for t in tf.nest.flatten(y_pred)
            if not tf.executing_eagerly() and hasattr(t, "op")
            and t.op.type in _LOGIT_ACTIVATIONS]


def _check_keras_logits(loss, y_pred):
    """Refuses an output whose `_keras_logits` (what Keras' cross-entropies
    read in its place) are not its softmax's or sigmoid's input: the
    per-example losses would not be the model's (review round 127: logits
    from a constant gave every example a gradient of 0 under ghost)."""
    logits = {t.ref() for t in _logits_of(y_pred)}
    for output in tf.nest.flatten(y_pred):
        claimed = getattr(output, "_keras_logits", None)
        if claimed is not None and getattr(claimed, "ref", None) and claimed.ref() not in logits:
            raise UnsupportedModelError(
                f"Loss '{loss.name}' would read the _keras_logits of {output.name}, which "
                "are not the input of the softmax or sigmoid that made it, so ghost clipping "
                "cannot vouch for each example's loss. Return the activation's output "
                "without _keras_logits, or use the vectorized engine "
                '(clipping_engine="auto" falls back to it).')


def _loss_values(loss, y_true, y_pred, row_wise):
    """`loss.call` on the whole batch (`row_wise`) or on each example alone,
    stacked: `[B, ...]`.

    What the ops it makes read from the step around them must be y_true,
    y_pred or values not computed from the batch: a value of the batch
    among them (a batch statistic a layer kept on a Python object, review
    round 22: 7.9 C at B = 9; a label smoothing object holding one, round
    24: 6.4 C) would make each example's loss depend on the others. (Read
    from the ops made, in the step's graph: a function of their own made
    XLA compile every step again.)

    Raises:
        UnsupportedModelError: for such a value (the vectorized engine,
            which computes it from each example alone, is exact).
    """
    # Keras' cross-entropies read a softmax's or sigmoid's input in place of
    # its output, which a row sliced off the output no longer shows: each
    # row is given its own (review round 186: without them, a saturated
    # sigmoid's binary cross-entropy had a gradient of 0.02 for Keras' 134).
    flat_pred = tf.nest.flatten(y_pred)
    with_logits = [i for i, t in enumerate(flat_pred) if _logits_of([t])]

    def one_example(row):
        row_true, row_pred, row_logits = row
        row_true, row_pred = tf.nest.map_structure(lambda t: t[None], (row_true, row_pred))
        outputs = tf.nest.flatten(row_pred)
        for index, logits in zip(with_logits, row_logits):
            outputs[index]._keras_logits = logits[None]
        values = ops.convert_to_tensor(loss.call(row_true, row_pred))
        # A leading axis of one is that example's batch axis.
        return values[0] if values.shape.rank and values.shape[0] == 1 else values

    def each_example():
        return tf.vectorized_map(one_example, (y_true, y_pred, _logits_of(y_pred)))

    if tf.executing_eagerly():  # An eager step runs as its checked trace.
        return loss.call(y_true, y_pred) if row_wise else each_example()
    _check_keras_logits(loss, y_pred)
    graph = tf.compat.v1.get_default_graph()
    start = last_op_id(graph)
    values = loss.call(y_true, y_pred) if row_wise else each_example()
    read = reads_from_before(graph, (start, last_op_id(graph)),
                             (y_true, y_pred, _logits_of(y_pred)))
    found = next(((t, source) for t in read if (source := batch_source(t)) is not None), None)
    if found is not None:
        raise UnsupportedModelError(
            f"Loss '{loss.name}' reads {found[0].name}, computed from the whole batch "
            f"({found[1].name}), so ghost clipping cannot give each example its own "
            "loss. Compute the loss from y_true and y_pred alone, or use the vectorized "
            "engine (clipping_engine=\"auto\" falls back to it).")
    return values


class _PerExampleLoss:
    """Wraps a Keras `Loss`: returns the [B] vector whose entry i is the loss's
    value on the batch made of example i alone (its reduction, sample weight
    and Keras mask included). Row-wise Keras losses are evaluated once on the
    whole batch; any other loss on each example alone, so that no example's
    loss (hence gradient) can depend on the other examples of the batch."""

    _REDUCTIONS = ("sum_over_batch_size", "mean", "sum", "mean_with_sample_weight")

    def __init__(self, loss):
        if loss.reduction not in self._REDUCTIONS:
            raise ValueError(
                f"Loss '{loss.name}' has reduction={loss.reduction!r}; per-example losses "
                f"are defined for reductions {self._REDUCTIONS}.")
        self.loss = loss

    def __call__(self, y_true, y_pred, sample_weight=None):
        from keras.src.backend.common.masking import get_keras_mask
        from keras.src.losses import loss as loss_module

        loss = self.loss
        in_mask = get_keras_mask(y_pred)
        y_pred = tf.nest.map_structure(lambda t: ops.convert_to_tensor(t, dtype=loss.dtype), y_pred)
        y_true = tf.nest.map_structure(lambda t: ops.convert_to_tensor(t, dtype=loss.dtype), y_true)
        values = _loss_values(loss, y_true, y_pred, _is_row_wise(loss, y_true, y_pred))
        out_mask = get_keras_mask(values)
        masks = [m for m in (in_mask, out_mask) if m is not None]
        mask = None if not masks else (masks[0] if len(masks) == 1 else masks[0] & masks[1])
        values = ops.convert_to_tensor(values, dtype=loss.dtype)
        weights = (None if sample_weight is None
                   else ops.convert_to_tensor(sample_weight, values.dtype))
        # A weight per example (the padding weights of Poisson batches) holds
        # for each of its masked values (a sequence's tokens): Keras would
        # multiply [B] by a [B, T] mask.
        while weights is not None and mask is not None and len(weights.shape) < len(mask.shape):
            weights = ops.expand_dims(weights, -1)
        # Merge the mask as 0/1 weights; the per-example rescaling follows.
        weights = loss_module.apply_mask(weights, mask, dtype=values.dtype, reduction="sum")
        if weights is not None:
            values, weights = loss_module.squeeze_or_expand_to_same_rank(values, weights)
            if len(weights.shape) > len(values.shape):
                # Review round 24: weights [B, 1, T] against values [B, T]
                # broadcast to [B, B, T], every example's weight on every
                # other's loss (8.9 C at B = 9).
                raise UnsupportedModelError(
                    f"sample_weight of shape {weights.shape} has more axes than the "
                    f"loss values {values.shape}, so broadcasting would spread it across "
                    "the examples of a batch. Give one weight per example (or one per "
                    'loss value); clipping_engine="auto" otherwise runs the vectorized '
                    "engine, which weighs each example alone.")
            # A weight per example (the padding weights of Poisson batches)
            # applies to all of its loss values, e.g. every token of a sequence.
            while len(weights.shape) < len(values.shape):
                weights = ops.expand_dims(weights, -1)
            values = values * ops.cast(weights, values.dtype)
        rank = len(values.shape)
        per_example = ops.sum(values, axis=list(range(1, rank))) if rank > 1 else values
        count = float(np.prod(values.shape[1:])) if rank > 1 else 1.0
        if loss.reduction in ("sum_over_batch_size", "mean"):
            if mask is None:
                per_example = per_example / count
            else:  # Keras divides by the number of unmasked entries.
                mask = ops.cast(mask, values.dtype)
                valid = (ops.sum(mask, axis=list(range(1, len(mask.shape))))
                         if len(mask.shape) > 1 else mask)
                total = float(np.prod(mask.shape[1:])) if len(mask.shape) > 1 else 1.0
                per_example = ops.divide_no_nan(per_example * total / count, valid)
        elif loss.reduction == "mean_with_sample_weight":
            if weights is None:
                per_example = per_example / count
            else:
                w_rank = len(weights.shape)
                divisor = ops.sum(weights, axis=list(range(1, w_rank))) if w_rank > 1 else weights
                per_example = ops.divide_no_nan(per_example, ops.cast(divisor, values.dtype))
        return loss_module.scale_loss_for_distribution(per_example)


def real_rows(batch):
    """Which rows of `batch` have a non-zero sample weight, in some output.

    A row whose weights are all 0 (the padding of Poisson batches) takes
    no part in the loss: the engines take its loss and gradient as exactly
    0, even where its forward pass is not finite (a mean pooling over a
    fully masked row is 0 / 0), and never count it as non-finite.

    Args:
        batch: an engine's batch (`engine.as_batch`) or microbatch.

    Returns:
        A `[B]` bool tensor, or None without sample weights (every row is real).
    """
    weights = [w for w in tf.nest.flatten(batch.get("sample_weight")) if w is not None]
    if not weights:
        return None
    nonzero = [tf.not_equal(tf.convert_to_tensor(w), 0) for w in weights]
    return tf.reduce_any(tf.stack([tf.reduce_any(tf.reshape(w, [tf.shape(w)[0], -1]), axis=1)
                                   for w in nonzero]), axis=0)


def per_example_loss_fn(model):
    """Builds `(batch, y_pred) -> [B]` per-example losses from `model.compile(loss=...)`.

    Entry i equals the compiled loss (`model._compile_loss`) of the batch made
    of example i alone, which is what `keras_dp.clipping` differentiates with
    one microbatch per example: loss names, multiple outputs (list or dict),
    `loss_weights`, sample weights (also per output) and Keras masks are
    handled by Keras' own CompileLoss, whose losses are swapped for their
    per-example versions during the call.

    Unsupported (raises): losses with reduction "none" or a custom reduction,
    losses that are not `keras.losses.Loss` objects or functions. The
    per-output loss trackers of a multi-output model are updated with the
    [B] vector of per-example losses (their mean per batch is the batch loss).
    """
    compile_loss = model._compile_loss
    if compile_loss is None:
        raise ValueError("The model has no compiled loss; call compile(loss=...) first.")

    def fn(batch, y_pred):
        with _per_example_losses(compile_loss):
            losses = compile_loss.call(batch.get("y"), y_pred, batch.get("sample_weight"))
        return tf.reshape(losses, [-1])

    return fn


@contextlib.contextmanager
def _per_example_losses(compile_loss):
    with PATCH_LOCK:
        original_build = compile_loss.build
        state = {"flat": compile_loss._flat_losses}

        def swap():
            state["flat"] = compile_loss._flat_losses
            compile_loss._flat_losses = [
                entry._replace(loss=_PerExampleLoss(entry.loss)) for entry in state["flat"]]

        def build(y_true, y_pred):
            original_build(y_true, y_pred)
            swap()

        if compile_loss.built:
            swap()
        object.__setattr__(compile_loss, "build", build)
        try:
            yield
        finally:
            compile_loss.__dict__.pop("build", None)
            compile_loss._flat_losses = state["flat"]
