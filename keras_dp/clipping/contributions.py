"""Per-example squared norms and clipped sums from factors, one variable at a time.

The ghost engine merges the factors of each variable (`merge`), widens half
precision ones (`widened`) and turns the result into a `_Contribution`
(`to_contribution`): the `[B]` squared norms of the per-example gradients
and their sum weighted by the clip factors, each by the cheapest exact
formula for its factor type.
"""

import numpy as np
import tensorflow as tf

from keras_dp.clipping.bounds import sq_norm_bound
from keras_dp.clipping.factors import GatheredRows
from keras_dp.clipping.factors import OuterProduct
from keras_dp.clipping.factors import PerExample
from keras_dp.clipping.factors import at_least_float32
from keras_dp.clipping.factors import with_output_gram


# Outer-product factors: "auto" picks per factor (see outer_methods); "gram"
# and "direct" force one formula (used by the tests to check both).
OUTER_METHODS = ("auto", "gram", "direct")
# Embeddings with at most this many positions per example use the masked
# Gram formula (XLA-compatible); longer ones group ids with tf.unique.
_MAX_ROWS_GRAM_STEPS = 512
# The formulas that sum products over pairs of positions, or positions of
# one id, may cancel (review round 67: in float32 a gradient of norm 32 C
# came out near 0 and went unclipped). Their norms are bounds from above of
# what the weighted sum adds for the example, rounding included
# (`_upper_bound`); and an example whose positions cancel by more than this
# factor is clipped as if they cancelled by this much only, so that the
# terms of its clipped sum add up to at most this many C in absolute value
# (the step refuses a C whose sums could then overflow float32,
# `mechanism.FixedStep`).
MAX_CANCELLATION = 2.0 ** 10


def _mask_rows(tensor, mask):
    """Zeroes the examples (leading rows) where `mask` is False."""
    if mask is None:
        return tensor
    shape = [-1] + [1] * (tensor.shape.rank - 1)
    return tf.where(tf.reshape(mask, shape), tensor, _zero(tensor))


def _zero(tensor):
    """A scalar 0 for tf.where to broadcast: zeros_like of a statically shaped
    tensor is folded into a constant that stays in memory between steps."""
    return tf.zeros([], tensor.dtype)


def _weighted_row_sum(scale, tensor):
    """sum_i scale[i] tensor[i]: one [1, B] x [B, N] matmul, as tf.tensordot
    forms it, without the shape arithmetic tensordot adds to every trace."""
    inner = tensor.shape[1:]
    if inner.is_fully_defined() and inner.num_elements():  # -1 cannot stand for 0 rows.
        rows = tf.reshape(tensor, [-1, inner.num_elements()])
    else:
        inner = tf.shape(tensor)[1:]
        rows = tf.reshape(tensor, [tf.shape(tensor)[0], -1])
    total = tf.linalg.matmul(tf.expand_dims(tf.cast(scale, tensor.dtype), 0), rows)
    return tf.reshape(total, inner)


def _scale_rows(tensor, scale):
    shape = [-1] + [1] * (tensor.shape.rank - 1)
    return tensor * tf.reshape(tf.cast(scale, tensor.dtype), shape)


def _outer_to_variable(matrix, factor, shape, batched=False):
    """Maps a [(B,) d, p] outer-product gradient to the weight's layout."""
    lead = [-1] if batched else []
    if factor.split_shape is None:
        return tf.reshape(matrix, lead + list(shape))
    matrix = tf.reshape(matrix, lead + list(factor.split_shape))
    if factor.perm is not None and list(factor.perm) != list(range(len(factor.perm))):
        offset = len(lead)
        matrix = tf.transpose(matrix, list(range(offset)) + [offset + k for k in factor.perm])
    return tf.reshape(matrix, lead + list(shape))


