"""Rules of `rowops` for slicing, gathering, products, convolutions and pooling."""

import numpy as np

from keras_dp.clipping.rowtags import FREE
from keras_dp.clipping.rowtags import Batch
from keras_dp.clipping.rowtags import Dims
from keras_dp.clipping.rowtags import Rows
from keras_dp.clipping.rowtags import axis_of
from keras_dp.clipping.rowtags import const
from keras_dp.clipping.rowtags import dims
from keras_dp.clipping.rowtags import values_of
from keras_dp.clipping.rowtags import ints
from keras_dp.clipping.rowtags import mixed
from keras_dp.clipping.rowtags import only
from keras_dp.clipping.rowtags import rank_of
from keras_dp.clipping.rowtags import value_use


# --- Slicing and gathering.

_FULL = (0, None, 1, True, True, False)
_HUGE = 2 ** 31 - 1


def _strided_spec(op, rank):
    """Per input axis (begin, end, stride, begin_mask, end_mask, shrink), and the
    input axis of each output axis (None for a new one); None if unreadable."""
    begin, end, strides = (const(t) for t in op.inputs[1:4])
    if begin is None or end is None or strides is None:
        return None
    begin, end, strides = (np.asarray(v).reshape(-1).tolist() for v in (begin, end, strides))
    masks = {m: op.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask",
                                         "new_axis_mask", "shrink_axis_mask")}
    specs, out_axes, axis = {}, [], 0
    for i in range(len(begin)):
        bit = 1 << i
        if masks["ellipsis_mask"] & bit:
            rest = sum(1 for j in range(i + 1, len(begin)) if not masks["new_axis_mask"] & 1 << j)
            for _ in range(rank - axis - rest):
                specs[axis] = _FULL
                out_axes.append(axis)
                axis += 1
        elif masks["new_axis_mask"] & bit:
            out_axes.append(None)
        else:
            shrink = bool(masks["shrink_axis_mask"] & bit)
            specs[axis] = (begin[i], end[i], strides[i], bool(masks["begin_mask"] & bit),
                           bool(masks["end_mask"] & bit), shrink)
            if not shrink:
                out_axes.append(axis)
            axis += 1
    for rest in range(axis, rank):
        specs[rest] = _FULL
        out_axes.append(rest)
    return specs, out_axes


def _whole(spec, length):
    begin, end, stride, begin_mask, end_mask, shrink = spec
    if shrink or stride != 1 or not (begin_mask or begin == 0):
        return False
    return end_mask or (end is not None and (end >= _HUGE
                                             or (length is not None and end >= length)))


def strided_slice(op, tags):
    x, tag = op.inputs[0], tags[0]
    if not only(tags[1:], ()):
        return mixed(op, "slices at positions that depend on the batch")
    if tag is FREE:
        return FREE
    rank = 1 if isinstance(tag, Dims) else rank_of(x)
    found = _strided_spec(op, rank) if rank is not None else None
    if found is None:
        return mixed(op, "slices at positions unknown while tracing")
    specs, out_axes = found
    if isinstance(tag, Dims):
        begin, end, stride, begin_mask, end_mask, shrink = specs[0]
        if None in (begin, end, stride):
            return value_use(op)
        if shrink:
            return dims([tag.values[begin]], scalar=True)
        picked = tag.values[slice(None if begin_mask else begin, None if end_mask else end, stride)]
        return dims(picked)
    if not isinstance(tag, Rows) or not _whole(specs[tag.axis], x.shape[tag.axis]):
        return mixed(op, "slices the batch axis")
    return Rows(out_axes.index(tag.axis), tag.block)


def slice_op(op, tags):
    x, tag = op.inputs[0], tags[0]
    if tag is FREE and tags[2] is FREE:
        return FREE
    begin = ints(op.inputs[1])
    size = values_of(op.inputs[2], tags[2])
    if isinstance(tag, Dims):
        if begin is None or not isinstance(size[0], int):
            return value_use(op)
        return dims(tag.values[begin[0]:None if size[0] == -1 else begin[0] + size[0]])
    if (not isinstance(tag, Rows) or begin is None or tags[1] is not FREE
            or not only(tags[2:], Dims)):
        return mixed(op, "slices at positions unknown while tracing")
    if begin[tag.axis] != 0 or not _to_the_end(size[tag.axis], tag, x.shape[tag.axis]):
        return mixed(op, "slices the batch axis")
    return tag


