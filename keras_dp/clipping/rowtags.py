"""The tags of `independence`: which examples a tensor of a traced forward pass depends on.

Every tensor gets one:

* `FREE`: depends on no example and not on the batch size (weights,
  constants, random draws of a fixed shape);
* `Rows(axis, block)`: axis `axis` has `block * B` entries for a batch of B
  examples, entries `[i * block, (i + 1) * block)` along it depend on example
  i alone (and on `FREE` values); the model's inputs are `Rows(0, 1)`;
* `Dims(values)`: a small integer tensor that holds the batch size (a shape,
  or a size computed from one), each entry an int, None (unknown, but free
  of the batch) or `Batch(k)` (k * B); it may set the shape of a tensor
  (`Reshape`, `Fill`, random ops), never enter arithmetic on the data;
* `Listed(element)`: a TensorList (the loops of recurrent layers) whose
  elements are tagged `element` (None while none is set);
* `Mixed`: anything else, with the op that made it so and why.

With the helpers the rules of `rowops` and `rowindex` share.
"""

import collections
import dataclasses
import math

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util


class _Free:
    def __repr__(self):
        return "FREE"


FREE = _Free()
Batch = collections.namedtuple("Batch", "times")


@dataclasses.dataclass(frozen=True)
class Rows:
    axis: int
    block: int = 1


@dataclasses.dataclass(frozen=True)
class Dims:
    values: tuple
    scalar: bool = False


@dataclasses.dataclass(frozen=True)
class Listed:
    element: object = None


@dataclasses.dataclass(frozen=True)
class Mixed:
    """Not known to keep the examples apart: `op` (its name and type) made it so."""
    op_name: str
    op_type: str
    why: str
    anchor: int = None  # Id of the op of the analysed graph it was found in.


def mixed(op, why):
    return Mixed(op.name, op.type, why)


def dims(values, scalar=False):
    """A `Dims` tag, or FREE when no entry holds the batch size."""
    values = tuple(values)
    return Dims(values, scalar) if any(isinstance(v, Batch) for v in values) else FREE


def const(tensor):
    """The value of `tensor` when known while tracing (entries may be None), else None."""
    if tensor.op.type == "Const":
        return tensor_util.MakeNdarray(tensor.op.get_attr("value"))
    try:
        return tf.get_static_value(tensor, partial=True)
    except (TypeError, ValueError, tf.errors.OpError):
        return None


def ints(tensor):
    """`tensor`'s value as a tuple of ints, or None when any is unknown."""
    value = const(tensor)
    if value is None:
        return None
    value = np.asarray(value).reshape(-1).tolist()
    return None if any(v is None for v in value) else tuple(int(v) for v in value)


def values_of(tensor, tag):
    """The entries of a small int tensor: from its `Dims` tag or its known value.

    Raises:
        ValueError: for a tensor of the batch's examples (or mixed), whose
            entries are no shape's: read as unknown sizes free of the batch,
            a slice of them passed example 0's value to every example
            (review round 197: a concat of tf.shape(x)[:1] with a row
            tensor, 16.03 C under ghost). Each rule's caller makes the op
            mixed.
    """
    if isinstance(tag, Dims):
        return tag.values
    if tag is not FREE:
        raise ValueError("values of the batch's examples read as sizes")
    value = evaluate(tensor)
    if value is not None:
        return tuple(value)
    rank1 = tensor.shape.rank == 1 and tensor.shape[0] is not None
    return (None,) * (tensor.shape[0] if rank1 else 1)


def evaluate(tensor, depth=0):
    """The entries of a small int tensor computed from static shapes (as
    Tensordot computes its reshapes), each an int or None; None if unknown."""
    value = const(tensor)
    if value is not None:
        return [None if v is None else int(v) for v in np.asarray(value).reshape(-1).tolist()]
    op = tensor.op
    if depth > 8 or not tensor.dtype.is_integer:
        return None
    inputs = [lambda i=i: evaluate(op.inputs[i], depth + 1) for i in range(len(op.inputs))]
    if op.type == "Shape" and op.inputs[0].shape.rank is not None:
        return [d for d in op.inputs[0].shape]
    if op.type in ("Identity", "Cast"):
        return inputs[0]()
    if op.type == "Prod":
        values = inputs[0]()
        return None if values is None or None in values else [math.prod(values)]
    if op.type == "Pack":
        values = [f() for f in inputs]
        return None if None in values else [v[0] for v in values]
    if op.type == "ConcatV2":
        values = [f() for f in inputs[:-1]]
        return None if None in values else [v for part in values for v in part]
    if op.type == "GatherV2":
        params, indices = inputs[0](), ints(op.inputs[1])
        return None if params is None or indices is None else [params[i] for i in indices]
    return None


def keeps_counts(op):
    """Whether the Cast `op` keeps every count of rows its input may hold:
    between integer types, to one holding int32's range (no batch or split
    of 2**31 rows fits in memory); a narrower cast wraps them (review round
    15: a batch size of 257 read as 1 in uint8, 514 C)."""
    source, target = op.inputs[0].dtype, op.outputs[0].dtype
    return (source.is_integer and target.is_integer and target.min <= 0
            and target.max >= tf.int32.max)


def rank_of(tensor):
    return tensor.shape.rank


def axis_of(axis, rank):
    return axis + rank if axis < 0 else axis


def only(tags, kinds):
    return all(isinstance(t, kinds) or t is FREE for t in tags)


def value_use(op):
    return mixed(op, "uses the batch size as a value (it depends on how many examples "
                     "the batch holds)")


def product(op, values):
    batch = [v for v in values if isinstance(v, Batch)]
    if len(batch) != 1 or any(v is None for v in values):
        return value_use(op)
    rest = math.prod(v for v in values if not isinstance(v, Batch))
    return Dims((Batch(batch[0].times * rest),), scalar=True)
