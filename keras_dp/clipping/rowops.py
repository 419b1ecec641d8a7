"""The allowlist of TensorFlow ops that `independence` reads: how each moves the batch.

`RULES` maps an op type to its rule `rule(op, tags) -> tag or [tags]`, the
tags (`keras_dp.clipping.rowtags`) of the op's outputs from those of its
inputs (never `Mixed` ones: the caller propagates those, but for
`SEES_MIXED`). An op type missing from `RULES` is unknown, so its outputs
are `Mixed`: the allowlist is what keras-dp knows, not what it has seen
fail. This module has the element-wise ops, reductions, ops that move axes
and ops that make tensors of a given shape; `rowindex` has slicing,
gathering, products and convolutions. TensorLists, control flow and function
calls are read by `independence`.
"""

import enum

import numpy as np

from keras_dp.clipping import rowindex
from keras_dp.clipping import rowseeds
from keras_dp.clipping.rowtags import FREE
from keras_dp.clipping.rowtags import Batch
from keras_dp.clipping.rowtags import Dims
from keras_dp.clipping.rowtags import Mixed
from keras_dp.clipping.rowtags import Rows
from keras_dp.clipping.rowtags import axis_of
from keras_dp.clipping.rowtags import const
from keras_dp.clipping.rowtags import dims
from keras_dp.clipping.rowtags import values_of
from keras_dp.clipping.rowtags import ints
from keras_dp.clipping.rowtags import math
from keras_dp.clipping.rowtags import mixed
from keras_dp.clipping.rowtags import only
from keras_dp.clipping.rowtags import product
from keras_dp.clipping.rowtags import rank_of
from keras_dp.clipping.rowtags import value_use
from keras_dp.clipping.rowtags import keeps_counts


# --- Element-wise ops and their broadcasting.

_UNARY = """Abs Acos Acosh Asin Asinh Atan Atanh BesselI0e BesselI1e Bucketize Cast Ceil
Conj Cos Cosh Digamma Elu Erf Erfc Erfinv Exp Expm1 Floor Identity Imag Inv Invert IsFinite
IsInf IsNan LeakyRelu Lgamma Log Log1p LogicalNot Ndtri Neg OnesLike PreventGradient Real
Reciprocal Relu Relu6 Rint Round Rsqrt Selu Sigmoid Sign Sin Sinh Snapshot Softplus Softsign
Sqrt Square StopGradient Tan Tanh ZerosLike EnsureShape""".split()
_BINARY = """Add AddV2 ApproximateEqual Atan2 BiasAdd BitwiseAnd BitwiseOr BitwiseXor Div
DivNoNan Equal FloorDiv FloorMod Greater GreaterEqual LeftShift Less LessEqual LogicalAnd
LogicalOr Maximum Minimum Mod Mul MulNoNan NotEqual Pow RealDiv RightShift SquaredDifference
Sub TruncateDiv TruncateMod Xdivy Xlog1py Xlogy SelectV2 ClipByValue AddN""".split()


_RANDOM_OPS = frozenset("""RandomUniform RandomStandardNormal TruncatedNormal RandomUniformInt
StatelessRandomUniformV2 StatelessRandomNormalV2 StatelessTruncatedNormalV2
StatelessRandomUniformIntV2 StatelessRandomUniformFullIntV2 StatelessRandomUniform
StatelessRandomNormal StatelessTruncatedNormal StatelessRandomUniformInt RandomShuffle""".split())

# The element-wise op types (`keras_dp.data.ragged_text` follows tokens through them).
ELEMENTWISE = frozenset(_UNARY + _BINARY)


