"""Ghost clipping: exact per-example clipping without per-example gradients.

DP-SGD needs, for every example i, the norm of its gradient g_i and the sum
of the clipped gradients sum_i c_i g_i with c_i = min(1, C / ||g_i||). The
vectorized engine (`keras_dp.clipping.vectorized`) materializes every g_i. This module
gets both from ONE forward pass and ONE backward pass of the whole batch, as
proposed by Goodfellow (2015) and Li et al. (2022), with the clipped sum
formed from the same pass ("book-keeping", Bu et al. 2023):

1. The batch runs forward once (`recorder`). Every call of a layer that has
   a registered norm function goes through that function, which records the layer's
   inputs and the tensor(s) that its weights produce (for Dense: the
   pre-activation output z = x W + b).
2. One backward pass of sum_i loss_i gives the gradient of every recorded
   tensor. Examples are independent, so row i of it is example i's gradient.
3. From inputs and output gradients each norm function describes each
   weight's per-example gradient as a *factor* (`factors`); the engine turns
   factors into per-example squared norms (`contributions`) without
   materializing the gradients when that is cheaper, e.g. for Dense on
   [B, d] inputs ||g_i||^2 = ||x_i||^2 ||dz_i||^2, and on [B, T, d] sequences
   ||g_i||^2 = <x_i x_i^T, dz_i dz_i^T> (the "ghost" Gram formula) or the
   direct per-example gradient x_i^T dz_i, whichever needs less memory.
4. c_i = min(1, C / norm_i), 0 (and counted) for a non-finite norm.
5. The clipped sum, without a second backward pass: for every factor
   sum_i c_i x_i^T dz_i = x^T (c * dz), one matmul per layer, the same work
   as the weight gradient of ordinary training. (`bookkeeping=False` instead
   differentiates sum_i c_i loss_i again; it is slower, kept to measure.)

Exactness: nothing is approximated. A weight used several times in one
forward pass (a layer called twice, tied weights) has the SUM of its uses as
per-example gradient; the engine groups factors by variable and merges them
before the norm (concatenating the token axis of outer-product factors, which
is exactly the sum), so cross terms are included.

Coverage. `supports(model)` is True when every trainable weight belongs to a
layer with an applicable norm function (built in: Dense, EinsumDense (hence
MultiHeadAttention, whose weights are all in EinsumDense sublayers), Conv1D,
Conv2D, Conv3D, their transposes, DepthwiseConv1D/2D, SeparableConv1D/2D, Embedding,
ReversibleEmbedding, LayerNormalization,
GroupNormalization, RMSNormalization, in `keras_dp.clipping.layers`; Keras
Hub's layers in `keras_dp.clipping.layers.hub`),
no layer has an activity regularizer, and no layer is quantized. Frozen
layers need no norm function: they are only run forward, and the backward
pass stops at the lowest recorded tensor. Dense, EinsumDense and Embedding
with LoRA (`layer.enable_lora(rank)`) describe the gradients of A and B as
factors of rank-sized tensors (see `layers.dense.lora_branch`). Under mixed precision the
passes run in half precision and the norms and clipped sum in float32 (see
`contributions.widened`). Otherwise the WHOLE model must use the vectorized engine:
a partial fallback would still run the vectorized per-example forward and
backward pass through the network to reach the uncovered weights, so it
would cost about as much as the vectorized path alone. As a safety net, every
read of a trainable weight during the recorded forward pass that no norm
function accounts for (e.g. a custom layer reading another layer's kernel)
raises `UnsupportedModelError` at trace time instead of clipping with a
wrong norm (as do add_loss() terms, which cannot be split per example).

Choosing the engine (`keras_dp.clipping.engine`, for the train step): this
module when `num_microbatches` is None (one microbatch per example) and
`supports(model)`, the vectorized engine otherwise. Ghost
clipping was faster than the vectorized engine on every model measured
(`benchmarks/speed.py --configs=private,vectorized`: the Fashion-MNIST CNN,
a 784-512-512-10 MLP, a 2-block transformer), and it never materializes
more than one per-example gradient of one layer at a time, so no
measurement is needed to choose.
Run it without XLA (Keras' default on CPU): under jit_compile=True on CPU it
was slower on all three models.

Cost. Per layer the engine picks the cheaper exact formula: for a dense-like
weight with T positions, d inputs and p outputs, the direct per-example
gradient (T*d*p multiply-adds, d*p floats per example) unless it is larger
than the layer's activations (d*p > T*(d+p)), then the Gram formula
(T^2*(d+p) multiply-adds, 2*T^2 floats); weights whose factors share output
gradients (a recurrent layer's kernel and recurrent kernel) then all take
the Gram formula, which squares those gradients once
(`contributions.outer_methods`). Convolutions go through patches gathered
with a precomputed index (several times faster than tf.image.extract_patches
on CPU); with oneDNN (TF_ENABLE_ONEDNN_OPTS=1) a convolution with one input
channel uses one depthwise filter-gradient op instead.

Writing a norm function for your own layer: see `keras_dp.register_norm_function`;
adding a built-in one: see `keras_dp.clipping`.
"""