def _to_the_end(size, tag, length):
    """Whether a slice of `size` from 0 keeps the whole batch axis: -1, the
    batch's size, or its length when known while tracing (a size unknown
    while tracing is not the batch's, though the batch's is unknown too:
    review round 15, one row read from a variable added to all, 33 C)."""
    return size in (-1, Batch(tag.block)) or (length is not None and size == length)


def gather(op, tags):
    """GatherV2, ResourceGather: weights gathered by ids of the batch are rows;
    rows of the batch gathered along the batch axis are not."""
    params, indices = op.inputs[0], op.inputs[1]
    p, i = tags[0], tags[1]
    resource = op.type == "ResourceGather"
    axis = 0 if resource else ints(op.inputs[2])
    batch_dims = op.get_attr("batch_dims")
    if axis is None or not only(tags[2:], ()):
        return mixed(op, "gathers along an axis unknown while tracing")
    axis = axis if resource else axis[0]
    if isinstance(p, Dims) and i is FREE:
        picked = ints(indices)
        if picked is None:
            return value_use(op)
        return dims([p.values[k] for k in picked], scalar=rank_of(indices) == 0)
    if not only([p, i], Rows):
        return value_use(op)
    if p is FREE and i is FREE:
        return FREE
    if p is FREE and batch_dims == 0:
        return Rows(axis_of(axis, rank_of(params) or 1) + i.axis, i.block)
    if i is FREE and batch_dims == 0 and rank_of(params) is not None:
        axis = axis_of(axis, rank_of(params))
        if axis == p.axis:
            return mixed(op, "picks rows along the batch axis")
        return p if axis > p.axis else Rows(p.axis - 1 + rank_of(indices), p.block)
    if p == i == Rows(0, p.block) and batch_dims >= 1:
        return p
    return mixed(op, "gathers rows of the batch by positions from the batch")


def gather_nd(op, tags):
    p, i = tags
    if p is FREE and i is FREE:
        return FREE
    # tf.gather_nd's batch_dims is done with reshapes (the op has no such attr).
    batch_dims = op.get_attr("batch_dims") if "batch_dims" in op.node_def.attr else 0
    if p is FREE and isinstance(i, Rows) and i.axis < rank_of(op.inputs[1]) - 1:
        return i if batch_dims == 0 else mixed(op, "gathers with batch dimensions")
    if isinstance(p, Rows) and p == i == Rows(0, p.block) and batch_dims >= 1:
        return p
    return mixed(op, "gathers rows of the batch by positions")


# --- Products, convolutions, pooling.

def matmul(op, tags):
    a, b = tags
    if a is FREE and b is FREE:
        return FREE
    if not only(tags, Rows) or (a is not FREE and b is not FREE):
        return mixed(op, "multiplies two tensors of the batch with each other")
    if a is not FREE:
        axis = a.axis if not op.get_attr("transpose_a") else 1 - a.axis
        return Rows(0, a.block) if axis == 0 else mixed(op, "sums over the batch axis")
    axis = b.axis if not op.get_attr("transpose_b") else 1 - b.axis
    return Rows(1, b.block) if axis == 1 else mixed(op, "sums over the batch axis")


def batch_matmul(op, tags):
    if not only(tags, Rows):
        return value_use(op)
    out_rank = rank_of(op.outputs[0])
    found = set()
    for index, (tensor, tag, adjoint) in enumerate(zip(op.inputs, tags, ("adj_x", "adj_y"))):
        if tag is FREE:
            continue
        rank = rank_of(tensor)
        if rank is None or out_rank is None:
            return mixed(op, "multiplies tensors of unknown rank")
        if tag.axis >= rank - 2:  # A matrix axis: kept if not contracted.
            axis = tag.axis - (rank - 2)
            axis = 1 - axis if op.get_attr(adjoint) else axis
            if axis != index:
                return mixed(op, "sums over the batch axis")
            found.add(Rows(out_rank - 2 + index, tag.block))
        else:
            found.add(Rows(tag.axis + out_rank - rank, tag.block))
    if len(found) > 1 or (len(found) == 1 and all(t is not FREE for t in tags)
                          and next(iter(found)).axis >= out_rank - 2):
        return mixed(op, "multiplies rows of different examples")
    return next(iter(found)) if found else FREE