def _elementwise(op, tags):
    """The tag of an element-wise op's output: the batch axis of every operand,
    aligned from the right as broadcasting does, must be one and the same."""
    if any(isinstance(t, Dims) for t in tags):
        return _dims_arithmetic(op, tags)
    if not only(tags, Rows):
        return mixed(op, "is element-wise but receives a TensorList")
    out = op.outputs[0]
    found, free = None, []
    for tensor, tag in zip(op.inputs, tags):
        if tag is FREE:
            free.append(tensor)
            continue
        if rank_of(tensor) is None or rank_of(out) is None:
            return mixed(op, "has an operand of unknown rank")
        axis = tag.axis + rank_of(out) - rank_of(tensor)
        if tensor.shape[tag.axis] == 1 and out.shape[axis] not in (None, 1):
            return mixed(op, "broadcasts one example's row over the batch")
        if found not in (None, Rows(axis, tag.block)):
            return mixed(op, "combines tensors whose batch axes do not line up")
        found = Rows(axis, tag.block)
    if found is not None and any(by_position(t, found.axis - rank_of(out) + rank_of(t))
                                 for t in free):
        return mixed(op, "gives each example a value that depends on its position in the batch")
    if found is not None and _may_broadcast_the_batch(op, tags, free, found):
        return mixed(op, "broadcasts one example's row over the batch")
    return found or FREE


def _keeping_the_batch_length(rule):
    """`rule`, for an op that broadcasts its operands' leading axes (batch
    matmul, einsum): refused where the output's batch axis has a length known
    while tracing that its rows' batch axis does not have, so a free operand
    may repeat a batch of one row (review round 117: a batch matmul with a
    free [2, 4, 4] copied the last batch's one example into two rows, 2 C)."""
    def checked(op, tags):
        found = rule(op, tags)
        if not isinstance(found, Rows):
            return found
        length = op.outputs[0].shape[found.axis]
        rows = [tensor.shape[tag.axis] for tensor, tag in zip(op.inputs, tags)
                if isinstance(tag, Rows)]
        if length is not None and any(given != length for given in rows):
            return mixed(op, "broadcasts one example's row over the batch")
        return found
    return checked


def _may_broadcast_the_batch(op, tags, free, found):
    """Whether a free operand longer than 1 along the batch axis (or of
    unknown length) may repeat the rows of a batch of one row: their batch
    axis must then be as long, known while tracing (review round 116: a map
    adding zeros of shape [2, 1] to batches made with `batch(2)` copied the
    last batch's one example into two rows, 2 C)."""
    out = op.outputs[0]
    lengths = {tensor.shape[tag.axis] for tensor, tag in zip(op.inputs, tags)
               if tag is not FREE}
    for tensor in free:
        axis = found.axis - rank_of(out) + rank_of(tensor)
        if axis < 0 or tensor.shape[axis] == 1:
            continue
        if tensor.shape[axis] is None or lengths != {tensor.shape[axis]}:
            return True
    return False


def _bias_add(op, tags):
    """BiasAdd: element-wise, its bias lined up with the last axis (NHWC) or,
    with data_format "NCHW", with axis 1. Review round 50: an NCHW BiasAdd of
    a constant of alternating values to a batch moved onto axis 1 was read as
    lined up with the last axis, 5.7 C."""
    if op.get_attr("data_format") != b"NCHW" or not only(tags, Rows):
        return _elementwise(op, tags)
    value, bias = tags
    if bias is not FREE:
        lined_up = Rows(1, bias.block)
        if value not in (FREE, lined_up):
            return mixed(op, "combines tensors whose batch axes do not line up")
        if value is FREE and by_position(op.inputs[0], 1):  # Review round 63's mirror case.
            return mixed(op, "gives each example a value that depends on its position "
                             "in the batch")
        return lined_up
    if value is not FREE and value.axis == 1 and by_position(op.inputs[1], 0):
        return mixed(op, "gives each example a value that depends on its position in the batch")
    return value


def _fused_batch_norm(op, tags):
    """FusedBatchNorm in inference mode: its scale, offset, mean and variance
    are lined up with the channel axis (1 for NC.. layouts, else the last),
    where a batch moved onto it would give each example its position's (5.7 C,
    as an NCHW BiasAdd's bias in review round 50)."""
    found = rowindex.fused_batch_norm(op, tags)
    rows = found[0] if isinstance(found, list) else None
    channels = 1 if op.get_attr("data_format").startswith(b"NC") else rank_of(op.inputs[0]) - 1
    if (type(rows) is Rows and rows.axis == channels
            and any(by_position(t, 0) for t in op.inputs[1:5])):
        return mixed(op, "gives each example a value that depends on its position in the batch")
    return found