import tensorflow as tf

from keras_dp.clipping import independence
from keras_dp.clipping.bounds import Bound
from keras_dp.clipping.bounds import ClippedSum
from keras_dp.clipping.bounds import centered_count
from keras_dp.clipping.contributions import OUTER_METHODS
from keras_dp.clipping.contributions import merge
from keras_dp.clipping.contributions import outer_methods
from keras_dp.clipping.contributions import per_unit
from keras_dp.clipping.contributions import to_contribution
from keras_dp.clipping.contributions import widened
from keras_dp.clipping.losses import per_example_loss_fn
from keras_dp.clipping.losses import real_rows
from keras_dp.clipping.recorder import Recorder
from keras_dp.clipping.recorder import own_trainable
from keras_dp.clipping.recorder import routed_layers
from keras_dp.clipping.recorder import variable_key
from keras_dp.clipping.registry import UnsupportedModelError
from keras_dp.clipping.registry import computational_methods
from keras_dp.clipping.registry import registered_class
from keras_dp.clipping.registry import replaced_methods

# The engine's interface: `per_example_loss_fn` builds its loss argument
# from compile(), `UnsupportedModelError` is what it raises.
__all__ = [
    "UnsupportedModelError", "supports", "unsupported_layers",
    "clipped_gradient_sum", "per_example_norms", "per_example_loss_fn",
]


def unsupported_layers(model):
    """Reasons why ghost clipping does not apply to `model`, as strings.

    An empty list means `supports(model)`.
    """
    keys = {variable_key(v) for v in model.trainable_variables}
    reasons = []
    for layer, rule in routed_layers(model, keys):
        name = f"'{layer.name}' ({type(layer).__name__})"
        if getattr(layer, "activity_regularizer", None) is not None:
            reasons.append(f"{name} has an activity regularizer (a batch-level add_loss term)")
        if getattr(layer, "quantization_mode", None) is not None:
            reasons.append(f"{name} is quantized")
        if rule is None and not own_trainable(layer, keys):
            continue
        if getattr(layer, "_remat_mode", None) is not None:
            reasons.append(f"{name} uses rematerialization")
        elif rule is None:
            reasons.append(_uncovered(layer, name))
    return reasons


def _uncovered(layer, name):
    """Why no norm function applies to `layer` (named `name`)."""
    registered = registered_class(type(layer))
    replaced = registered and replaced_methods(layer)
    if replaced:
        return (f"{name} has {replaced} set on the object itself, so the norm function of "
                f"{registered.__name__} does not apply; define them in a subclass and "
                "register a norm function for it with keras_dp.register_norm_function")
    methods = registered and computational_methods(type(layer), registered)
    if methods:
        return (f"{name} redefines {methods} of {registered.__name__}, so the norm function "
                f"of {registered.__name__} does not apply; register one for "
                f"{type(layer).__name__} with keras_dp.register_norm_function")
    return (f"{name} has trainable weights and no applicable norm function "
            "(see keras_dp.register_norm_function)")


def supports(model):
    """True when every trainable weight of `model` is covered by a norm function."""
    return not unsupported_layers(model)


def _refuse_data_losses(model):
    data_losses = [l for layer in model._flatten_layers() for l in layer._get_own_losses()]
    if data_losses:
        raise UnsupportedModelError(
            "Ghost clipping cannot split add_loss() terms (e.g. activity regularizers) "
            "per example; use the vectorized engine (keras_dp.clipping) for this model.")


