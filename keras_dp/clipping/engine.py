"""The clipping engine of a private model's step: which one, and running it.

A private model's `clipping_engine` is "auto" (default), "ghost" or
"vectorized". "auto" picks ghost clipping (`ghost`) when each example is its
own microbatch and every trainable layer has a norm function, else the
vectorized engine (`vectorized`); both are exact, so the choice changes
speed and memory, never the clipped sum. The engines take a batch as a dict
(`as_batch`), bound each example as the step's `bounds.Bound` says, and return
the same `bounds.ClippedSum`.
"""

import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask

from keras_dp import distribute
from keras_dp.clipping import ghost
from keras_dp.clipping import independence
from keras_dp.clipping import vectorized
from keras_dp.clipping.layers import recurrent
from keras_dp.clipping.losses import real_rows

ENGINES = ("auto", "ghost", "vectorized")


def check_engine(engine):
    """Refuses a `clipping_engine` other than those of `ENGINES`.

    Args:
        engine: the value given for `clipping_engine`.

    Raises:
        ValueError: for any other value.
    """
    if engine not in ENGINES:
        raise ValueError(f'clipping_engine must be "auto", "ghost" or "vectorized"; '
                         f"received {engine!r}.")


def uses_ghost(model):
    """Whether `model`'s step clips with the ghost engine.

    Args:
        model: a private model, compiled with a DP optimizer.

    Returns:
        True for "ghost", and for "auto" when `ghost.supports(model)` with
        one microbatch per example; False otherwise.

    Raises:
        ValueError: for `clipping_engine="ghost"` on a model it does not cover.
    """
    engine = model.clipping_engine
    if engine == "vectorized":
        return False
    per_example = model.optimizer.num_microbatches is None
    if engine == "ghost" and not (per_example and ghost.supports(model)):
        raise ValueError(
            'clipping_engine="ghost" needs num_microbatches=None and a norm '
            "function for every trainable layer; missing for: "
            f"{ghost.unsupported_layers(model)}. Register one with "
            'keras_dp.register_norm_function, or use clipping_engine="auto".')
    return per_example and ghost.supports(model)


def as_batch(x, y, sample_weight):
    """The engines' batch: a dict of `x`, `y` and, if given, `sample_weight`."""
    batch = {"x": x, "y": y}
    if sample_weight is not None:
        batch["sample_weight"] = sample_weight
    return batch


def clipped_gradient_sum(model, batch, num_microbatches, variables, l2_norm_clip,
                         report=None):
    """Runs `model`'s engine (see `uses_ghost`) on one replica's batch.

    Args:
        model: a private model, compiled with a DP optimizer.
        batch: the batch, as made by `as_batch`.
        num_microbatches: scalar int tensor; the batch size when each example
            is its own microbatch.
        variables: the trainable variables to differentiate.
        l2_norm_clip: C of the step (a float32 tensor: the one its mechanism
            fixed), or its `keras_dp.clipping.bounds.Bound` (per-layer
            clipping, normalization).
        report: optional `report(engine, reason)`, called once per trace with
            the engine that runs ("ghost" or "vectorized") and, when "auto"
            did not use ghost clipping, why (else None).

    Returns:
        A `keras_dp.clipping.bounds.ClippedSum`: the clipped sums (one per
        variable), the per-microbatch losses, the model's outputs, how many
        microbatches had a non-finite gradient (they contributed zero) and the
        centered count of those within their bound (for adaptive clipping).
    """
    report = report or (lambda engine, reason: None)
    reason = None
    if uses_ghost(model):
        try:
            _check_rows_independent(model, batch["x"])
            result = ghost.clipped_gradient_sum(
                model, batch, variables, l2_norm_clip,
                distribute.unscaled_loss_fn(ghost.per_example_loss_fn(model)))
            report("ghost", None)
            return result
        except ghost.UnsupportedModelError as error:
            # add_loss() terms, stray weight reads and batch mixing only show
            # while tracing; "auto" then falls back within the same trace.
            if model.clipping_engine == "ghost":
                raise
            if recurrent.recurrent_layers(model):
                raise ghost.UnsupportedModelError(
                    f"{error} The vectorized engine cannot take over: TF 2.21's "
                    "vectorized_map cannot batch the while loop of the recurrent layers "
                    f"{[layer.name for layer in recurrent.recurrent_layers(model)]}, so "
                    "remove the cause above.") from error
            reason = str(error)
    elif model.clipping_engine == "auto":
        reason = _why_not_ghost(model)
    report("vectorized", reason)
    return vectorized.clipped_gradient_sum(
        _microbatch_loss_fn(model), variables, batch, num_microbatches, l2_norm_clip)


