"""Per-example gradient engine and the small pure transforms of DP-SGD.

Each step of DP-SGD is a composition of transforms, each testable alone:

    per_example_gradients -> clip_by_global_norm -> sum -> add_gaussian_noise -> divide

`clipped_gradient_sum` runs the first three with `tf.vectorized_map`; the
optimizer (`keras_dp.optimizers`) runs the last two.
"""

import numpy as np
import tensorflow as tf


def gradients(tape, target, variables):
    """`tape.gradient` with zeros (not None) for variables `target` ignores."""
    grads = tape.gradient(target, variables)
    return [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
            for g, v in zip(grads, variables)]


def global_norm(tensors):
    """Returns the L2 norm of all `tensors` taken together as one vector."""
    return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(t)) for t in tensors]))


def clip_by_global_norm(tensors, l2_norm_clip):
    """Scales `tensors` so their global L2 norm is at most `l2_norm_clip`.

    Unlike `tf.clip_by_global_norm`, a non-finite gradient is not propagated:
    the example it belongs to contributes exactly zero, so one bad example can
    never poison the noisy sum (its bound C holds trivially).

    Args:
        tensors: list of gradient tensors of one example (or microbatch).
        l2_norm_clip: the clipping bound C.

    Returns:
        `(clipped_tensors, is_finite)` where `is_finite` is a scalar bool.
    """
    norm = global_norm(tensors)
    is_finite = tf.math.is_finite(norm)
    # `maximum` keeps the ratio finite for an all-zero gradient.
    scale = tf.minimum(1.0, l2_norm_clip / tf.maximum(norm, 1e-12))
    scale = tf.where(is_finite, scale, 0.0)
    clipped = [tf.where(is_finite, t * tf.cast(scale, t.dtype), tf.zeros_like(t))
               for t in tensors]
    return clipped, is_finite


def gaussian(num, stddev, key, counter):
    """`num` independent N(0, stddev^2) draws from one block of a keyed Philox stream.

    Box-Muller on whole tensors of Philox uniforms: the transform TensorFlow's
    own normal sampler applies element by element, here vectorized, with
    `stddev` applied to the radii (half as many values). Noising the 663K
    weights of a 784-512-512-10 MLP took 6-8 ms instead of 9-11 ms with
    `tf.random.stateless_normal` on 2 CPU cores: half of a non-private step.

    Args:
        num: Python int, how many draws.
        stddev: the standard deviation.
        key: int64 scalar, the 64-bit Philox key of the stream.
        counter: int64 scalar, the block to draw from; one block per call.

    Returns:
        A `[num]` float32 tensor.
    """
    pairs = (num + 1) // 2
    uniform = tf.random.stateless_uniform([2, pairs], seed=tf.stack([key, counter]),
                                          dtype=tf.float32)
    # 1 - u lies in (0, 1], so the log is finite.
    radius = stddev * tf.sqrt(-2.0 * tf.math.log1p(-uniform[0]))
    angle = (2.0 * np.pi) * uniform[1]
    normal = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], axis=0)
    return normal if 2 * pairs == num else normal[:num]


def add_gaussian_noise(tensors, stddev, key, counter):
    """Adds independent N(0, stddev^2) noise to every entry of `tensors`.

    Args:
        tensors: list of tensors (the clipped gradient sums), of static shapes.
        stddev: noise standard deviation (sigma * C for DP-SGD).
        key: int64 scalar, the 64-bit Philox key of the noise stream.
        counter: int64 scalar, the stream block of this call: callers give
            each step its own, so no noise is ever reused.

    Returns:
        The list of noisy tensors.
    """
    # One draw for all tensors: a model's many small weights would otherwise
    # cost several small ops each.
    sizes = [t.shape.num_elements() for t in tensors]
    noise = tf.split(gaussian(sum(sizes), stddev, key, counter), sizes)
    return [t + tf.cast(tf.reshape(n, tf.shape(t)), t.dtype) for t, n in zip(tensors, noise)]


