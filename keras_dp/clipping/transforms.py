"""The small pure clipping transforms of DP-SGD, each testable alone.

Each step of DP-SGD is a composition of transforms:

    per_example_gradients -> clip_by_global_norm -> sum -> add_gaussian_noise -> divide

An engine (`vectorized` or `ghost`) runs the first three with these; the
optimizer (`keras_dp.optimizers`) runs the last two with `keras_dp.noise`.
"""

import tensorflow as tf

from keras_dp.clipping.bounds import Bound


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
    clipped, is_finite, _ = Bound(l2_norm_clip).clip(tensors)
    return clipped, is_finite
