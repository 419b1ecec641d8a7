"""How a step bounds each example's gradient: the engines' one view of it.

DP-SGD needs every example's (microbatch's) contribution to the sum to have
an L2 norm of at most the sensitivity the accountant uses. Three rules give
that bound, each a per-example scale of the gradient computed from its norm:

* flat clipping: g * min(1, C / ||g||);
* per-layer clipping: the weights are split into groups (layers), each with
  its own C_l, and each group's part of g is clipped to C_l, so the whole
  contribution has norm at most sqrt(sum_l C_l^2);
* normalization (automatic clipping, Bu et al. 2023): g * C / (||g|| + gamma),
  of norm below C whatever ||g||.

A `Bound` describes the rule with the step's clipping norms (fixed by the
step's mechanism, `keras_dp.mechanism`); both engines call it with the
per-example squared norms of each variable's gradient and apply the scales
it returns, so the variants are exact on every engine. A non-finite
gradient contributes zero.
"""

from typing import NamedTuple

import numpy as np
import tensorflow as tf

# Keeps the scale finite for an all-zero gradient.
_TINY_NORM = 1e-12


class Bound:
    """The clipping rule of one step, as the engines apply it.

    Args:
        clips: C, or the `[G]` norms C_l of the groups (float tensor or number).
        groups: for each trainable variable (in the engine's order), the index
            of its group in `clips`; None puts every variable in group 0.
        normalize_gamma: None to clip; gamma > 0 to normalize, scaling each
            gradient by C / (||g|| + gamma) (one group only).
    """

    def __init__(self, clips, groups=None, normalize_gamma=None):
        # Float64 until used: a Python float made float32 first would round C.
        clips = tf.convert_to_tensor(clips, dtype_hint=tf.float64)
        self.clips = tf.reshape(tf.cast(clips, tf.float64), [-1])
        self.groups = None if groups is None else tuple(groups)
        self.normalize_gamma = normalize_gamma

    @classmethod
    def of(cls, l2_norm_clip):
        """`l2_norm_clip` if it is a `Bound`, else flat clipping at C = `l2_norm_clip`."""
        return l2_norm_clip if isinstance(l2_norm_clip, Bound) else cls(l2_norm_clip)

    def with_clips(self, clips):
        """The same rule with other clipping norms."""
        return Bound(clips, self.groups, self.normalize_gamma)

    @property
    def num_groups(self):
        return 1 if self.groups is None else max(self.groups) + 1

    def group_of(self, index):
        """The group of the variable at `index`."""
        return 0 if self.groups is None else self.groups[index]

    def group_sq_norms(self, sq_norms, shape):
        """Sums per-variable squared norms by group, in float64.

        Args:
            sq_norms: dict from a variable's index to its per-example squared
                norms (a float64 tensor of `shape`); a variable absent has
                gradient 0.
            shape: the per-example shape (`[B]`, or `[]` for one microbatch).

        Returns:
            A `shape + [G]` float64 tensor.
        """
        totals = [tf.zeros(shape, tf.float64) for _ in range(self.num_groups)]
        for index, values in sq_norms.items():
            totals[self.group_of(index)] += values
        return tf.stack(totals, axis=-1)

    def scales(self, group_sq_norms):
        """Per-example, per-group scales from `group_sq_norms` (`[..., G]`).

        Returns:
            `(scales, finite, within)`: the `[..., G]` scales (0 for an example
            whose norm is not finite), whether each example's norm is finite,
            and whether it is within its bound (every group's norm <= C_l; for
            normalization, ||g|| <= C), the vote adaptive clipping counts.
        """
        norms = tf.sqrt(group_sq_norms)
        finite = tf.reduce_all(tf.math.is_finite(norms), axis=-1)
        clips = tf.cast(self.clips, norms.dtype)
        if self.normalize_gamma is None:
            scales = tf.minimum(tf.ones([], norms.dtype),
                                clips / tf.maximum(norms, _TINY_NORM))
        else:
            # C / (||g|| + gamma) may pass float32's largest number, which
            # the cast for the clipped sum would make inf (review round 76:
            # C = 1e30, gamma = 1e-12, a gradient of 1e-12 summed as inf, a
            # zero one as NaN); a smaller scale only clips harder.
            scales = tf.minimum(clips / (norms + tf.cast(self.normalize_gamma, norms.dtype)),
                                float(np.finfo(np.float32).max))
        scales = tf.where(finite[..., None], scales, tf.zeros([], norms.dtype))
        within = tf.logical_and(finite, tf.reduce_all(norms <= clips, axis=-1))
        return scales, finite, within

    def clip(self, tensors):
        """Bounds one example's (microbatch's) gradients.

        Args:
            tensors: its gradient, one tensor per variable.

        Returns:
            `(bounded_tensors, is_finite, within)`, the last two scalar bools.
        """
        sq_norms = {i: sq_norm_bound(t) for i, t in enumerate(tensors)}
        scales, finite, within = self.scales(self.group_sq_norms(sq_norms, []))
        # A broadcast scalar 0: zeros_like(t) would be folded into a constant the
        # size of the model, kept in memory between steps.
        bounded = [tf.where(finite, t * tf.cast(scales[self.group_of(i)], t.dtype),
                            tf.zeros([], t.dtype)) for i, t in enumerate(tensors)]
        return bounded, finite, within


def sq_norm_bound(tensor, axis=None):
    """float64 bounds from above of the squared norms of `tensor`, summed
    over `axis` (every axis by default): the sum of its squares plus the
    most that the squares CPU kernels flush to 0, each below the type's
    smallest normal number, may have lost (review round 73: normalization
    by a tiny gamma took a gradient of 1e-20, whose float32 square was
    flushed, for norm 0: 2e7 C). Squares of float64 casts would cost the
    vectorized engine a third more CPU; this bound adds nothing measurable
    to the norm of any gradient above 1e-15."""
    squares = tf.reduce_sum(tf.square(tensor), axis=axis)
    flushed = tf.cast(tf.size(tensor) // tf.maximum(tf.size(squares), 1), tf.float64)
    smallest = float(np.finfo(tensor.dtype.as_numpy_dtype).tiny)
    return tf.cast(squares, tf.float64) + flushed * smallest


class ClippedSum(NamedTuple):
    """What a clipping engine returns for one replica's batch.

    Attributes:
        grad_sum: the sums of the bounded gradients, one per variable.
        losses: the per-microbatch losses.
        outputs: the model's outputs.
        num_nonfinite: how many microbatches had a non-finite gradient
            (they contributed zero).
        centered_within: sum over the real microbatches (not padding) of
            1[within its bound] - 1/2: the count adaptive clipping noises,
            whose sensitivity is 1/2 when one example is added or removed.
    """

    grad_sum: list
    losses: tf.Tensor
    outputs: object
    num_nonfinite: tf.Tensor
    centered_within: tf.Tensor


def centered_count(within, counted):
    """sum_i (1[within_i] - 1/2) over the rows where `counted` (None: all)."""
    votes = tf.cast(within, tf.float32) - 0.5
    if counted is not None:
        votes = tf.where(counted, votes, tf.zeros([], tf.float32))
    return tf.reduce_sum(votes)
