"""Which stateless random draws are fresh with every draw: their seeds,
followed entry by entry to the state they come from.

A stateless draw gives the same values at the same positions whenever its
seed repeats, so the values it gives the rows of a batch are fixed by their
position (known to anyone who reads the program) unless an entry of its seed
comes from state that moves on with every draw: a `tf.random.Generator`'s
(RngReadAndSkip), a stateful random op's output, another draw from a moving
seed, or a variable every write of the graph advances from its own value by
a nonzero step (Keras' SeedGenerator). Such entries are carried only by ops
known to keep them: copies, casts, reshapes, slices, stacks and gathers
(entry by entry), and arithmetic with a constant that keeps them apart
(a sum, an odd factor, a large modulus). A function's argument carries what
every caller passes (a nested function, a loop's first and later values, a
branch); an argument nothing in the enclosing graph passes (the step's or
the map's own inputs) and a value captured from outside carry nothing.
Anything else is taken as fixed, so the draw counts as fixed by position
(review rounds 103, 105, 106: seeds read from a variable nothing moves,
set back each step, or passed as a constant through a function's argument,
each let one example move the clipped sum by 4.6 C to 25 C).
"""

import threading

import numpy as np
import tensorflow as tf

from keras_dp.clipping import rowstate
from keras_dp.clipping.rowtags import const

# Ops whose outputs are draws from state that moves on with every run.
_STATEFUL_DRAWS = frozenset("""RandomUniform RandomStandardNormal TruncatedNormal
RandomUniformInt RandomGamma RandomPoisson RandomPoissonV2 Multinomial StatefulUniform
StatefulUniformFullInt StatefulUniformInt StatefulStandardNormalV2 StatefulTruncatedNormal
StatefulRandomBinomial RngReadAndSkip""".split())
# Ops mixing every entry of their seed into every entry of their outputs.
_SEED_HASHES = frozenset("""StatelessRandomGetKeyCounter StatelessRandomGetKeyCounterAlg
StatelessRandomUniformV2 StatelessRandomNormalV2 StatelessTruncatedNormalV2
StatelessRandomUniformIntV2 StatelessRandomUniformFullIntV2 StatelessRandomUniform
StatelessRandomNormal StatelessTruncatedNormal StatelessRandomUniformInt
StatelessRandomUniformFullInt""".split())
# Ops whose output is their input, entry for entry.
_COPIES = frozenset("Identity Snapshot StopGradient EnsureShape Cast".split())
# Ops that move entries without changing them, with the inputs that hold
# the entries; their other inputs must be constants.
_MOVERS = {"Reshape": ("tensor",), "ExpandDims": ("input",), "Squeeze": ("input",),
           "StridedSlice": ("input",), "Slice": ("input",), "GatherV2": ("params",),
           "Pack": ("values",), "ConcatV2": ("values",), "Unpack": ("value",),
           "Split": ("value",), "SplitV": ("value",), "Transpose": ("x",),
           "Tile": ("input",), "ReverseV2": ("tensor",), "BroadcastTo": ("input",)}
# Arithmetic with a constant that keeps distinct entries distinct.
_SHIFTS = frozenset(["Add", "AddV2", "Sub", "BitwiseXor"])
_MODULI = frozenset(["FloorMod", "Mod"])
_SMALLEST_MODULUS = 2 ** 16
_MAX_DEPTH = 200
# The functions being read, innermost last: (graph, op running it, offset of
# its arguments among the op's inputs), per thread.
_LOCAL = threading.local()


def called_from(op, graph):
    """A context in which `graph`, a function `op` runs, is read: its
    arguments carry what `op` passes (`keras_dp.clipping.independence`
    enters one for each function it follows, so the walk's own path, not
    where a function was first traced, says who passed what: review round
    106, a function traced with a moving seed and called again with a
    constant one)."""
    return _Called(op, graph)


class _Called:
    def __init__(self, op, graph):
        self.entry = (graph, op, len(op.inputs) - len(graph.inputs))

    def __enter__(self):
        _callers().append(self.entry)

    def __exit__(self, *exc):
        _callers().pop()


def _callers():
    if not hasattr(_LOCAL, "callers"):
        _LOCAL.callers = []
    return _LOCAL.callers


def fixed_seed(op):
    """Whether the random op `op` draws from a seed no draw moves on (see the
    module docstring): a stateless op whose seed (or key) has no moving
    entry. Its values are then fixed by their position."""
    if not op.type.startswith("Stateless"):
        return False  # A stateful op's state moves on with every draw.
    seed = _seed_of(op)
    return seed is None or not _Moving().any(seed)