def _outer_method(factor, method, rows_per_unit=1):
    if method != "auto":
        return method
    steps = factor.inputs.shape[1]
    d, p = factor.inputs.shape[-1], factor.output_grads.shape[-1]
    if d is None or p is None:
        return "direct"
    if steps is None:  # Unknown length: bound the per-example gradients' memory.
        return "gram" if d * p > 2 ** 16 else "direct"
    if factor.output_gram is not None and rows_per_unit == 1:
        # The output Gram is given: the input one (T^2 floats) against the
        # per-example gradient (d*p).
        return "gram" if steps * steps <= d * p else "direct"
    steps *= rows_per_unit  # A unit's rows are positions of one sequence (`per_unit`).
    # The direct per-example gradient takes d*p floats per example, the Gram
    # matrices 2*T^2 and the inputs/output gradients already held T*(d+p):
    # materialize per-example gradients only when they are not larger than
    # what the layer already keeps, else use the Gram formula.
    return "gram" if d * p > steps * (d + p) else "direct"


def outer_methods(factors, method, rows_per_unit=1):
    """The formula, "gram" or "direct", of each outer-product factor of one pass.

    "auto" picks per factor by memory (`_outer_method`), then also takes the
    Gram route for every factor whose output gradients g another factor's
    Gram route already squares (an LSTM's kernel and recurrent kernel share
    their gate gradients): g g^T is then formed once (TensorFlow's graph
    optimizer and XLA merge the identical products), which leaves the input
    Gram (T^2*d multiply-adds, fewer than the direct T*d*p when T < p, as
    the other factor's choice implies for a known T) and the clipped sum as
    one matmul over all rows. On CPU that was faster than the direct
    route's batched [B] matmuls without oneDNN and as fast with it
    (docs/performance.md).

    Args:
        factors: {key: factor} of one backward pass (before `per_unit`).
        method: "auto", "gram" or "direct".
        rows_per_unit: k of `per_unit`, when the factors are regrouped.

    Returns:
        {key: "gram" or "direct"} for the `OuterProduct` factors.
    """
    outer = {key: f for key, f in factors.items() if isinstance(f, OuterProduct)}
    methods = {key: _outer_method(f, method, rows_per_unit) for key, f in outer.items()}
    squared = {f.output_grads.ref() for key, f in outer.items() if methods[key] == "gram"}
    return {key: "gram" if f.output_grads.ref() in squared else methods[key]
            for key, f in outer.items()}


class _Contribution:
    """Per-example squared norms and clipped sum of one variable."""

    def __init__(self, sq_norms, weighted_sum):
        self.sq_norms = sq_norms
        self._weighted_sum = weighted_sum

    def weighted_sum(self, scale, mask):
        return self._weighted_sum(scale, mask)


def _outer_contribution(factor, shape, method):
    a, g = factor.inputs, factor.output_grads
    if _outer_method(factor, method) == "direct":
        # TF's CPU batched matmul is markedly faster with the longer
        # dimension last, so the [B, p, d] transpose is formed when d >= p.
        d, p = a.shape[-1], g.shape[-1]
        transposed = d is not None and p is not None and d >= p
        if transposed:
            per_example = tf.linalg.matmul(g, a, transpose_a=True)  # [B, p, d]
        else:
            per_example = tf.linalg.matmul(a, g, transpose_a=True)  # [B, d, p]
        sq_norms = sq_norm_bound(per_example, axis=[1, 2])

        def weighted(scale, mask):
            total = _weighted_row_sum(scale, _mask_rows(per_example, mask))
            if transposed:
                total = tf.transpose(total)
            return _outer_to_variable(total, factor, shape)

        return _Contribution(sq_norms, weighted)

    if a.shape[1] == 1:
        # ||x_i^T g_i||^2 = ||x_i||^2 ||g_i||^2, each bounded with the float32
        # squares flushed to 0 (review round 70: inputs of 1e-19 and labels
        # of 5e18, gradient entries of 0.5, took norm 0, 70.7 C).
        sq_norms = sq_norm_bound(a, axis=[1, 2]) * sq_norm_bound(g, axis=[1, 2])
    else:
        sq_norms = _gram_sq_norms(a, g, factor.output_gram)

    def weighted(scale, mask):
        d, p = a.shape[-1], g.shape[-1]
        scaled_a, scaled_g = _mask_rows(a, mask), _mask_rows(g, mask)
        if a.shape[1] != 1:
            scaled_a, scaled_g = _balanced(scaled_a, scaled_g, scale)
        # Either side may carry the clip factors: the narrower one costs less.
        elif d is not None and p is not None and d < p:
            scaled_a = _scale_rows(scaled_a, scale)
        else:
            scaled_g = _scale_rows(scaled_g, scale)
        flat_a, flat_g = tf.reshape(scaled_a, [-1, d]), tf.reshape(scaled_g, [-1, p])
        return _outer_to_variable(tf.linalg.matmul(flat_a, flat_g, transpose_a=True),
                                  factor, shape)

    return _Contribution(sq_norms, weighted)