def _check_rows_independent(model, x):
    """Refuses ghost clipping where a probe finds the rows of a batch mixed.

    Raises:
        UnsupportedModelError: naming the fix.
    """
    if not independence.rows_are_independent(model, x):
        raise ghost.UnsupportedModelError(
            f"Model '{model.name}' mixes the examples of a batch: on generated inputs, "
            "one example's output depends on the others (e.g. a Lambda subtracting "
            "the batch mean), so ghost clipping would not be exact. Remove that "
            'operation, or use clipping_engine="auto" or "vectorized", which runs '
            "each example alone.")


def _why_not_ghost(model):
    if model.optimizer.num_microbatches is not None:
        return "num_microbatches is set (microbatches of several examples)"
    return "; ".join(ghost.unsupported_layers(model))


def _microbatch_loss_fn(model):
    """The vectorized engine's loss function for `model`.

    Returns:
        A function of one microbatch returning `(loss, y_pred)`: its compiled
        loss plus its add_loss() terms, and the model's outputs.
    """
    compile_loss = distribute.unscaled_loss_fn(model._compile_loss)

    def microbatch_loss(microbatch):
        real = real_rows(microbatch)
        x = microbatch["x"] if real is None else _padding_as_a_real_row(microbatch["x"], real)
        y_pred = model(x, training=True)
        if real is not None:
            y_pred = _masking_padding(y_pred, real)
        loss = compile_loss(microbatch["y"], y_pred, microbatch.get("sample_weight"))
        # add_loss() terms (e.g. activity regularizers) depend on this
        # microbatch only, so they belong to its clipped loss. (They ignore
        # sample weights; a microbatch of padding alone has loss 0 in the
        # vectorized engine.)
        data_losses = [l for layer in model._flatten_layers()
                       for l in layer._get_own_losses()]
        if data_losses:
            loss = loss + tf.add_n(data_losses)
        return loss, y_pred

    return microbatch_loss


def _padding_as_a_real_row(x, real):
    """`x` with its padding rows replaced by its first real row.

    A padding row's forward pass may not be finite (a fully masked mean
    pooling is 0 / 0), and a NaN in one row of a microbatch poisons its
    whole gradient (0 * NaN in the weights' matmuls). On a copy of a real
    row it is finite, and its sample weight 0 removes it from the compiled
    loss exactly; add_loss() terms, which ignore sample weights, see the copy.
    A microbatch of padding alone keeps its rows (the engine zeroes it).

    Args:
        x: the microbatch's inputs (any structure, rows first).
        real: `[m]` bool, from `real_rows`.

    Returns:
        `x` with the rows where `real` is False replaced.
    """
    first = tf.argmax(tf.cast(real, tf.int32), output_type=tf.int32)

    def replaced(t):
        keep = tf.reshape(real, [-1] + [1] * (t.shape.rank - 1))
        return tf.where(keep, t, tf.gather(t, first)[None])

    return tf.nest.map_structure(replaced, x)


def _masking_padding(y_pred, real):
    """`y_pred` whose Keras masks, if any, also mask the padding rows, so
    that a loss averaging over unmasked entries divides as it did before
    `_padding_as_a_real_row` (the padding's own mask is that of all-zero
    inputs: fully masked by mask_zero and Masking)."""
    def masked(t):
        mask = get_keras_mask(t)
        if mask is not None:
            rows = tf.reshape(real, [-1] + [1] * (mask.shape.rank - 1))
            set_keras_mask(t, tf.logical_and(mask, rows))
        return t

    return tf.nest.map_structure(masked, y_pred)