def _seed_of(op):
    names = [arg.name for arg in op.op_def.input_arg]
    for name in ("seed", "key"):
        if name in names:
            return op.inputs[names.index(name)]
    return None


class _Moving:
    """The moving entries of tensors, as boolean arrays of their shapes
    (None: none known to move), for one question.

    Args:
        assumed: entries taken as known (a loop's argument while its body
            is read), by tensor reference.
        depth: how deep in loops' bodies this question is.
    """

    def __init__(self, assumed=None, depth=0):
        self.assumed = dict(assumed or {})
        self.memo = dict(self.assumed)
        self.depth = depth

    def any(self, tensor):
        found = self.entries(tensor)
        return found is not None and bool(np.any(found))

    def entries(self, tensor):
        key = tensor.ref()
        if key not in self.memo:
            if self.depth > _MAX_DEPTH:
                return None
            self.depth += 1
            try:
                self.memo[key] = self._entries(tensor)
            finally:
                self.depth -= 1
        return self.memo[key]

    def _entries(self, tensor):
        op = tensor.op
        if not tensor.shape.is_fully_defined() or tensor.dtype == tf.resource:
            return None
        if op.type in _STATEFUL_DRAWS:
            return np.ones(tensor.shape, bool)
        if op.type in _SEED_HASHES:
            return np.full(tensor.shape, self.any(_seed_of(op)), bool)
        if op.type in _COPIES:
            return self.entries(op.inputs[0])
        if op.type == "IdentityN":
            return self.entries(op.inputs[tensor.value_index])
        if op.type == "Bitcast":
            return _bitcast(self.entries(op.inputs[0]), tensor.shape)
        if op.type == "ReadVariableOp":
            return _advanced_entries(op, tensor.shape)
        if op.type == "Placeholder":
            return self._passed(tensor)
        if op.type in _MOVERS:
            return self._moved(op, tensor)
        if op.type in _SHIFTS or op.type in _MODULI or op.type in ("Mul", "Neg"):
            return self._with_a_constant(op, tensor)
        return None

    def _moved(self, op, tensor):
        """The entries of a mover's output: the op itself, run on 0/1 arrays
        of its inputs' moving entries (the other inputs are constants)."""
        moving = _MOVERS[op.type]
        arguments = {}
        flat = iter(op.inputs)
        for arg in op.op_def.input_arg:
            count = op.get_attr(arg.number_attr) if arg.number_attr else 1
            given = [next(flat) for _ in range(count)]
            if arg.name in moving:
                entries = [self.entries(t) if t.shape.is_fully_defined() else None
                           for t in given]
                if any(not t.shape.is_fully_defined() for t in given):
                    return None
                values = [np.zeros(t.shape, np.int32) if e is None else e.astype(np.int32)
                          for t, e in zip(given, entries)]
            else:
                values = [const(t) for t in given]
                if any(v is None or np.asarray(v).dtype == object for v in values):
                    return None
            arguments[arg.name] = values if arg.number_attr else values[0]
        inferred = {a.type_attr for a in op.op_def.input_arg} | {
            a.number_attr for a in op.op_def.input_arg} | {"T"}
        for attr in op.op_def.attr:
            if attr.name not in inferred and attr.name in op.node_def.attr:
                arguments[attr.name] = op.get_attr(attr.name)
        try:
            with tf.init_scope():
                outputs = getattr(tf.raw_ops, op.type)(**arguments)
        except (TypeError, ValueError, tf.errors.OpError):
            return None
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return np.asarray(outputs[tensor.value_index]).astype(bool)

    def _with_a_constant(self, op, tensor):
        """A sum with, or a product by, a constant: the moving operand's
        entries, broadcast, where the constant keeps entries apart."""
        if op.type == "Neg":
            operand, constant = op.inputs[0], np.zeros([], np.int64)
        elif op.type in _MODULI:
            operand, constant = op.inputs[0], const(op.inputs[1])
        else:
            first, second = op.inputs
            operand, constant = (second, const(first)) if const(first) is not None else (
                first, const(second))
        if constant is None or np.asarray(constant).dtype == object:
            return None
        constant = np.asarray(constant)
        if op.type == "Mul" and not (np.issubdtype(constant.dtype, np.integer)
                                     and np.all(constant % 2 == 1)):
            return None  # An even factor drops high bits; 0 drops all.
        if op.type in _MODULI and not np.all(np.abs(constant) >= _SMALLEST_MODULUS):
            return None
        entries = self.entries(operand)
        if entries is None:
            return None
        return np.broadcast_to(entries, tensor.shape).copy()

    def _passed(self, tensor):
        """An argument of a function graph: what the op running it passes
        there (a loop's variable: also what its body passes on)."""
        graph = tensor.graph
        index = next((i for i, t in enumerate(graph.inputs) if t is tensor), None)
        caller = next((entry for entry in reversed(_callers()) if entry[0] is graph), None)
        if index is None or caller is None:
            return None
        _, op, offset = caller
        return self._caller_passes(op, offset + index, index)

    def _caller_passes(self, op, position, index):
        if position >= len(op.inputs):
            return None
        entries = self.entries(op.inputs[position])
        if op.type not in rowstate.LOOPS or entries is None:
            return entries
        # A loop's later values are its body's outputs, read in a question of
        # their own with this argument taken as its first value.
        body = rowstate.function_graphs(op)[1][0]
        later = _Moving({**self.assumed, body.inputs[index].ref(): entries}, self.depth + 1)
        found = later.entries(body.outputs[index])
        if found is None or np.shape(found) != np.shape(entries):
            return None
        return np.logical_and(entries, found)