class _Along(enum.Enum):
    """How a free tensor may vary along an axis (`by_position`)."""
    SAME = enum.auto()  # The same at every position.
    FRESH = enum.auto()  # Drawn afresh at each position, independently.
    SET = enum.auto()  # Possibly set by position.


def by_position(tensor, axis):
    """Whether free `tensor` may differ along `axis` (its batch axis, when
    broadcast against the batch) by position. Only what is made the same
    along it is known not to: a rank below the axis or a length of 0 or 1, a
    constant whose entries agree along it, a fill of one value, zeros or
    ones, and element-wise ops and broadcasts of those (review round 15: a
    constant times 1.0 passed as not a constant, 64 C); and what is drawn
    afresh at each position: random draws from a state that changes each
    step (taken as unknown to an adversary, docs/security.md), and
    element-wise ops of ONE such draw with values known while tracing.
    Anything else joined element-wise with a draw may be correlated with it
    (review round 188: two draws of one seed laid out as [B, 1, B] and
    [B, B, 1], the first the same along the batch's axis, are equal exactly
    on the diagonal, each example's position, 17 C)."""
    return _variation(tensor, axis) is _Along.SET


def _variation(tensor, axis):
    if axis < 0 or tensor.shape[axis] in (0, 1):
        return _Along.SAME
    op = tensor.op
    if op.type == "Const":
        value = const(tensor)
        return (_Along.SET if np.any(value != np.take(value, [0], axis=axis))
                else _Along.SAME)
    if op.type in ("Fill", "ZerosLike", "OnesLike"):
        return _Along.SAME
    if op.type in _RANDOM_OPS:
        return _Along.SET if rowseeds.fixed_seed(op) else _Along.FRESH
    if op.type in ELEMENTWISE or op.type == "BroadcastTo":
        operands = op.inputs[:1] if op.type == "BroadcastTo" else op.inputs
        rank = rank_of(tensor)
        if rank is None or any(rank_of(t) is None for t in operands):
            return _Along.SET
        kinds = [_variation(t, axis - rank + rank_of(t)) for t in operands]
        if _Along.SET in kinds:
            return _Along.SET
        if _Along.FRESH not in kinds:
            return _Along.SAME
        # A draw stays fresh beside values fixed while tracing only: any other
        # (another draw, or the same one laid on another axis, which is the
        # same along this one) may be correlated with it.
        others = [t for t, kind in zip(operands, kinds) if kind is not _Along.FRESH]
        fixed = all(_fixed_value(t) for t in others)
        return _Along.FRESH if kinds.count(_Along.FRESH) == 1 and fixed else _Along.SET
    return _Along.SET


def _fixed_value(tensor, depth=0):
    """Whether `tensor`'s value is fixed while tracing: constants and what
    element-wise ops, casts and reshapes make of them alone (no draw's)."""
    op = tensor.op
    if op.type == "Const":
        return True
    return (depth < 16 and op.type in _OF_FIXED_VALUES
            and all(_fixed_value(t, depth + 1) for t in op.inputs))


# Ops whose output is fixed when their inputs are (`_fixed_value`).
_OF_FIXED_VALUES = ELEMENTWISE | frozenset(
    "Cast Identity Reshape ExpandDims Squeeze Pack Fill BroadcastTo".split())


def _aligned_by_position(rule, aligned_axis):
    """`rule`, refusing an output of rows whose free operands may differ
    along the axis `aligned_axis(op, index, rows)` lines up with the batch
    (None: none does): each example would then be given the value of its
    position. Review round 31: a constant of alternating signs multiplied
    in by einsum, batch matmul or a stack moved every example after an added
    one to another sign, 12.6 C."""
    def checked(op, tags):
        found = rule(op, tags)
        if type(found) is not Rows:
            return found
        for index, (tensor, tag) in enumerate(zip(op.inputs, tags)):
            axis = aligned_axis(op, index, found) if tag is FREE else None
            if axis is not None and by_position(tensor, axis):
                return mixed(op, "gives each example a value that depends on its position "
                                 "in the batch")
        return found
    return checked