def expanded_equation(op):
    """An einsum's subscripts, one per operand, and its output's, with each
    ellipsis spelled out in letters of its own (operands of known rank)."""
    lhs, out = op.get_attr("equation").decode().split("->")
    subscripts = lhs.split(",")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in lhs + out]
    widest = max((rank_of(t) - len(s) + 3 for t, s in zip(op.inputs, subscripts) if "..." in s),
                 default=0)
    ellipsis = "".join(spare[:widest])
    return ([sub.replace("...", ellipsis[widest - (rank_of(t) - len(sub) + 3):])
             for t, sub in zip(op.inputs, subscripts)], out.replace("...", ellipsis))


def einsum(op, tags):
    if not only(tags, Rows):
        return value_use(op)
    equation = op.get_attr("equation").decode()
    if "->" not in equation:
        return mixed(op, "has an implicit equation")
    if any(rank_of(t) is None for t in op.inputs):
        return mixed(op, "multiplies tensors of unknown rank")
    subscripts, out = expanded_equation(op)
    letters = set()
    for sub, tag in zip(subscripts, tags):
        if tag is not FREE:
            letter = sub[tag.axis]
            if sub.count(letter) != 1:
                return mixed(op, "takes a diagonal along the batch axis")
            letters.add((letter, tag.block))
    if not letters:
        return FREE
    if len(letters) > 1:
        return mixed(op, "multiplies rows of different examples")
    letter, block = next(iter(letters))
    if letter not in out:
        return mixed(op, "sums over the batch axis")
    # A free operand's diagonal along the batch letter lines up with the
    # batch (review round 63: the diagonal of a constant whose rows agree,
    # of alternating signs, 14 C).
    if any(tag is FREE and sub.count(letter) > 1 for sub, tag in zip(subscripts, tags)):
        return mixed(op, "takes a diagonal along the batch axis")
    return Rows(out.index(letter), block)


def convolution(input_index, filter_index):
    def rule(op, tags):
        tag = tags[input_index]
        if tags[filter_index] is not FREE:
            return mixed(op, "convolves with a filter computed from the batch")
        if tag is FREE:
            return FREE
        if not isinstance(tag, Rows) or tag.axis != 0:
            return mixed(op, "convolves across the batch axis")
        others = [t for i, t in enumerate(tags) if i not in (input_index, filter_index)]
        if any(t is not FREE and not isinstance(t, Dims) for t in others):
            return value_use(op)
        return tag
    return rule


def pool(op, tags):
    tag = tags[0]
    if tag is FREE:
        return FREE
    sizes = [op.get_attr(a) if a in op.node_def.attr else ints(op.inputs[k])
             for k, a in ((1, "ksize"), (2, "strides"))]
    if (not isinstance(tag, Rows) or tag.axis != 0 or None in sizes
            or any(s[0] != 1 for s in sizes)):
        return mixed(op, "pools across the batch axis")
    return tag


def fused_batch_norm(op, tags):
    if op.get_attr("is_training"):
        return mixed(op, "normalizes with statistics of the batch (training mode)")
    if not only(tags[1:], ()):
        return mixed(op, "normalizes with statistics computed from the batch")
    return [tags[0]] + [FREE] * (len(op.outputs) - 1)


def resize(op, tags):
    """Resizing images: per image, to one size for the whole batch (review
    round 54: a size read from a batch of two rows let one example set the
    other's, 3 C)."""
    return _per_image(op, tags, per_image=())


def projective_transform(op, tags):
    """Projective transforms of images: per image, by a transform of each
    image's own or one for all; one output shape and fill value for all."""
    return _per_image(op, tags, per_image=(1,))


def _per_image(op, tags, per_image):
    images, parameters = tags[0], list(enumerate(tags[1:], start=1))
    if images is FREE and all(t is FREE for _, t in parameters):
        return FREE
    if images != Rows(0, 1) or any(
            t is not FREE and not (index in per_image and t == Rows(0, 1))
            for index, t in parameters):
        return mixed(op, "transforms images across the batch")
    return images