def _bitcast(entries, shape):
    """The entries of a bitcast: an entry split over a new last axis, or
    entries joined along the last axis, moves where any of its parts does."""
    if entries is None:
        return None
    if entries.ndim < len(shape):
        entries = entries[..., None]
    elif entries.ndim > len(shape):
        entries = entries.any(axis=-1)
    return np.broadcast_to(entries, shape).copy()


def _advanced_entries(read, shape):
    """The entries of a variable's read that every write of the graph to it
    moves on from its own value (None when a write may set one back)."""
    handle = read.inputs[0]
    writes = [op for op in read.graph.get_operations()
              if op.inputs and op.inputs[0] is handle and op.type not in rowstate.READS]
    found = None
    for write in writes:
        step = _step_of(write, handle, shape)
        if step is None:
            return None
        found = step if found is None else np.logical_and(found, step)
    if found is None or not found.any():
        return None
    return found


def _step_of(write, handle, shape):
    """The entries `write` moves on from the variable's own value by a
    nonzero step, or None when it may set the variable to anything else."""
    if write.type in ("AssignAddVariableOp", "AssignSubVariableOp"):
        step = const(write.inputs[1])
        if step is None or np.asarray(step).dtype == object:
            return None
        return np.broadcast_to(np.asarray(step) != 0, shape).copy()
    if write.type != "AssignVariableOp":
        return None
    return _stepped(write.inputs[1], handle, shape)


def _stepped(tensor, handle, shape):
    """The entries of `tensor` that are the read of `handle` plus a nonzero
    constant, times an odd constant or modulo a constant m of 2 or more
    after a factor prime to m, as Keras' SeedGenerator computes its next
    state ((r + 1) * a mod m); None when it is anything else."""
    while tensor.op.type in ("Identity", "Cast"):
        tensor = tensor.op.inputs[0]
    op = tensor.op
    if op.type == "ReadVariableOp":
        return np.zeros(shape, bool) if op.inputs[0] is handle else None
    if op.type not in ("AddV2", "Add", "Sub", "Mul", "FloorMod", "Mod"):
        return None
    first, second = op.inputs
    if op.type in ("AddV2", "Add", "Mul") and const(first) is not None:
        first, second = second, first
    value = const(second)
    if value is None or np.asarray(value).dtype == object:
        return None
    value = np.asarray(value)
    inner = _stepped(first, handle, shape)
    if inner is None:
        return None
    if op.type in ("AddV2", "Add", "Sub"):
        return np.logical_or(inner, np.broadcast_to(value != 0, shape))
    if op.type == "Mul":
        return inner if np.all(value != 0) else None
    factor = const(first.op.inputs[1]) if first.op.type == "Mul" else 1
    # (r + 1) * m mod m is 0 whatever r: a bijection only where gcd(a, m) = 1.
    fits = (factor is not None and np.issubdtype(value.dtype, np.integer)
            and np.all(np.abs(value) >= 2) and np.all(
                np.gcd(np.asarray(factor).astype(np.int64), value.astype(np.int64)) == 1))
    return inner if fits else None