def split_into_microbatches(tensor, num_microbatches):
    """Reshapes `[B, ...]` to `[num_microbatches, B / num_microbatches, ...]`.

    Microbatches are contiguous (TF Privacy semantics). A batch that
    `num_microbatches` does not divide is refused with a clear error instead
    of a reshape traceback.
    """
    message = (
        f"num_microbatches={num_microbatches} must divide the batch size. Use a "
        "batch size that is a multiple of num_microbatches (and drop the last "
        "partial batch), or num_microbatches=None for one microbatch per example."
    )
    static_size = tensor.shape[0]
    if static_size is not None and isinstance(num_microbatches, int):
        if static_size % num_microbatches:
            raise ValueError(f"{message} Received a batch of {static_size}.")
    batch_size = tf.shape(tensor)[0]
    divides = tf.debugging.assert_equal(batch_size % num_microbatches, 0,
                                        message=message)
    with tf.control_dependencies([divides]):
        batch_size = tf.identity(batch_size)
    new_shape = tf.concat(
        [[num_microbatches, batch_size // num_microbatches], tf.shape(tensor)[1:]],
        axis=0,
    )
    return tf.reshape(tensor, new_shape)


def merge_microbatches(tensor):
    """Inverse of `split_into_microbatches`: `[k, m, ...]` to `[k * m, ...]`."""
    return tf.reshape(tensor, tf.concat([[-1], tf.shape(tensor)[2:]], axis=0))


def clipped_gradient_sum(loss_fn, variables, batch, num_microbatches, l2_norm_clip):
    """Sums per-microbatch gradients, each clipped to `l2_norm_clip`.

    Args:
        loss_fn: maps one microbatch (same structure as `batch`, leading dim
            the microbatch size) to `(scalar_loss, outputs)`.
        variables: the trainable variables to differentiate.
        batch: nested structure of tensors with a leading batch dimension.
        num_microbatches: scalar int tensor; the batch size when each example
            is its own microbatch.
        l2_norm_clip: the clipping bound C.

    Returns:
        `(grad_sum, losses, outputs, num_nonfinite)`: the list of clipped sums
        (one per variable), the `[k]` microbatch losses, the outputs merged
        back to `[B, ...]`, and how many microbatches had a non-finite
        gradient (they contributed zero).
    """
    microbatches = tf.nest.map_structure(
        lambda t: split_into_microbatches(t, num_microbatches), batch
    )

    def clipped_gradient(microbatch):
        with tf.GradientTape() as tape:
            loss, outputs = loss_fn(microbatch)
        grads = gradients(tape, loss, variables)
        clipped, is_finite = clip_by_global_norm(grads, l2_norm_clip)
        return clipped, loss, outputs, is_finite

    def clipped_gradient_sums(microbatches):
        clipped, losses, outputs, is_finite = tf.vectorized_map(
            clipped_gradient, microbatches
        )
        return [tf.reduce_sum(g, axis=0) for g in clipped], losses, outputs, is_finite

    if runs_on_onednn():
        # TF 2.21's oneDNN batch matmul corrupts the heap, or silently returns
        # wrong values, for a rank-4 left operand with a size-1 second dimension
        # against a broadcast right one, e.g. [B, 1, T, d] x [d, p]: exactly
        # what vectorized_map makes of a Dense or EinsumDense on sequences when
        # each example is its own microbatch. XLA compiles this part with its
        # own kernels (as fast or faster than oneDNN's on the benchmark models).
        clipped_gradient_sums = tf.function(clipped_gradient_sums, jit_compile=True)
    grad_sum, losses, outputs, is_finite = clipped_gradient_sums(microbatches)
    outputs = tf.nest.map_structure(merge_microbatches, outputs)
    num_nonfinite = tf.reduce_sum(tf.cast(tf.logical_not(is_finite), tf.int64))
    return grad_sum, losses, outputs, num_nonfinite


def runs_on_onednn():
    """Whether ops traced here would run on TensorFlow's oneDNN CPU kernels.

    TensorFlow turns oneDNN on by default on x86 CPUs with AVX512_VNNI,
    AVX512_BF16 or AMX, off elsewhere; TF_ENABLE_ONEDNN_OPTS=0/1 forces it.
    Ops compiled by XLA (jit_compile=True) never run on them.
    """
    try:
        from tensorflow.python.ops import control_flow_util
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # Internals moved in a later TensorFlow: assume the unsafe case.
        return True
    in_xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    return bool(_pywrap_util_port.IsMklEnabled()) and not in_xla
