"""The clipping engine of a private model's step: which one, and running it.

A private model's `clipping_engine` is "auto" (default), "ghost" or
"vectorized". "auto" picks ghost clipping (`ghost`) when each example is its
own microbatch and every trainable layer has a norm function, else the
vectorized engine (`vectorized`); both are exact, so the choice changes
speed and memory, never the clipped sum. The engines take a batch as a dict
(`as_batch`) and return the same `(grad_sum, losses, y_pred, num_nonfinite)`.
"""

import tensorflow as tf

from keras_dp import distribute
from keras_dp.clipping import ghost
from keras_dp.clipping import vectorized

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


def clipped_gradient_sum(model, batch, num_microbatches, variables):
    """Runs `model`'s engine (see `uses_ghost`) on one replica's batch.

    Args:
        model: a private model, compiled with a DP optimizer.
        batch: the batch, as made by `as_batch`.
        num_microbatches: scalar int tensor; the batch size when each example
            is its own microbatch.
        variables: the trainable variables to differentiate.

    Returns:
        `(grad_sum, losses, y_pred, num_nonfinite)`: the clipped sums (one per
        variable), the per-microbatch losses, the model's outputs and how many
        microbatches had a non-finite gradient (they contributed zero).
    """
    optimizer = model.optimizer
    if uses_ghost(model):
        try:
            return ghost.clipped_gradient_sum(
                model, batch, variables, optimizer.clip_tensor(),
                distribute.unscaled_loss_fn(ghost.per_example_loss_fn(model)))
        except ghost.UnsupportedModelError:
            # add_loss() terms and stray weight reads only show while
            # tracing; "auto" then falls back within the same trace.
            if model.clipping_engine == "ghost":
                raise
    return vectorized.clipped_gradient_sum(
        _microbatch_loss_fn(model), variables, batch, num_microbatches,
        optimizer.clip_tensor())


def _microbatch_loss_fn(model):
    """The vectorized engine's loss function for `model`.

    Returns:
        A function of one microbatch returning `(loss, y_pred)`: its compiled
        loss plus its add_loss() terms, and the model's outputs.
    """
    compile_loss = distribute.unscaled_loss_fn(model._compile_loss)

    def microbatch_loss(microbatch):
        y_pred = model(microbatch["x"], training=True)
        loss = compile_loss(microbatch["y"], y_pred, microbatch.get("sample_weight"))
        # add_loss() terms (e.g. activity regularizers) depend on this
        # microbatch only, so they belong to its clipped loss. They ignore
        # sample weights, so a microbatch of padding rows (weight 0) would
        # contribute through them: only microbatches with a real row keep them.
        data_losses = [l for layer in model._flatten_layers()
                       for l in layer._get_own_losses()]
        if data_losses:
            data_loss = tf.add_n(data_losses)
            loss = loss + data_loss * tf.cast(_has_real_row(microbatch), data_loss.dtype)
        return loss, y_pred

    return microbatch_loss


def _has_real_row(microbatch):
    """Whether a row of `microbatch` has a non-zero sample weight (True without
    sample weights): padding rows carry weight 0 in every output."""
    weights = [w for w in tf.nest.flatten(microbatch.get("sample_weight")) if w is not None]
    if not weights:
        return tf.constant(True)
    return tf.reduce_any([tf.reduce_any(tf.not_equal(w, 0)) for w in weights])