def _balanced(a, g, scale):
    """`a` and `g` of each position times powers of two that give both about
    the norm sqrt(||a_t|| ||g_t||), then times the root of the example's
    clip factor `scale`: their products, the terms of the clipped sum, are
    unchanged, but no factor of a term the norm counted is so small that
    float32 flushes it to 0 (review round 72: a position of input 3e38 and
    output gradient 1.25e-37, whose scaled gradient was flushed, undid the
    cancellation of another position's term, 512 C; positions cancelling
    each other are where the Gram norm is below the terms' sizes)."""
    a64, g64 = tf.cast(a, tf.float64), tf.cast(g, tf.float64)
    norms_a, norms_g = _position_norms(a64), _position_norms(g64)
    both = tf.logical_and(norms_a > 0, norms_g > 0)
    exponents = tf.where(both, tf.round(0.5 * (tf.math.log(tf.where(both, norms_g, 1.0))
                                                - tf.math.log(tf.where(both, norms_a, 1.0)))
                                         / np.log(2.0)), tf.zeros([], tf.float64))
    root = tf.sqrt(tf.cast(scale, tf.float64))[:, None]
    two = tf.constant(2.0, tf.float64)
    a_scale, g_scale = tf.pow(two, exponents) * root, tf.pow(two, -exponents) * root
    return (tf.cast(a64 * a_scale[..., None], a.dtype),
            tf.cast(g64 * g_scale[..., None], g.dtype))


def _gram_sq_norms(a, g, output_gram):
    """Bounds of ||a_i^T g_i||^2 from above by <a_i a_i^T, g_i g_i^T>, in
    float64, whose products may cancel (`_upper_bound`)."""
    a64, g64 = tf.cast(a, tf.float64), tf.cast(g, tf.float64)
    gram_a = tf.linalg.matmul(a64, a64, transpose_b=True)
    if output_gram is None:
        gram_g = tf.linalg.matmul(g64, g64, transpose_b=True)
    else:
        gram_g = tf.cast(output_gram, tf.float64)
    estimate = tf.reduce_sum(gram_a * gram_g, axis=[1, 2])
    magnitude = tf.reduce_sum(_position_norms(a64) * _position_norms(g64), axis=1)
    terms = tf.shape(a)[-1] + tf.shape(g)[-1] + tf.square(tf.shape(a)[1])
    # The weighted sum is one matmul over all B T positions, in a's type.
    summed = tf.shape(a)[0] * tf.shape(a)[1]
    return _upper_bound(estimate, magnitude, (terms, tf.float64), (summed, a.dtype))


def _position_norms(tensor):
    """`[B, T]` norms of each example's positions (float64 `[B, T, n]`)."""
    return tf.sqrt(tf.reduce_sum(tf.square(tensor), axis=-1))


