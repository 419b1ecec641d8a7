"""The vectorized engine: per-example gradients with `tf.vectorized_map`.

It bounds each microbatch's gradient (one microbatch per example, TF
Privacy's contiguous microbatches, or the k rows of one user: see
`keras_dp.clipping.engine`) as the step's `bounds.Bound` says (flat or
per-layer clipping, normalization) and sums them:

    per_example_gradients -> bound -> sum

It covers every model; the ghost engine (`keras_dp.clipping.ghost`) is
faster where it applies. The optimizer adds the noise and divides.
"""

import tensorflow as tf

from keras_dp.clipping import rowseeds
from keras_dp.clipping import rowstate
from keras_dp.clipping.bounds import Bound
from keras_dp.clipping.bounds import ClippedSum
from keras_dp.clipping.bounds import centered_count
from keras_dp.clipping.captures import batch_captured
from keras_dp.clipping.losses import real_rows
from keras_dp.clipping.onednn import runs_on_onednn
from keras_dp.clipping.transforms import gradients


def split_into_microbatches(tensor, num_microbatches):
    """Reshapes `[B, ...]` to `[num_microbatches, B / num_microbatches, ...]`.

    Microbatches are contiguous (TF Privacy semantics). A batch that
    `num_microbatches` does not divide is refused with a clear error instead
    of a reshape traceback.
    """
    message = _microbatches_message(num_microbatches)
    check_microbatches_divide(tensor.shape[0], num_microbatches)
    batch_size = tf.shape(tensor)[0]
    # The message only: an assertion printing the batch's size is refused
    # as keeping values of the batch (`batchstate`).
    divides = tf.debugging.Assert(tf.equal(batch_size % num_microbatches, 0), [message])
    with tf.control_dependencies([divides]):
        batch_size = tf.identity(batch_size)
    new_shape = tf.concat(
        [[num_microbatches, batch_size // num_microbatches], tf.shape(tensor)[1:]],
        axis=0,
    )
    return tf.reshape(tensor, new_shape)


def check_microbatches_divide(num_rows, num_microbatches):
    """Refuses, in Python, a batch of `num_rows` (None: unknown, left to the
    step) that `num_microbatches` (an int, or a tensor: left) does not divide."""
    if num_rows is not None and isinstance(num_microbatches, int) and num_rows % num_microbatches:
        raise ValueError(_microbatches_message(num_microbatches, num_rows))


def _microbatches_message(num_microbatches, num_rows=None):
    received = "" if num_rows is None else f" Received a batch of {num_rows}."
    return (f"num_microbatches={num_microbatches} must divide the batch size. Use a "
            "batch size that is a multiple of num_microbatches (and drop the last "
            f"partial batch), or num_microbatches=None for one microbatch per example.{received}")


def merge_microbatches(tensor):
    """Inverse of `split_into_microbatches`: `[k, m, ...]` to `[k * m, ...]`."""
    return tf.reshape(tensor, tf.concat([[-1], tf.shape(tensor)[2:]], axis=0))


def clipped_gradient_sum(loss_fn, variables, batch, num_microbatches, l2_norm_clip):
    """Sums per-microbatch gradients, each bounded by `l2_norm_clip`.

    Args:
        loss_fn: maps one microbatch (same structure as `batch`, leading dim
            the microbatch size) to `(scalar_loss, outputs)`.
        variables: the trainable variables to differentiate.
        batch: nested structure of tensors with a leading batch dimension.
        num_microbatches: scalar int tensor; the batch size when each example
            is its own microbatch.
        l2_norm_clip: the clipping bound C, or a `bounds.Bound`.

    Returns:
        A `bounds.ClippedSum`: the list of clipped sums (one per variable),
        the `[k]` microbatch losses, the outputs merged back to `[B, ...]`,
        how many microbatches had a non-finite gradient (they contributed
        zero) and the centered count of those within their bound. A
        microbatch without a row of non-zero sample weight (`real_rows`) has
        loss and gradient 0 and is not counted.
    """
    bound = Bound.of(l2_norm_clip)
    _refuse_strings(batch)
    microbatches = tf.nest.map_structure(
        lambda t: split_into_microbatches(t, num_microbatches), batch
    )

    def clipped_gradient(microbatch):
        with tf.GradientTape() as tape:
            loss, outputs = loss_fn(microbatch)
        grads = gradients(tape, loss, variables)
        real = real_rows(microbatch)
        has_real = tf.constant(True) if real is None else tf.reduce_any(real)
        if real is not None:
            # Padding alone: 0, though its forward pass may be 0 / 0. (A mixed
            # microbatch's padding rows are `loss_fn`'s to neutralize.)
            loss = tf.where(has_real, loss, tf.zeros([], loss.dtype))
            grads = [tf.where(has_real, g, tf.zeros([], g.dtype)) for g in grads]
        clipped, is_finite, within = bound.clip(grads)
        return clipped, loss, outputs, is_finite, within, has_real

    def clipped_gradient_sums(microbatches):
        clipped, losses, outputs, is_finite, within, has_real = tf.vectorized_map(
            clipped_gradient, microbatches
        )
        return ([tf.reduce_sum(g, axis=0) for g in clipped], losses, outputs, is_finite,
                centered_count(within, has_real))

    # A function of its own, so that what the per-example pass reads from the
    # step is its list of captures (`refuse_batch_captured`). TF 2.21's oneDNN
    # batch matmul corrupts the heap, or silently returns wrong values, for a
    # rank-4 left operand with a size-1 second dimension against a broadcast
    # right one, e.g. [B, 1, T, d] x [d, p]: exactly what vectorized_map makes
    # of a Dense or EinsumDense on sequences when each example is its own
    # microbatch. XLA compiles it there with its own kernels (as fast or faster
    # than oneDNN's on the benchmark models). Without AutoGraph, as Keras
    # traces its train step: it would rewrite every layer's call, seconds per
    # trace, and change no result.
    compiled = runs_on_onednn()
    in_xla = rowseeds.xla_compiles(tf.compat.v1.get_default_graph())
    clipped_gradient_sums = tf.function(clipped_gradient_sums,
                                        jit_compile=True if compiled else None,
                                        autograph=False)
    traced = clipped_gradient_sums.get_concrete_function(microbatches)
    refuse_batch_captured(traced.graph)
    if compiled or in_xla:
        _refuse_draws_without_state(traced.graph)
    grad_sum, losses, outputs, is_finite, within = clipped_gradient_sums(microbatches)
    # vectorized_map loses static dims of some gradients when the batch size is
    # unknown (a Dense kernel on sequences comes back [None, p] for Poisson
    # batches); the noise and the optimizer need the variables' shapes.
    grad_sum = [tf.ensure_shape(g, v.shape) for g, v in zip(grad_sum, variables)]
    outputs = tf.nest.map_structure(merge_microbatches, outputs)
    num_nonfinite = tf.reduce_sum(tf.cast(tf.logical_not(is_finite), tf.int64))
    return ClippedSum(grad_sum, losses, outputs, num_nonfinite, within)


def _refuse_strings(batch):
    """Refuses a batch holding strings: `tf.vectorized_map` has no rule for
    string ops, and the loop TensorFlow falls back to failed on texts of
    different numbers of words; where the pass compiles with XLA (oneDNN),
    which has no string ops, TensorFlow 2.21 aborted the process."""
    if any(tf.as_dtype(t.dtype) == tf.string for t in tf.nest.flatten(batch)):
        raise ValueError(
            "The batch holds strings (a TextVectorization or StringLookup layer inside the "
            "model?), which the vectorized engine cannot clip per example: "
            "tf.vectorized_map cannot run string ops on each example apart (nor XLA, which "
            "compiles it on CPUs with oneDNN). Apply the layer in the tf.data pipeline "
            "(dataset.map(lambda text, label: (vectorize(text), label)), before or after "
            "keras_dp.data.poisson_dataset) and train a model taking its integer ids, as "
            "keras-io's text classification example does (keep a model with the layer in "
            "front for inference).")


def _refuse_draws_without_state(graph):
    """Refuses a per-example pass (`graph`, which XLA compiles) with a random
    draw that reads no state (`tf.random.uniform`): XLA draws it from fixed
    seeds, so each example's values are known by its position and adding
    one moves the others' (review round 146: 2.14 C, jit_compile=True)."""
    found = next((op for op in rowstate.operations_within(graph)
                  if rowseeds.draws_without_state(op)), None)
    if found is not None:
        raise ValueError(
            f"The per-example pass draws random values with {found.type} ({found.name}), "
            "which reads no random state: compiled by XLA (jit_compile=True, or the "
            "vectorized engine on CPUs with oneDNN) it draws the same values in every "
            "run, set by each example's position. Draw with keras.random and a "
            "keras.random.SeedGenerator (as Keras' random layers do), or a "
            "tf.random.Generator.")


def refuse_batch_captured(graph):
    """Refuses a per-example pass (`graph`) that reads a value of the step
    computed from its batch: each example's gradient would then depend on
    the others (review round 15: a batch mean a layer or a train_step
    override kept on a Python object moved the sum by 33 C). What it reads
    from the step must come from variables and constants alone.

    Raises:
        ValueError: naming the value and the fix.
    """
    found = batch_captured(graph)
    if found is not None:
        captured, source = found
        raise ValueError(
            f"The per-example pass reads {captured.name}, computed from the batch "
            f"outside it ({source.name}): each example's clipped gradient would depend "
            "on the other examples, so the privacy guarantee could not hold. Compute "
            "such values inside the layer's call() from its inputs, not kept on a "
            "Python object from another pass or from train_step.")