def _ghost_pass(model, batch, variables, per_example_loss_fn, outer_method, keep_tape,
                rows_per_unit=1):
    """The recorded forward pass, its backward pass and the per-variable
    contributions (one row per unit of `rows_per_unit` rows)."""
    if outer_method not in OUTER_METHODS:
        raise ValueError(f"outer_method must be one of {OUTER_METHODS}; got {outer_method!r}.")
    batch_size = tf.nest.flatten(batch["x"])[0].shape[0]
    recorder = Recorder(variables, batch_size)
    real = real_rows(batch)
    x = batch["x"]
    if rows_per_unit > 1 and real is not None:
        x = _padding_as_real_rows_of_its_unit(x, real, rows_per_unit)
    if tf.executing_eagerly():
        independence.check_traced(model, x, variables, Recorder)
    with tf.GradientTape(persistent=keep_tape) as tape:
        with recorder.patched(model, tape, x):
            y_pred = model(x, training=True)
        recorder.check_rows(y_pred)
        _refuse_data_losses(model)
        with recorder.guarding_loss():
            losses = per_example_loss_fn(batch, y_pred)
        if losses.shape.rank != 1:
            raise ValueError("per_example_loss_fn must return a [batch_size] vector; "
                             f"got shape {losses.shape}.")
        if real is not None:
            # A padding row's loss may be NaN (0 / 0 in a fully masked mean):
            # 0 here, and no gradient flows back into its row.
            losses = tf.where(real, losses, tf.zeros([], losses.dtype))
        total = tf.reduce_sum(losses)
    recorder.check_guards()
    grads = tape.gradient(total, [call.target for call in recorder.calls],
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    grads = [call.shaped(grad) for grad, call in zip(grads, recorder.calls)]
    merged = {index: merge([widened(f) for f in factors], tuple(variables[index].shape))
              for index, factors in recorder.factors(grads).items()}
    methods = outer_methods(merged, outer_method, rows_per_unit)
    contributions = {}
    for index, factor in merged.items():
        if rows_per_unit > 1:
            factor = per_unit(factor, rows_per_unit)
        contributions[index] = to_contribution(factor, tuple(variables[index].shape),
                                               methods.get(index, outer_method),
                                               units=rows_per_unit > 1)
    return y_pred, losses, tape, contributions


def _padding_as_real_rows_of_its_unit(x, real, rows_per_unit):
    """`x` with each padding row replaced by the first real row of its unit.

    A padding row's forward pass may not be finite (a fully masked mean
    pooling is 0 / 0), and its NaN would enter its unit's norm; on a copy of
    a real row of the same unit (rows are independent) every tensor is
    finite where that row's are, and its loss, weighted 0, sends back
    exactly 0. Copying within the unit keeps each unit a function of its own
    rows. A unit of padding alone keeps its rows (it is left out).

    Args:
        x: the batch's inputs (any structure, rows first).
        real: `[U * k]` bool, from `real_rows`.
        rows_per_unit: k.

    Returns:
        `x` with the rows where `real` is False replaced.
    """
    units = tf.reshape(real, [-1, rows_per_unit])
    first = tf.argmax(tf.cast(units, tf.int32), axis=1, output_type=tf.int32)
    source = tf.repeat(tf.range(tf.shape(units)[0]) * rows_per_unit + first, rows_per_unit)
    rows = tf.where(real, tf.range(tf.size(real)), source)
    return tf.nest.map_structure(lambda t: tf.gather(t, rows), x)


def _group_sq_norms(bound, contributions, losses):
    """The `[U, G]` per-unit squared norms of `bound`'s groups (`losses`: `[U]`)."""
    return bound.group_sq_norms({i: c.sq_norms for i, c in contributions.items()},
                                tf.shape(losses)[:1])


def _per_unit(rows, rows_per_unit, reduce):
    """`reduce` (tf.reduce_sum, tf.reduce_any) over each unit's rows of `[U * k]` `rows`."""
    return reduce(tf.reshape(rows, [-1, rows_per_unit]), axis=1)


def per_example_norms(model, batch, variables, per_example_loss_fn, outer_method="auto"):
    """The `[B]` L2 norms of the per-example gradients w.r.t. `variables`."""
    variables = list(variables)
    _, losses, _, contributions = _ghost_pass(model, batch, variables, per_example_loss_fn,
                                              outer_method, keep_tape=False)
    return tf.sqrt(_group_sq_norms(Bound(1.0), contributions, losses)[:, 0])


def clipped_gradient_sum(model, batch, variables, l2_norm_clip, per_example_loss_fn,
                         outer_method="auto", bookkeeping=True, jit_compile=False,
                         rows_per_unit=1):
    """Sums per-example gradients, each clipped to `l2_norm_clip`, by ghost clipping.

    Same result and contract as `keras_dp.clipping.clipped_gradient_sum` with
    one microbatch per example, for models where `supports(model)`; with
    `rows_per_unit=k > 1`, per unit of k consecutive rows (a user), whose
    gradient is the sum of its rows' (see `keras_dp.clipping.engine`).

    Args:
        model: the Keras model; it is called once as
            `model(batch["x"], training=True)`.
        batch: dict with "x" (any structure the model takes) and whatever
            `per_example_loss_fn` reads ("y", "sample_weight").
        variables: the trainable variables to differentiate.
        l2_norm_clip: the clipping bound C, or a `bounds.Bound` (per-layer
            clipping, normalization).
        per_example_loss_fn: `(batch, y_pred) -> [B]` per-example losses
            (see `per_example_loss_fn` below for one built from compile()).
        outer_method: "auto" (per layer), or force "gram" / "direct".
        bookkeeping: True forms the clipped sum from the recorded pass; False
            runs a second backward pass of sum_i c_i loss_i (for comparison).
        jit_compile: True compiles this computation (forward, backward,
            norms, clipped sum) with XLA as one cluster inside the caller's
            graph, leaving the rest of the train step (e.g. noise
            generation, which XLA on CPU makes many times slower) to
            TensorFlow. Call it from a traced function (a train step).

    Returns:
        A `bounds.ClippedSum`: the clipped sums (one per variable), the `[B]`
        per-example losses, the model outputs, how many examples had a
        non-finite gradient norm (they contribute 0; so do rows of sample
        weight 0, never counted, see `real_rows`) and the centered count of
        the examples within their bound.
    """
    variables = list(variables)
    bound = Bound.of(l2_norm_clip)
    if jit_compile:
        compiled = tf.function(
            lambda batch, clips: clipped_gradient_sum(
                model, batch, variables, bound.with_clips(clips), per_example_loss_fn,
                outer_method, bookkeeping, rows_per_unit=rows_per_unit),
            jit_compile=True, autograph=False)
        return compiled(batch, bound.clips)
    y_pred, losses, tape, contributions = _ghost_pass(
        model, batch, variables, per_example_loss_fn, outer_method,
        keep_tape=not bookkeeping, rows_per_unit=rows_per_unit)
    real = real_rows(batch)
    row_losses = losses
    if rows_per_unit > 1:
        losses = _per_unit(losses, rows_per_unit, tf.reduce_sum)
        real = None if real is None else _per_unit(real, rows_per_unit, tf.reduce_any)
    group_scales, finite, within = bound.scales(
        _group_sq_norms(bound, contributions, losses))
    # Padding rows contribute 0 and are not counted, whatever their norms
    # (NaN where their backward pass was 0 / 0).
    kept = finite if real is None else tf.logical_and(finite, real)
    group_scales = tf.stop_gradient(
        tf.where(kept[:, None], group_scales, tf.zeros([], group_scales.dtype)))

    columns = tf.unstack(group_scales, num=bound.num_groups, axis=1)

    def scale_of(index):
        return columns[bound.group_of(index)]

    def bookkept(mask):
        def run():
            return [contributions[i].weighted_sum(scale_of(i), mask) if i in contributions
                    else tf.zeros(v.shape, v.dtype) for i, v in enumerate(variables)]
        return run

    if bookkeeping:
        fast = bookkept(None)
    else:
        if bound.num_groups > 1:
            raise ValueError("bookkeeping=False reweights whole losses, so it cannot "
                             "clip per layer; use bookkeeping=True.")
        with tape:  # Record the reweighted loss on the same (persistent) tape.
            row_scales = tf.repeat(scale_of(0), rows_per_unit) if rows_per_unit > 1 else scale_of(0)
            target = tf.reduce_sum(tf.cast(row_scales, row_losses.dtype) * row_losses)

        def fast():
            grads = tape.gradient(target, variables)
            return [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
                    for g, v in zip(grads, variables)]
    # A non-finite example would turn 0 * inf into NaN in the shared matmuls:
    # only then are its rows zeroed first.
    grad_sum = tf.cond(tf.reduce_all(finite), fast, bookkept(kept))
    grad_sum = [tf.cast(g, v.dtype) for g, v in zip(grad_sum, variables)]
    nonfinite = tf.logical_not(finite) if real is None else tf.logical_and(real, ~finite)
    num_nonfinite = tf.reduce_sum(tf.cast(nonfinite, tf.int64))
    return ClippedSum(grad_sum, losses, y_pred, num_nonfinite, centered_count(within, real))