def _upper_bound(estimate, magnitude, norm_sums, weighted_sum):
    """float64 squared norms at least those of what the weighted sum adds
    for each example.

    Args:
        estimate: `[B]` squared norms formed by sums of products whose
            absolute values total at most `magnitude^2` per example.
        magnitude: `[B]` float64 bounds of the sum of the absolute values of
            an example's terms: sum_t ||a_t|| ||g_t|| for an outer product
            (|<a_t, a_s>| <= ||a_t|| ||a_s||), sum_t ||g_t|| for rows.
        norm_sums: `(n, type)`, the longest sum that formed `estimate` and
            the type it was formed in.
        weighted_sum: `(n, type)`, the most terms one entry of the weighted
            sum adds and the type it adds them in.

    Returns:
        The root of `estimate` plus its worst rounding, plus the worst
        rounding of the weighted sum's terms (gamma_n magnitude, gamma_n =
        n u / (1 - n u) for unit roundoff u), and at least magnitude /
        MAX_CANCELLATION; squared, with a float64 product's rounding added.
    """
    squared = tf.square(magnitude)
    root = tf.sqrt(estimate + 2.0 * _gamma(*norm_sums) * squared)
    bound = tf.maximum(root + _gamma(*weighted_sum) * magnitude,
                       magnitude / MAX_CANCELLATION)
    return tf.square(bound) * (1.0 + 2.0 ** -50)


def _gamma(terms, dtype):
    """gamma_n = n u / (1 - n u), n = `terms` + 4 (an int tensor): the
    relative bound on the rounding of a sum of n products in `dtype`
    (Higham); infinite where n u >= 1 (such an example is not trained)."""
    unit = np.finfo(dtype.as_numpy_dtype).eps / 2.0
    rounding = (tf.cast(terms, tf.float64) + 4.0) * unit
    return tf.where(rounding < 1.0, rounding / (1.0 - rounding),
                    tf.constant(np.inf, tf.float64))


def _per_example_contribution(factor, shape):
    grads = factor.grads
    sq_norms = sq_norm_bound(grads, axis=list(range(1, grads.shape.rank)))

    def weighted(scale, mask):
        return tf.reshape(_weighted_row_sum(scale, _mask_rows(grads, mask)), shape)

    return _Contribution(sq_norms, weighted)


def _rows_contribution(factor, shape, sort_ids=False):
    ids, g = factor.ids, factor.output_grads
    steps = g.shape[1]
    if steps == 1:
        sq_norms = sq_norm_bound(g, axis=[1, 2])
    else:
        sq_norms = _rows_sq_norms(ids, g, factor.num_rows, sort_ids)

    def weighted(scale, mask):
        # In float64: one id's positions may cancel (`_rows_sq_norms`).
        values = _scale_rows(tf.cast(_mask_rows(g, mask), tf.float64), scale)
        total = tf.math.unsorted_segment_sum(
            tf.reshape(values, [-1, g.shape[-1]]), tf.reshape(ids, [-1]), factor.num_rows)
        return tf.cast(tf.reshape(total, shape), g.dtype)

    return _Contribution(sq_norms, weighted)


def _rows_sq_norms(ids, g, num_rows, sort_ids):
    """Bounds of sum over each example's distinct ids r of
    ||sum_{t: ids[t] = r} g[t]||^2 from above, in float64: the positions of
    one id may cancel (`_upper_bound`)."""
    g64 = tf.cast(g, tf.float64)
    steps = g.shape[1]
    if sort_ids:
        estimate = _rows_sq_norms_by_sorting(ids, g64)
    elif steps is not None and steps <= _MAX_ROWS_GRAM_STEPS:
        # sum over position pairs with the same id of <g_t, g_s>.
        same = tf.equal(ids[:, :, None], ids[:, None, :])
        gram = tf.linalg.matmul(g64, g64, transpose_b=True)
        estimate = tf.reduce_sum(tf.where(same, gram, _zero(gram)), axis=[1, 2])
    else:
        estimate = _rows_sq_norms_by_unique(ids, g64, num_rows)
    magnitude = tf.reduce_sum(_position_norms(g64), axis=1)
    # The longest sum of the three formulas: a Gram entry (p) and its T^2
    # entries, or T p squared entries of sums over T positions; the
    # weighted sum adds the B T positions in float64.
    steps, width = tf.shape(g)[1], tf.shape(g)[-1]
    terms = width + steps * steps + steps * width
    summed = tf.shape(g)[0] * steps
    return _upper_bound(estimate, magnitude, (terms, tf.float64), (summed, tf.float64))