def _einsum_axis(op, index, rows):
    """The axis of operand `index` that holds the output's batch letter."""
    subscripts, out = rowindex.expanded_equation(op)
    letter = out[rows.axis]
    return subscripts[index].index(letter) if letter in subscripts[index] else None


def _batch_dims_axis(op, index, rows):
    """The axis of operand `index` broadcast against the output's batch axis
    among the batch dims of a batch matmul (its last two are the matrices)."""
    out_rank, rank = rank_of(op.outputs[0]), rank_of(op.inputs[index])
    axis = rows.axis - out_rank + rank
    return axis if rows.axis < out_rank - 2 and 0 <= axis < rank - 2 else None


def _same_axis(op, index, rows):
    """Concatenated operands line up axis by axis (the axis operand aside)."""
    return rows.axis if index < len(op.inputs) - 1 else None


def _stacked_axis(op, index, rows):
    """Stacked operands have one axis less than the output, at `axis`."""
    axis = axis_of(op.get_attr("axis"), rank_of(op.outputs[0]))
    return rows.axis - (axis <= rows.axis)


def _transforms_axis(op, index, rows):
    """A projective transform's `transforms` ([B, 8], or [1, 8] for all)
    line up with its images (review round 40: a constant transform per
    position, shifting every other image out of frame, 10.5 C)."""
    return 0 if index == 1 else None


def _dims_arithmetic(op, tags):
    """Arithmetic on shapes: copies, casts between int types and k * B."""
    if op.type in ("Identity", "EnsureShape", "Snapshot"):
        return tags[0] if op.outputs[0].dtype.is_integer else value_use(op)
    if op.type == "Cast":
        return tags[0] if keeps_counts(op) else value_use(op)
    if op.type in ("Maximum", "Minimum") and all(rank_of(t) == 0 for t in op.inputs):
        # A broadcast shape (keras' take_along_axis): max(kB, kB) = kB, max(kB, 1) = kB.
        a, b = (values_of(t, tag)[0] for t, tag in zip(op.inputs, tags))
        if a == b or (op.type == "Maximum" and 1 in (a, b)):
            return Dims((b if a == 1 else a,), scalar=True)
        return value_use(op)
    if op.type == "Mul" and all(rank_of(t) == 0 for t in op.inputs):
        values = [values_of(t, tag)[0] for t, tag in zip(op.inputs, tags)]
        batch = [v for v in values if isinstance(v, Batch)]
        other = [v for v in values if not isinstance(v, Batch)]
        if len(batch) == 1 and other and isinstance(other[0], int):
            return Dims((Batch(batch[0].times * other[0]),), scalar=True)
    return value_use(op)


# --- Reductions and ops along one axis.

def _reduction(op, tags):
    x, tag = op.inputs[0], tags[0]
    axes = ints(op.inputs[1])
    keep = op.get_attr("keep_dims") if op.type not in ("ArgMax", "ArgMin") else False
    if isinstance(tag, Dims):
        if op.type == "Prod" and not tag.scalar:
            return product(op, tag.values)
        return value_use(op)
    if tag is FREE:
        return FREE
    if not isinstance(tag, Rows) or axes is None or rank_of(x) is None:
        return mixed(op, "reduces over axes that cannot be read while tracing")
    axes = {axis_of(a, rank_of(x)) for a in axes}
    if tag.axis in axes:
        return mixed(op, "reduces over the batch axis")
    return tag if keep else Rows(tag.axis - sum(a < tag.axis for a in axes), tag.block)