def _rows_sq_norms_by_unique(ids, g, num_rows):
    batch = tf.shape(ids)[0]
    example = tf.broadcast_to(tf.range(tf.cast(batch, tf.int64))[:, None], tf.shape(ids))
    keys = tf.reshape(example * num_rows + tf.cast(ids, tf.int64), [-1])
    unique, index = tf.unique(keys)
    sums = tf.math.unsorted_segment_sum(tf.reshape(g, [-1, g.shape[-1]]), index,
                                        tf.shape(unique)[0])
    return tf.math.unsorted_segment_sum(tf.reduce_sum(tf.square(sums), axis=1),
                                        unique // num_rows, batch)


def _rows_sq_norms_by_sorting(ids, g):
    """sum over each example's distinct ids r of ||sum_{t: ids[t] = r} g[t]||^2,
    from each example's ids sorted: a position whose id differs from the one
    before starts a new sum. Linear in the positions after the sort (the
    masked Gram is quadratic) and XLA-compatible (`tf.unique` is not)."""
    examples, steps = tf.shape(ids)[0], tf.shape(ids)[1]
    order = tf.argsort(ids, axis=1, stable=True)
    ids = tf.gather(ids, order, batch_dims=1)
    g = tf.gather(g, order, batch_dims=1)
    starts = tf.concat([tf.ones([examples, 1], tf.int32),
                        tf.cast(tf.not_equal(ids[:, 1:], ids[:, :-1]), tf.int32)], axis=1)
    # Example i's sums take segments [i * steps, (i + 1) * steps).
    segments = tf.cumsum(starts, axis=1) - 1 + tf.range(examples)[:, None] * steps
    sums = tf.math.unsorted_segment_sum(tf.reshape(g, [-1, g.shape[-1]]),
                                        tf.reshape(segments, [-1]), examples * steps)
    return tf.reduce_sum(tf.reshape(tf.square(sums), [examples, -1]), axis=1)


def _to_per_example(factor, shape):
    """Materializes any factor as per-example gradients [B, *shape]."""
    if isinstance(factor, PerExample):
        return factor.grads
    if isinstance(factor, OuterProduct):
        per_example = tf.linalg.matmul(factor.inputs, factor.output_grads, transpose_a=True)
        return _outer_to_variable(per_example, factor, shape, batched=True)
    batch = tf.shape(factor.ids)[0]
    ids = tf.cast(factor.ids, tf.int32)
    example = tf.broadcast_to(tf.range(batch)[:, None], tf.shape(ids))
    # An id outside the table (XLA's gather clamps it instead of failing)
    # adds to no row: as example * num_rows + id it would land in another
    # example's rows (review round 26: a tied ReversibleEmbedding, 3.5 C
    # at B = 9). A negative segment is dropped.
    inside = (ids >= 0) & (ids < factor.num_rows)
    keys = tf.reshape(tf.where(inside, example * factor.num_rows + ids, -1), [-1])
    rows = tf.math.unsorted_segment_sum(
        tf.reshape(factor.output_grads, [-1, factor.output_grads.shape[-1]]), keys,
        batch * factor.num_rows)
    return tf.reshape(rows, [-1, *shape])


def widened(factor):
    """`factor` with its float16 / bfloat16 tensors cast to float32.

    Under mixed precision the forward and backward passes run in half
    precision, but every norm and the clipped sum are computed in float32
    from the same factor values, so the clip bound holds on the float32
    gradient that is applied.
    """
    if isinstance(factor, OuterProduct):
        wide = OuterProduct(at_least_float32(factor.inputs),
                            at_least_float32(factor.output_grads),
                            factor.split_shape, factor.perm)
        if factor.output_gram is not None:
            wide = with_output_gram(wide, at_least_float32(factor.output_gram))
        return wide
    if isinstance(factor, GatheredRows):
        return GatheredRows(factor.ids, at_least_float32(factor.output_grads), factor.num_rows)
    if isinstance(factor, PerExample):
        return PerExample(at_least_float32(factor.grads))
    return factor  # Refused by to_contribution.


def merge(factors, shape):
    """One factor equal to the sum of `factors` (all for the same variable)."""
    if len(factors) == 1:
        return factors[0]
    first = factors[0]
    if all(isinstance(f, OuterProduct) for f in factors):
        layouts = {(f.inputs.shape[-1], f.output_grads.shape[-1], f.split_shape, f.perm)
                   for f in factors}
        if len(layouts) == 1:  # Concatenating positions sums the outer products
            # (their Grams gain cross terms: an `output_gram` is left out).
            return OuterProduct(tf.concat([f.inputs for f in factors], axis=1),
                                tf.concat([f.output_grads for f in factors], axis=1),
                                first.split_shape, first.perm)
    if all(isinstance(f, GatheredRows) for f in factors):
        if len({f.num_rows for f in factors}) == 1:
            return GatheredRows(tf.concat([tf.cast(f.ids, tf.int64) for f in factors], axis=1),
                                tf.concat([f.output_grads for f in factors], axis=1),
                                first.num_rows)
    return PerExample(tf.add_n([_to_per_example(f, shape) for f in factors]))


def per_unit(factor, rows_per_unit):
    """`factor` for units of `rows_per_unit` consecutive rows: entry u is the
    SUM of its rows' per-example gradients (user-level clipping).

    An outer-product or gathered-rows factor takes a unit's rows as positions
    of one sequence, `[U * k, T, ...] -> [U, k * T, ...]`, so that its Gram
    formula gives ||sum over the unit's rows and positions of a^T b||^2 =
    <A A^T, B B^T> with A, B the unit's concatenated rows, cross terms
    included; per-example gradients are summed. Every factor's row i is
    example i's (`Recorder` checks it), so the regrouped factor is exact for
    every norm function.

    Args:
        factor: an `OuterProduct`, `GatheredRows` or `PerExample` factor
            (rows of sample weight 0 have zero output gradients, see
            `ghost._padding_as_real_rows_of_its_unit`).
        rows_per_unit: k, a Python int.

    Returns:
        A factor of the same type whose rows are the units.
    """
    def rows_as_positions(t):
        steps = t.shape[1] * rows_per_unit if t.shape[1] is not None else -1
        tail = [d if d is not None else tf.shape(t)[2 + i] for i, d in enumerate(t.shape[2:])]
        return tf.reshape(t, [-1, steps, *tail])

    if isinstance(factor, OuterProduct):  # A unit's Gram has cross terms: no output_gram.
        return OuterProduct(rows_as_positions(factor.inputs),
                            rows_as_positions(factor.output_grads),
                            factor.split_shape, factor.perm)
    if isinstance(factor, GatheredRows):
        return GatheredRows(rows_as_positions(factor.ids),
                            rows_as_positions(factor.output_grads), factor.num_rows)
    if isinstance(factor, PerExample):
        grads = factor.grads
        units = tf.reshape(grads, [-1, rows_per_unit, *grads.shape[1:]])
        return PerExample(tf.reduce_sum(units, axis=1))
    return factor  # Refused by to_contribution.


def to_contribution(factor, shape, method, units=False):
    """The `_Contribution` of `factor` for a variable of `shape`.

    Args:
        factor: an `OuterProduct`, `GatheredRows` or `PerExample` factor.
        shape: the variable's shape.
        method: "gram" or "direct" for an outer-product factor (see
            `outer_methods`; "auto" picks by this factor alone).
        units: True when `factor` comes from `per_unit`: the ids of a unit's
            k rows (k T positions) are then grouped by sorting, as the
            masked Gram formula grows with (k T)^2.
    """
    if isinstance(factor, OuterProduct):
        return _outer_contribution(factor, shape, method)
    if isinstance(factor, GatheredRows):
        return _rows_contribution(factor, shape, sort_ids=units)
    if isinstance(factor, PerExample):
        return _per_example_contribution(factor, shape)
    raise TypeError(f"A norm function returned {factor!r}; expected an OuterProduct, "
                    "PerExample or GatheredRows factor.")