def _along(axes_of):
    """A rule for an op acting along the axes `axes_of(op)` (None: unknown)."""
    def rule(op, tags):
        tag = tags[0]
        if tag is FREE:
            return FREE
        if not isinstance(tag, Rows) or not only(tags[1:], ()):
            return mixed(op, "takes the batch size or a TensorList as an argument")
        axes = axes_of(op)
        if axes is None or rank_of(op.inputs[0]) is None:
            return mixed(op, "acts along axes that cannot be read while tracing")
        if tag.axis in {axis_of(a, rank_of(op.inputs[0])) for a in axes}:
            return mixed(op, "acts along the batch axis")
        return tag
    return rule


def _last_axis(op):
    return (-1,)


def _input_axes(index):
    return lambda op: ints(op.inputs[index])


def _attr_axes(name):
    return lambda op: tuple(np.reshape(op.get_attr(name), -1).tolist())


# --- Ops that move axes.

def _transpose(op, tags):
    perm = ints(op.inputs[1])
    if tags[0] is FREE or perm is None:
        return FREE if tags[0] is FREE else mixed(op, "permutes axes unknown while tracing")
    return Rows(perm.index(tags[0].axis), tags[0].block)


def _reshape(op, tags):
    x, tag = op.inputs[0], tags[0]
    if isinstance(tag, Dims):
        return tag if rank_of(op.outputs[0]) == 1 else value_use(op)
    if tag is FREE:
        return FREE if tags[1] is FREE else mixed(op, "gives weights a batch-sized shape")
    if tag.axis != 0 or not x.shape[1:].is_fully_defined():
        return mixed(op, "reshapes a tensor whose examples it cannot tell apart")
    per_example = tag.block * math.prod(x.shape[1:])
    out = op.outputs[0].shape
    if out.rank is None or out.rank == 0:
        return mixed(op, "reshapes to an unknown shape")
    if out[1:].is_fully_defined():
        rest = math.prod(out[1:])
    else:
        entries = values_of(op.inputs[1], tags[1])
        known = [v for v in entries[1:] if v != -1]
        if not isinstance(entries[0], Batch) or any(not isinstance(v, int) for v in known):
            return mixed(op, "reshapes to a shape that cannot be read while tracing")
        rest = per_example // entries[0].times if -1 in entries[1:] else math.prod(known)
    if rest <= 0 or per_example % rest:
        return mixed(op, "reshapes the rows of several examples together")
    return Rows(0, per_example // rest)


def _expand_dims(op, tags):
    if isinstance(tags[0], Dims):
        return value_use(op)
    axis = ints(op.inputs[1])
    if tags[0] is FREE:
        return FREE
    if axis is None or rank_of(op.outputs[0]) is None:
        return mixed(op, "inserts an axis unknown while tracing")
    axis = axis_of(axis[0], rank_of(op.outputs[0]))
    return Rows(tags[0].axis + (axis <= tags[0].axis), tags[0].block)


def _squeeze(op, tags):
    x, tag = op.inputs[0], tags[0]
    if tag is FREE:
        return FREE
    if isinstance(tag, Dims):
        return Dims(tag.values, scalar=True) if len(tag.values) == 1 else value_use(op)
    if rank_of(x) is None:
        return mixed(op, "squeezes a tensor of unknown rank")
    axes = [axis_of(a, rank_of(x)) for a in op.get_attr("squeeze_dims")]
    if not axes:
        if any(d is None for i, d in enumerate(x.shape) if i != tag.axis):
            return mixed(op, "squeezes axes unknown while tracing")
        axes = [i for i, d in enumerate(x.shape) if d == 1 and i != tag.axis]
    if tag.axis in axes:
        return mixed(op, "squeezes the batch axis")
    return Rows(tag.axis - sum(a < tag.axis for a in axes), tag.block)


def _pack(op, tags):
    if any(isinstance(t, Dims) for t in tags) and all(rank_of(t) == 0 for t in op.inputs):
        return dims(values_of(t, tag)[0] for t, tag in zip(op.inputs, tags))
    if not only(tags, Rows):
        return value_use(op)
    found = {t for t in tags if t is not FREE}  # Same-rank operands: no broadcasting.
    if len(found) > 1:
        return mixed(op, "stacks tensors whose batch axes do not line up")
    if not found:
        return FREE
    tag = found.pop()
    axis = axis_of(op.get_attr("axis"), rank_of(op.outputs[0]))
    return Rows(tag.axis + (axis <= tag.axis), tag.block)


def _unpack(op, tags):
    tag = tags[0]
    if tag is FREE or not isinstance(tag, Rows):
        return FREE if tag is FREE else value_use(op)
    axis = axis_of(op.get_attr("axis"), rank_of(op.inputs[0]))
    if axis == tag.axis:
        return mixed(op, "splits the batch into one tensor per example")
    return Rows(tag.axis - (axis < tag.axis), tag.block)


def _concat(op, tags):
    values, value_tags = op.inputs[:-1], tags[:-1]
    axis = ints(op.inputs[-1])
    if any(isinstance(t, Dims) for t in value_tags):
        if rank_of(op.outputs[0]) != 1:
            return value_use(op)
        return dims(v for t, tag in zip(values, value_tags) for v in values_of(t, tag))
    if not only(value_tags, Rows) or tags[-1] is not FREE or axis is None:
        return mixed(op, "concatenates along an axis unknown while tracing")
    ranks = {rank_of(t) for t in values}
    found = {Rows(t.axis, t.block) for t in value_tags if t is not FREE}
    if len(found) > 1 or None in ranks:
        return mixed(op, "concatenates tensors whose batch axes do not line up")
    if found and axis_of(axis[0], rank_of(op.outputs[0])) == next(iter(found)).axis:
        return mixed(op, "concatenates along the batch axis")
    return next(iter(found)) if found else FREE


def _split(value_index, axis_index):
    def rule(op, tags):
        tag = tags[value_index]
        axis = ints(op.inputs[axis_index])
        # SplitV's sizes read from the rows would cut every example where one
        # example's values say.
        if any(isinstance(t, Rows) for i, t in enumerate(tags) if i != value_index):
            return mixed(op, "splits at sizes read from the batch's examples")
        if tag is FREE:
            return FREE
        if not isinstance(tag, Rows) or axis is None:
            return mixed(op, "splits along an axis unknown while tracing")
        if axis_of(axis[0], rank_of(op.inputs[value_index])) == tag.axis:
            return mixed(op, "splits the batch axis")
        return tag
    return rule


def _tile(op, tags):
    x, tag = op.inputs[0], tags[0]
    multiples = values_of(op.inputs[1], tags[1])
    if tag is FREE and tags[1] is FREE:
        return FREE
    if isinstance(tag, Rows) and tags[1] is FREE and multiples[tag.axis] == 1:
        return tag
    batch = [i for i, m in enumerate(multiples) if isinstance(m, Batch)]
    if tag is FREE and len(batch) == 1 and x.shape[batch[0]] == 1:
        return Rows(batch[0], multiples[batch[0]].times)
    return mixed(op, "repeats rows along the batch axis")


def _shaped(shape_index, value_indices=()):
    """A rule for an op making a tensor of the shape its input `shape_index`
    holds, from free values: a batch-sized axis of it is `Rows` (each entry
    drawn or filled alone: dropout masks, zeros of the batch's shape)."""
    def rule(op, tags):
        if not only([tags[i] for i in value_indices], ()):
            return mixed(op, "fills a tensor from values of the batch")
        others = [t for i, t in enumerate(tags) if i != shape_index and i not in value_indices]
        if not only(others, ()):
            return mixed(op, "draws from a seed or bound that depends on the batch")
        if tags[shape_index] is FREE:
            return FREE
        entries = values_of(op.inputs[shape_index], tags[shape_index])
        batch = [i for i, v in enumerate(entries) if isinstance(v, Batch)]
        if len(batch) != 1 or not isinstance(tags[shape_index], Dims):
            return mixed(op, "makes a tensor with several batch-sized axes")
        return Rows(batch[0], entries[batch[0]].times)
    return rule


def _broadcast_to(op, tags):
    x, tag = op.inputs[0], tags[0]
    if tag is FREE:
        found = _shaped(1, value_indices=(0,))(op, tags)
        # Review round 36: a constant of one value per position, broadcast
        # to the batch's shape, is rows only if it is the same at each.
        if isinstance(found, Rows) and by_position(
                x, found.axis - rank_of(op.outputs[0]) + (rank_of(x) or 0)):
            return mixed(op, "broadcasts a value that may differ by its position in the batch")
        return found
    if not isinstance(tag, Rows) or rank_of(op.outputs[0]) is None:
        return mixed(op, "broadcasts a value of the batch")
    entries = values_of(op.inputs[1], tags[1])
    axis = tag.axis + rank_of(op.outputs[0]) - rank_of(x)
    if entries[axis] not in (Batch(tag.block), x.shape[tag.axis]) or entries[axis] is None:
        return mixed(op, "broadcasts the batch axis to another length")
    if any(isinstance(v, Batch) for i, v in enumerate(entries) if i != axis):
        return mixed(op, "makes a tensor with several batch-sized axes")
    return Rows(axis, tag.block)


def _pad(op, tags):
    if tags[0] is FREE or not isinstance(tags[0], Rows):
        return tags[0] if tags[0] is FREE else value_use(op)
    paddings = ints(op.inputs[1])
    if paddings is None or any(t is not FREE for t in tags[1:]):
        return mixed(op, "pads by amounts unknown while tracing")
    if paddings[2 * tags[0].axis:2 * tags[0].axis + 2] != (0, 0):
        return mixed(op, "pads the batch axis")
    return tags[0]


def _range(op, tags):
    if all(t is FREE for t in tags):
        return FREE
    # tf.range(B) gives each row its position in the batch, which depends on
    # the other examples (those before it): not a value of example i alone.
    return mixed(op, "uses each example's position in the batch as a value")


def _one_hot(op, tags):
    tag = tags[0]
    if tag is FREE or not only(tags[1:], ()):
        return FREE if tag is FREE and only(tags[1:], ()) else value_use(op)
    axis = op.get_attr("axis")
    axis = axis_of(axis, rank_of(op.outputs[0])) if axis != -1 else rank_of(op.outputs[0]) - 1
    return Rows(tag.axis + (axis <= tag.axis), tag.block)


def _shape(op, tags):
    tensor, tag = op.inputs[0], tags[0]
    if isinstance(tag, Mixed) or not isinstance(tag, Rows):
        return FREE if tensor.shape.is_fully_defined() or tag is FREE else value_use(op)
    values = [Batch(tag.block) if i == tag.axis else d for i, d in enumerate(tensor.shape)]
    if op.type == "Size":
        return product(op, values)
    return dims(values)


def _random(op, tags):
    """Random ops draw each entry alone: a batch-sized axis of their shape is
    rows, but for a draw from a seed fixed in the graph (`rowseeds.fixed_seed`)."""
    if op.type in ("RandomShuffle", "RandomCrop"):
        return mixed(op, "shuffles or crops across the batch")
    found = _shaped(0)(op, tags)
    if isinstance(found, Rows) and rowseeds.fixed_seed(op):
        return mixed(op, "draws values fixed by their position in the batch (a seed no "
                         "draw moves on)")
    return found


def _bitcast(op, tags):
    """Bitcast between types of one width (float32 to int32): element-wise."""
    if rank_of(op.outputs[0]) != rank_of(op.inputs[0]):
        return mixed(op, "reinterprets values across an axis")
    return _elementwise(op, tags)


def _passthrough(op, tags):
    """IdentityN: each output is its input."""
    return list(tags)


def _placeholderless(op, tags):
    return FREE


def _seed(op, tags):
    """The key and counter of a stateless draw: from a seed free of the batch only."""
    return FREE if only(tags, ()) else mixed(op, "draws from a seed that depends on the batch")


def _lookup(op, tags):
    """LookupTableFindV2: each key looked up alone in a table (a resource
    whose writers `rowstate` checks) with a default fixed before the step."""
    _table, keys, default = tags
    if default is not FREE:
        return mixed(op, "looks up with a default made from the batch")
    if isinstance(keys, Rows) and default_by_position(op, keys.axis):
        return mixed(op, "gives each example a value that depends on its position in the batch")
    return keys


def default_by_position(op, axis):
    """Whether a lookup's default is one per key (TensorFlow's dynamic
    defaults, shaped as the keys) that may differ along the keys' `axis`
    (review round 62: defaults of alternating signs by row for keys missing
    from the table, 7 C)."""
    keys, default = op.inputs[1], op.inputs[2]
    if rank_of(default) is None or rank_of(keys) is None:
        return True
    return rank_of(default) >= rank_of(keys) and by_position(default, axis)


def _for(names, rule):
    return {name: rule for name in names.split()}


RULES = {
    **{name: _elementwise for name in ELEMENTWISE}, "BiasAdd": _bias_add,
    **_for("Sum Mean Max Min Prod All Any EuclideanNorm ArgMax ArgMin", _reduction),
    **{name: _random for name in _RANDOM_OPS},
    **_for("Const Rank StatelessRandomGetAlg", _placeholderless),
    **_for("StatelessRandomGetKeyCounter StatelessRandomGetKeyCounterAlg", _seed),
    **_for("Softmax LogSoftmax TopKV2 LRN", _along(_last_axis)),
    **_for("Cumsum Cumprod CumulativeLogsumexp ReverseV2", _along(_input_axes(1))),
    "Roll": _along(_input_axes(2)),
    **_for("Pad PadV2 MirrorPad", _pad),
    **_for("Shape Size", _shape),
    "IdentityN": _passthrough, "Bitcast": _bitcast, "Transpose": _transpose, "Reshape": _reshape,
    "ExpandDims": _expand_dims, "Squeeze": _squeeze,
    "Pack": _aligned_by_position(_pack, _stacked_axis), "Unpack": _unpack,
    "ConcatV2": _aligned_by_position(_concat, _same_axis), "Split": _split(1, 0),
    "SplitV": _split(0, 2), "Tile": _tile,
    "Fill": _shaped(0, value_indices=(1,)), "BroadcastTo": _broadcast_to,
    "Range": _range, "OneHot": _one_hot, "LookupTableFindV2": _lookup,
    # Slicing, gathering, products, convolutions, pooling.
    "StridedSlice": rowindex.strided_slice, "Slice": rowindex.slice_op,
    **_for("GatherV2 ResourceGather", rowindex.gather), "GatherNd": rowindex.gather_nd,
    "MatMul": rowindex.matmul,
    "Einsum": _keeping_the_batch_length(_aligned_by_position(rowindex.einsum, _einsum_axis)),
    **_for("BatchMatMul BatchMatMulV2 BatchMatMulV3", _keeping_the_batch_length(
        _aligned_by_position(rowindex.batch_matmul, _batch_dims_axis))),
    **_for("Conv2D Conv3D DepthwiseConv2dNative", rowindex.convolution(0, 1)),
    **_for("Conv2DBackpropInput Conv3DBackpropInputV2", rowindex.convolution(2, 1)),
    **_for("MaxPool AvgPool MaxPoolV2 MaxPool3D AvgPool3D", rowindex.pool),
    **_for("FusedBatchNorm FusedBatchNormV2 FusedBatchNormV3", _fused_batch_norm),
    **_for("ResizeBilinear ResizeNearestNeighbor ResizeBicubic ResizeArea", rowindex.resize),
    **_for("ImageProjectiveTransformV2 ImageProjectiveTransformV3",
           _aligned_by_position(rowindex.projective_transform, _transforms_axis)),
}

# Ops whose rule reads `Mixed` inputs itself (a shape known while tracing
# says nothing about the values).
SEES_MIXED = frozenset(["Shape", "Size", "Rank"])
