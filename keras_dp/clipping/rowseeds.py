"""Which stateless random draws are fresh with every draw: their seeds,
followed entry by entry to the state they come from.

A stateless draw gives the same values at the same positions whenever its
seed repeats, so the values it gives the rows of a batch are fixed by their
position (known to anyone who reads the program) unless an entry of its seed
takes a new value at every draw, for many draws (`LONG_PERIOD`). Each entry
has a kind: random (`Random`: drawn afresh, as a `tf.random.Generator`'s
state, a stateful random op's output or another draw from a moving seed; or
a Keras SeedGenerator's unknown seed entry, the same at every draw), a
counter (`Counter`: a variable the graph's writes advance by a total nonzero
step, as Keras' SeedGenerator's second entry), an orbit (`Cycle`: Keras'
global SeedGenerator's `(r + 1) * a mod m`, its period found by running it),
or fixed (None). A seed is unknown at every draw only with an entry drawn
afresh, or a generator's seed entry beside one that moves on: a counter
alone is known (review round 167: 33 C under ghost). Only ops whose effect
on a kind is known carry it: copies, reshapes, slices, stacks and gathers
move entries unchanged; a cast, a constant added, a constant factor or a
modulus change a counter's step and modulus, so a counter whose step a cast
or modulus drops (2^32 cast to int32) no longer moves. A function's argument
carries what the op running it passes on the walk's path (a loop's also what
its body passes on); the step's or the map's own inputs and values captured
from outside carry nothing. Anything else is fixed, and the draw counts as
fixed by position (review rounds 103, 105, 106, 108: seeds read from a
variable nothing moves, set back each step, passed as a constant through a
function's argument, or advanced by a step a cast drops, each let one
example move the clipped sum by 4.6 C to 25 C).
"""

import dataclasses
import enum
import functools
import math
import threading

import numpy as np
import tensorflow as tf
from keras.src.random import seed_generator
from tensorflow.python.ops import control_flow_util  # Whether XLA compiles an op.

from keras_dp.clipping import rowstate
from keras_dp.clipping.rowtags import const

# Ops whose outputs are draws from state that moves on with every run.
_STATEFUL_DRAWS = frozenset("""RandomUniform RandomStandardNormal TruncatedNormal
RandomUniformInt RandomGamma RandomPoisson RandomPoissonV2 Multinomial StatefulUniform
StatefulUniformFullInt StatefulUniformInt StatefulStandardNormalV2 StatefulTruncatedNormal
StatefulRandomBinomial RngReadAndSkip""".split())
# Stateful draws with no state of their own to read: their op's seeds. Under
# XLA they draw the same values in every process, known to anyone who runs
# the program (review round 146: 1.88 C under ghost, 2.14 C vectorized).
_UNSTATED_DRAWS = frozenset("""RandomUniform RandomStandardNormal TruncatedNormal
RandomUniformInt RandomGamma RandomPoisson RandomPoissonV2 Multinomial RandomShuffle
ParameterizedTruncatedNormal""".split())
# Ops mixing every entry of their seed into every entry of their outputs.
_SEED_HASHES = frozenset("""StatelessRandomGetKeyCounter StatelessRandomGetKeyCounterAlg
StatelessRandomUniformV2 StatelessRandomNormalV2 StatelessTruncatedNormalV2
StatelessRandomUniformIntV2 StatelessRandomUniformFullIntV2 StatelessRandomUniform
StatelessRandomNormal StatelessTruncatedNormal StatelessRandomUniformInt
StatelessRandomUniformFullInt""".split())
# Ops whose output is their input, entry for entry.
_COPIES = frozenset("Identity Snapshot StopGradient EnsureShape".split())
# Ops that move entries without changing them, with the inputs that hold
# the entries; their other inputs must be constants.
_MOVERS = {"Reshape": ("tensor",), "ExpandDims": ("input",), "Squeeze": ("input",),
           "StridedSlice": ("input",), "Slice": ("input",), "GatherV2": ("params",),
           "Pack": ("values",), "ConcatV2": ("values",), "Unpack": ("value",),
           "Split": ("value",), "SplitV": ("value",), "Transpose": ("x",),
           "Tile": ("input",), "ReverseV2": ("tensor",), "BroadcastTo": ("input",)}
# Arithmetic with a constant.
_ARITHMETIC = frozenset("Add AddV2 Sub Mul Neg FloorMod Mod".split())
# A seed entry moves if it takes a new value at each of this many draws.
LONG_PERIOD = 2 ** 16
_MAX_DEPTH = 200
# The functions being read, innermost last: (graph, op running it, offset of
# its arguments among the op's inputs), per thread.
_LOCAL = threading.local()


class Spread(enum.Enum):
    """What is known of how a random entry's `span` values lie, which says
    how many a modulus or a cast leaves (review round 144: a draw of 2^16
    values times 65537, modulo 65537, always 0, was taken as 2^16 values)."""

    RANGE = 1  # Consecutive integers: modulo c, min(span, c) of them.
    RESIDUES = 2  # A range's image by additions and odd factors in the
    # integers' ring (modulo 2^bits): min(span, 2^j) residues modulo any 2^j.
    COUNT = 3  # Only their number.


@dataclasses.dataclass(frozen=True)
class Random:
    """An entry among `span` values (a draw between 0 and 1 gives one value:
    review round 137), which lie as `spread` says, from random state no one
    knows: drawn afresh at every draw, or, not `fresh`, a random generator's
    seed, the same at every draw (which a counter beside it moves on)."""

    span: int
    spread: Spread = Spread.RANGE
    fresh: bool = True
    bound: int = 0  # Values in [0, bound), where known (> 0).


@dataclasses.dataclass(frozen=True)
class Counter:
    """An entry c + t * step (mod modulus) at the t-th draw."""

    step: int
    modulus: int

    def period(self):
        return self.modulus // math.gcd(self.step % self.modulus, self.modulus)


@dataclasses.dataclass(frozen=True)
class Cycle:
    """An entry in [0, bound) that repeats only after `length` draws."""

    length: int
    bound: int

    def period(self):
        return self.length


def _moves(kind):
    """Whether `kind` takes a new value at every draw, for many draws."""
    if isinstance(kind, Random):
        return kind.fresh and kind.span >= LONG_PERIOD
    return kind is not None and kind.period() >= LONG_PERIOD


def _unknown(kinds):
    """Whether the entries of `kinds` draw values no one can know at every
    draw: one drawn afresh, or a generator's secret seed beside an entry
    that moves on. A counter alone (Keras' SeedGenerator's second entry,
    from 0 in every process) is known at every draw (review round 167: a
    seed of the counter entry alone, each row's draw foretold, 33 C under
    ghost)."""
    if any(isinstance(kind, Random) and _moves(kind) for kind in kinds):
        return True
    return any(_secret(kind) for kind in kinds) and any(_moves(kind) for kind in kinds)


def _keeps(first, then):
    """Whether a loop variable's entry, `first` before the loop and `then`
    after its body, is what `first` is at every iteration: moving on where
    it moves, a secret where it is one (review round 169: a body putting the
    counter where the secret was, [secret, t] then [t, t], 4.21 C under
    ghost)."""
    if _secret(first):
        return _secret(then) or (isinstance(then, Random) and _moves(then))
    return _moves(first) and _moves(then)


def _secret(kind):
    """Whether `kind` is a random generator's seed, unknown among many
    values and the same at every draw."""
    return isinstance(kind, Random) and not kind.fresh and kind.span >= LONG_PERIOD


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


def is_generator_state(handle):
    """Whether the captured `handle` holds the state of a random generator
    made since keras-dp was imported (a Keras `SeedGenerator`, a
    `tf.random.Generator`), whose draws are as random as that state: a
    variable of your own read as a seed holds what your code put there (a
    count of the examples a map stepped: review round 145, 7.60 C)."""
    with _NAMING, tf.init_scope():
        named = [(rowstate.variable_name(g.state), g) for g in _UNNAMED_GENERATORS]
        _GENERATOR_STATES.update(name for name, _ in named if name is not None)
        _UNNAMED_GENERATORS[:] = [g for name, g in named if name is None]
    return rowstate.resource_name(handle) in _GENERATOR_STATES


# The names of the resources of the states of the random generators made
# since keras-dp was imported (`is_generator_state`), and the generators
# whose state has no resource yet (a Keras variable made while building a
# functional model), named when one is asked about.
_GENERATOR_STATES = set()
_UNNAMED_GENERATORS = []
_NAMING = threading.Lock()


def _noting_the_state(init):
    """`init` of a random generator's class, which also notes its state."""
    @functools.wraps(init)
    def noted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        with _NAMING:
            _UNNAMED_GENERATORS.append(self)
    return noted


for _generator in (seed_generator.SeedGenerator, tf.random.Generator):
    _generator.__init__ = _noting_the_state(_generator.__init__)


def fixed_seed(op):
    """Whether the random op `op` draws from a seed no draw moves on (see the
    module docstring): a stateless op whose seed (or key) has no moving
    entry. Its values are then fixed by their position."""
    if not op.type.startswith("Stateless"):
        # A stateful op's state moves on with every draw, unknown but where
        # XLA compiles an op seeded by nothing.
        return known_under_xla(op)
    seed = _seed_of(op)
    return seed is None or not _Moving().seed_moves(seed)


def known_under_xla(op):
    """Whether the random op `op`, while it is traced, draws values anyone
    can know: a draw without state (`draws_without_state`) that XLA
    compiles (`xla_compiles`)."""
    return draws_without_state(op) and xla_compiles(op.graph)


def xla_compiles(graph):
    """Whether XLA compiles what is traced into `graph` now: inside a
    `jit_compile=True` function, or anywhere under auto-clustering
    (`tf.config.optimizer.set_jit`)."""
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph)
                or tf.config.optimizer.get_jit())


def draws_without_state(op):
    """Whether `op` is a stateful random draw with no state to read
    (`tf.random.uniform`, `tf.random.normal`): compiled by XLA, it draws
    from fixed seeds, the same values in every run. Keras' random layers
    and `keras.random` (a `SeedGenerator`'s state) and `tf.random.Generator`
    read state of their own."""
    return op.type in _UNSTATED_DRAWS


def seeds_only(op, indices):
    """Whether the inputs of `op` at `indices` are all the seed (seed, key
    or counter) of a stateless draw, which mixes each of their entries into
    every value it draws: no value of theirs comes out as it went in."""
    if op.type not in _SEED_HASHES:
        return False
    names = [arg.name for arg in op.op_def.input_arg]
    return all(names[i] in ("seed", "key", "counter") for i in indices)


def draws_from_state(op):
    """Whether `op`'s outputs are random values drawn from the state of the
    generator it takes (not that state itself, as `RngReadAndSkip` gives)."""
    return op.type in _STATEFUL_DRAWS and op.type != "RngReadAndSkip"


def draws_sharing_a_seed(ops, rows_of):
    """Two stateless draws among `ops` (with the ops of the functions they
    run) that may read one seed but lay its stream out otherwise, or None.

    One seed gives one stream: drawn as [B] and as [B, 2], row i holds
    entry i of it in one and entry 2i in the other, so comparing the two
    tells row 0 apart (review round 193: 3 C under ghost), whatever the
    seed. Draws of one op type, dtype, shape past the first axis and rows
    along it (`rows_of(tensor)`, the analysis' tag of the draw: [2B] is not
    [B], review round 194) lay every row out alike, and so may share one.
    A seed may be shared when
    the two seeds' non-constant sources meet (one tensor, or reads of one
    variable), or both come from a function's arguments."""
    draws = [op for top in ops for op in [top, *_ops_run_by(top)]
             if op.type.startswith("Stateless") and op.type not in _KEY_MAKERS
             and _seed_of(op) is not None]
    sources = [_seed_sources(_seed_of(op)) for op in draws]
    for first in range(len(draws)):
        for second in range(first):
            shared = (sources[first] & sources[second]
                      or _UNREAD in sources[first] | sources[second])
            if shared and _layout(draws[first], rows_of) != _layout(draws[second], rows_of):
                return draws[second], draws[first]
    return None


# Stateless ops that make a draw's key and counter from its seed, not draws.
_KEY_MAKERS = frozenset(["StatelessRandomGetKeyCounter", "StatelessRandomGetKeyCounterAlg"])


def _ops_run_by(op):
    if op.type in rowstate.CALLS or op.type in rowstate.LOOPS or op.type in rowstate.BRANCHES:
        for graph, _ in rowstate.function_graphs(op) or ():
            yield from rowstate.operations_within(graph)


# A seed's source standing for every function argument (`_seed_sources`).
_ARGUMENT = "argument"
# A seed's sources not all read (a walk cut short): it may share any.
_UNREAD = "unread"


def _seed_sources(seed, limit=256):
    """The non-constant ops a seed is computed from (variables by their
    handle, so that two reads of one meet), `_ARGUMENT` for a function's,
    `_UNREAD` past `limit` ops."""
    found, work, seen = set(), [seed.op], set()
    while work:
        op = work.pop()
        if (id(op.graph), op._id) in seen:
            continue
        if len(seen) == limit:
            return found | {_UNREAD}
        seen.add((id(op.graph), op._id))
        if op.type == "Placeholder":
            found.add(_placeholder_source(op))
            continue
        if op.type != "Const":
            found.add((id(op.graph), op.name))
        work.extend(t.op for t in op.inputs)
    return found


def _placeholder_source(placeholder):
    """What a placeholder holds: a value captured from outside (a variable's
    handle) is the outermost op it was captured from, in whatever function
    it is read; a function's argument is `_ARGUMENT`."""
    for _ in range(32):
        captured = next((external for external, internal in placeholder.graph.captures
                         if internal is placeholder.outputs[0]), None)
        if captured is None or getattr(captured, "graph", None) is None:
            break
        if captured.op.type != "Placeholder":
            return (id(captured.graph), captured.op.name)
        placeholder = captured.op
    if getattr(placeholder.graph, "outer_graph", None) is not None and not any(
            internal is placeholder.outputs[0] for _, internal in placeholder.graph.captures):
        return _ARGUMENT
    return (id(placeholder.graph), placeholder.name)


def _layout(op, rows_of):
    """How a draw lays its stream out in each row: its type, dtype, shape
    past the first axis and rows (an unknown part is never alike)."""
    shape, rows = op.outputs[0].shape, rows_of(op.outputs[0])
    rest = tuple(shape[1:]) if shape.rank else ()
    known = None not in rest and rows is not None
    return (op.type, op.outputs[0].dtype, rest, rows) if known else object()


def _seed_of(op):
    names = [arg.name for arg in op.op_def.input_arg]
    for name in ("seed", "key"):
        if name in names:
            return op.inputs[names.index(name)]
    return None


class _Moving:
    """The kinds of tensors' entries (`Random`, `Counter`, `Cycle`, or None:
    fixed), as object arrays of their shapes, for one question.

    Args:
        assumed: entries taken as known (a loop's argument while its body
            is read), by tensor reference.
        depth: how deep in loops' bodies this question is.
    """

    def __init__(self, assumed=None, depth=0):
        self.assumed = dict(assumed or {})
        self.memo = dict(self.assumed)
        self.depth = depth

    def seed_moves(self, seed):
        """Whether the seed (or key) `seed` of a stateless draw takes values
        no one can know at every draw (`_unknown`) in its entries' low 32
        bits, all that XLA's compiled draws read of them: a counter stepped
        by 2^32 draws the same values again under jit_compile (review round
        135: 3.88 C under ghost)."""
        found = self.entries(seed)
        return found is not None and _unknown(
            [_cast(kind, seed.dtype, tf.uint32) for kind in found.flat if kind is not None])

    def entries(self, tensor):
        """The kinds of `tensor`'s entries (an object array of its shape), or
        None when none is known to move."""
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
        if known_under_xla(op):
            return None
        if op.type in _STATEFUL_DRAWS or (op.type in _SEED_HASHES
                                          and self.seed_moves(_seed_of(op))):
            span = _span(op, tensor)
            return _filled(tensor.shape, Random(span) if span > 1 else None)
        if op.type in _SEED_HASHES:
            return None
        if op.type in _COPIES:
            return self.entries(op.inputs[0])
        if op.type == "IdentityN":
            return self.entries(op.inputs[tensor.value_index])
        if op.type == "Cast":
            return _each(self.entries(op.inputs[0]), tensor.shape,
                         lambda kind: _cast(kind, op.inputs[0].dtype, tensor.dtype))
        if op.type == "Bitcast":
            return _bitcast(self.entries(op.inputs[0]), tensor.shape, _bits(op.inputs[0].dtype),
                            _bits(tensor.dtype))
        if op.type == "ReadVariableOp":
            return _variable_kinds(op, tensor.shape)
        if op.type == "Placeholder":
            return self._passed(tensor)
        if op.type in _MOVERS:
            return self._moved(op, tensor)
        if op.type in _ARITHMETIC:
            return self._with_a_constant(op, tensor)
        return None

    def _moved(self, op, tensor):
        """The kinds of a mover's output: the op itself, run on arrays of
        codes of its inputs' kinds (the other inputs are constants)."""
        moving = _MOVERS[op.type]
        kinds, arguments = [None], {}
        flat = iter(op.inputs)
        for arg in op.op_def.input_arg:
            count = op.get_attr(arg.number_attr) if arg.number_attr else 1
            given = [next(flat) for _ in range(count)]
            if arg.name in moving:
                if any(not t.shape.is_fully_defined() for t in given):
                    return None
                values = [_codes(self.entries(t), t.shape, kinds) for t in given]
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
        codes = np.asarray(outputs[tensor.value_index])
        found = np.empty(codes.shape, object)
        found.flat[:] = [kinds[code] for code in codes.flat]
        return found

    def _with_a_constant(self, op, tensor):
        """A constant added, subtracted, multiplied or taken as modulus: the
        kinds of the other operand's entries, each changed as the op does."""
        if op.type == "Neg":
            operand, constant, first = op.inputs[0], np.zeros([], np.int64), False
        elif op.type in ("FloorMod", "Mod"):
            operand, constant, first = op.inputs[0], const(op.inputs[1]), False
        else:
            first = const(op.inputs[0]) is not None
            operand, constant = (op.inputs[1], const(op.inputs[0])) if first else (
                op.inputs[0], const(op.inputs[1]))
        if constant is None or not np.issubdtype(np.asarray(constant).dtype, np.integer):
            return None
        entries = self.entries(operand)
        if entries is None:
            return None
        constants = np.broadcast_to(np.asarray(constant), tensor.shape)
        entries = np.broadcast_to(entries, tensor.shape)
        found = np.empty(tensor.shape, object)
        found.flat[:] = [_after(op.type, kind, int(c), first, tensor.dtype)
                         for kind, c in zip(entries.flat, constants.flat)]
        return found

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
        kept = np.empty(entries.shape, object)
        kept.flat[:] = [first if _keeps(first, then) else None
                        for first, then in zip(entries.flat, found.flat)]
        return kept


def _filled(shape, kind):
    if kind is None:
        return None
    found = np.empty(shape, object)
    found.fill(kind)
    return found


def _each(entries, shape, change):
    if entries is None:
        return None
    found = np.empty(shape, object)
    found.flat[:] = [None if kind is None else change(kind) for kind in entries.flat]
    return found


def _codes(entries, shape, kinds):
    """`entries` as an int64 array of indices into `kinds` (0: None), which
    grows by the kinds it did not hold."""
    codes = np.zeros(shape, np.int64)
    if entries is not None:
        for index, kind in enumerate(entries.flat):
            if kind not in kinds:
                kinds.append(kind)
            codes.flat[index] = kinds.index(kind)
    return codes


def _bits(dtype):
    return dtype.size * 8


def _cast(kind, source, target):
    """An entry cast from the integer type `source` to `target`: a counter
    keeps the step left modulo 2^bits of `target`; an orbit or a counter
    modulo a number fits, or is lost; random values keep what their low bits
    hold."""
    if not (source.is_integer and target.is_integer):
        return None
    if isinstance(kind, Random):
        return _as_fresh_as(kind, _random_cast(kind, _bits(source), _bits(target)))
    ring = 2 ** _bits(target)
    if isinstance(kind, Counter) and _is_power_of_two(kind.modulus):
        modulus = min(kind.modulus, ring)
        return Counter(kind.step % modulus, modulus)
    bound = kind.modulus if isinstance(kind, Counter) else kind.bound
    return kind if 2 * bound <= ring else None


def _random_cast(kind, source_bits, target_bits):
    if target_bits >= source_bits:  # Every value kept (signs may wrap around).
        spread = Spread.COUNT if kind.spread is Spread.COUNT else Spread.RESIDUES
        return _random(kind.span, spread, target_bits)
    return _low_bits(kind, source_bits, target_bits)


def _low_bits(kind, bits, low):
    """Random values cut to their `low` lowest bits (of `bits`)."""
    if 0 < kind.bound <= 2 ** (low - 1):  # Every value fits, signed or not.
        return kind
    if kind.spread is Spread.COUNT:  # At most 2^(bits - low) share a value.
        return _random(-(-kind.span // 2 ** (bits - low)), Spread.COUNT, low)
    return _random(min(kind.span, 2 ** low), Spread.RESIDUES, low)


def _random(span, spread, bits):
    """`Random(span, spread)` of a type of `bits` bits, or None below two
    values; every value of the type is a range."""
    if span < 2:
        return None
    return Random(span, Spread.RANGE if span >= 2 ** bits else spread)


def _as_fresh_as(kind, result):
    """`result`, made from the random entry `kind`, the same at every draw
    where `kind` is."""
    if result is None or kind.fresh:
        return result
    return dataclasses.replace(result, fresh=False)


def _is_power_of_two(number):
    return number & (number - 1) == 0


def _after(op_type, kind, constant, constant_first, dtype):
    """The kind of `kind` after `op_type` with an integer `constant`."""
    if kind is None:
        return None
    ring = 2 ** _bits(dtype)
    if isinstance(kind, Random):
        return _as_fresh_as(kind, _random_after(op_type, kind, constant, _bits(dtype)))
    wraps = isinstance(kind, Counter) and _is_power_of_two(kind.modulus)
    if op_type in ("FloorMod", "Mod"):
        if constant < 2:
            return None
        if wraps:
            return Counter(kind.step % constant, constant)
        bound = kind.modulus if isinstance(kind, Counter) else kind.bound
        return kind if constant >= bound else None
    if wraps:  # Linear in the ring of the counter's modulus.
        if op_type == "Mul":
            return Counter(kind.step * constant % kind.modulus, kind.modulus)
        negated = op_type == "Neg" or (op_type == "Sub" and constant_first)
        return Counter(-kind.step % kind.modulus if negated else kind.step, kind.modulus)
    bound = kind.modulus if isinstance(kind, Counter) else kind.bound
    if op_type == "Mul":
        bound *= abs(constant)
        return Cycle(kind.period(), bound) if constant and 2 * bound <= ring else None
    bound += abs(constant)
    return Cycle(kind.period(), bound) if 2 * bound <= ring else None


def _random_after(op_type, kind, constant, bits):
    """Random values after `op_type` with an integer `constant`: an addition
    or an odd factor maps the ring onto itself (a range may wrap around); a
    modulus leaves min(span, c) values of a range, or of residues modulo a
    power of two c, and nothing known of others."""
    if op_type in ("FloorMod", "Mod"):
        if 0 < kind.bound <= abs(constant):  # Every value below it: unchanged.
            return kind
        return _random_modulo(kind, abs(constant), op_type == "FloorMod", bits)
    if op_type == "Mul" and constant == 1:
        return kind
    if op_type == "Mul" and constant % 2 == 0:
        return None  # An even factor drops bits.
    spread = Spread.COUNT if kind.spread is Spread.COUNT else Spread.RESIDUES
    return _random(kind.span, spread, bits)


def _random_modulo(kind, modulus, floored, bits):
    power = _is_power_of_two(modulus)
    if modulus < 2 or not (kind.spread is Spread.RANGE or (
            kind.spread is Spread.RESIDUES and power)):
        return None
    span = min(kind.span, modulus)
    if not floored:  # Signed remainders: as many values, not as laid out.
        return _random(span, Spread.COUNT, bits)
    if span == modulus:  # Every residue: the range [0, modulus).
        return _below(_random(span, Spread.RANGE, bits), modulus)
    return _below(_random(span, Spread.RESIDUES if power else Spread.COUNT, bits), modulus)


def _below(kind, bound):
    """Random `kind` whose values lie in [0, bound)."""
    return kind and dataclasses.replace(kind, bound=bound)


def _span(op, tensor):
    """How many values an integer draw `tensor` of `op` takes: its range
    where it has one (minval, maxval or the logits' classes), every value of
    its type otherwise; 0 for a float draw or a range keras-dp cannot read."""
    if not tensor.dtype.is_integer:
        return 0
    names = [arg.name for arg in op.op_def.input_arg]
    if "maxval" in names:
        low, high = (const(op.inputs[names.index(name)]) for name in ("minval", "maxval"))
        if low is None or high is None:
            return 0
        return max(int(np.max(high)) - int(np.min(low)), 0)
    if op.type == "Multinomial":
        return op.inputs[0].shape[-1] or 0
    if op.type in ("RandomPoisson", "RandomPoissonV2", "RandomGamma", "StatefulRandomBinomial"):
        return 0  # Counts, of a few likely values.
    return 2 ** _bits(tensor.dtype)


def _bitcast(entries, shape, source_bits, bits):
    """Random entries through a bitcast: one split over a new last axis (the
    low part first, little-endian), or several joined along the last axis,
    as many values as their most varied part; counters and orbits are not
    followed."""
    if entries is None or not all(k is None or isinstance(k, Random) for k in entries.flat):
        return None
    if entries.ndim < len(shape):
        parts = [_each(entries, entries.shape, lambda kind, i=i: _as_fresh_as(
            kind, _part(kind, source_bits, bits, i))) for i in range(shape[-1])]
        return _each(np.stack(parts, axis=-1), shape, lambda kind: kind)
    if entries.ndim > len(shape):
        joined = np.empty(shape, object)
        joined.flat[:] = [_joined(list(parts), bits)
                          for parts in entries.reshape(-1, entries.shape[-1])]
        return joined
    return _each(entries, shape,
                 lambda kind: _as_fresh_as(kind, _random_cast(kind, source_bits, bits)))


def _joined(parts, bits):
    """Random parts joined into values of `bits` bits: as many values as the
    most varied part, and the low part's residues (modulo 2^j up to its
    bits) where it is the most varied."""
    spans = [0 if kind is None else kind.span for kind in parts]
    low = parts[0]
    if low is not None and low.spread is not Spread.COUNT and low.span == max(spans):
        joined = _random(low.span, Spread.RESIDUES, bits)
    else:
        joined = _random(max(spans), Spread.COUNT, bits)
    # Fresh only if every part is: a secret seed joined with itself stays one.
    stale = [kind for kind in parts if kind is not None and not kind.fresh]
    return _as_fresh_as(stale[0], joined) if stale else joined


def _part(kind, bits, part_bits, index):
    """The `index`-th part of `part_bits` bits of random values of `bits`
    bits: the low part keeps what low bits hold; a part above the low bits
    takes at least the values of the bits up to its end, each shared by at
    most 2^(index * part_bits) of them."""
    if index == 0:
        return _low_bits(kind, bits, part_bits)
    if kind.spread is Spread.COUNT:
        return _random(-(-kind.span // 2 ** (bits - part_bits)), Spread.COUNT, part_bits)
    below = min(kind.span, 2 ** (part_bits * (index + 1)))
    return _random(-(-below // 2 ** (part_bits * index)), Spread.COUNT, part_bits)


def _variable_kinds(read, shape):
    """The kinds of the entries of a variable's read: counters where every
    write of the graph adds a constant to the variable's own value (their
    total the step), an orbit where its one write is Keras'
    `(r + c) * a mod m`, found by running it from the variable's value; None
    where any op may write it otherwise (also inside a function)."""
    handle = read.inputs[0]
    writes = rowstate.writes_of(handle)
    if not writes:
        return None
    kinds = _orbit(writes, read, shape)
    if kinds is None:
        total = np.zeros(shape, object)
        for write in writes:
            step = _step_of(write, writes)
            if step is None:
                return None
            total = total + np.broadcast_to(np.asarray(step, object), shape)
        ring = 2 ** _bits(read.outputs[0].dtype)
        kinds = _each(total, shape, lambda step: Counter(int(step) % ring, ring))
    if shape == (2,) and is_generator_state(handle):
        kinds[0] = _seed_entry(kinds[0], _bits(read.outputs[0].dtype))
    return kinds


def _seed_entry(kind, bits):
    """The kind of a Keras SeedGenerator's first entry, its seed (the second
    is its counter, from 0): unknown (`make_default_seed`'s range, or a seed
    you fix, row g's statement) and the same at every draw where no write
    moves it; along the global generator's orbit, from that unknown start,
    a new unknown value at every draw, among the orbit's."""
    if isinstance(kind, Cycle) and _moves(kind):
        return Random(min(kind.period(), kind.bound), Spread.COUNT, bound=kind.bound)
    if kind is None or _moves(kind) or bits < 32:
        return kind
    return Random(10 ** 9, Spread.RANGE, fresh=False, bound=10 ** 9 + 1)


def _step_of(write, writes):
    """The constant `write` adds to the variable's own value, or None when
    it may set the variable to anything else (`writes`: all the graph's
    writes of the variable)."""
    if write.type in ("AssignAddVariableOp", "AssignSubVariableOp"):
        step = _integer_constant(write.inputs[1])
        if step is None:
            return None
        return step if write.type == "AssignAddVariableOp" else -step
    if write.type != "AssignVariableOp":
        return None
    return _added_to_read(write.inputs[1], write, writes)


def _added_to_read(tensor, write, writes):
    """The constant `tensor`, the value `write` writes, adds to the
    variable's value just before `write` (sums and differences of constants
    on a read no other write of `writes` comes between: review round 110, a
    read taken before an increment and written back set the seed back each
    step, 14.3 C), or None."""
    while tensor.op.type in ("Identity", "Snapshot"):
        tensor = tensor.op.inputs[0]
    op = tensor.op
    if op.type == "ReadVariableOp":
        latest = _same_variable(op.inputs[0], write.inputs[0]) and not any(
            op._id < other._id < write._id for other in writes)
        return 0 if latest else None
    if op.type not in ("Add", "AddV2", "Sub"):
        return None
    first, second = op.inputs
    if op.type != "Sub" and _integer_constant(first) is not None:
        first, second = second, first
    value, inner = _integer_constant(second), _added_to_read(first, write, writes)
    if value is None or inner is None:
        return None
    return inner - value if op.type == "Sub" else inner + value


def _orbit(writes, read, shape):
    """An orbit where every write is one map `(r + c) * a mod m` (Keras'
    global SeedGenerator, advanced once by each draw of the step): each read
    then repeats after the map's period from the variable's value divided
    by its gcd with the number of writes."""
    maps = {_affine_map(write, writes) for write in writes}
    current = _value_of(read)
    if len(maps) != 1 or None in maps or current is None:
        return None
    ((added, factor, modulus),) = maps
    count = len(writes)
    start = np.broadcast_to(np.asarray(current, object), shape)
    parts = [np.broadcast_to(np.asarray(value, object), shape)
             for value in (added, factor, modulus)]
    found = np.empty(shape, object)
    found.flat[:] = [
        Cycle(_period_of_steps(int(x), int(c), int(a), int(m), count), int(m))
        for x, c, a, m in zip(start.flat, *(part.flat for part in parts))]
    return found


def _affine_map(write, writes):
    """`(c, a, m)` for a write of `(read + c) * a mod m` (integer
    constants, m >= 2), else None."""
    if write.type != "AssignVariableOp" or write.inputs[1].op.type != "FloorMod":
        return None
    product, modulus = write.inputs[1].op.inputs
    if product.op.type != "Mul":
        return None
    shifted, factor = product.op.inputs
    added = _added_to_read(shifted, write, writes)
    modulus, factor = _integer_constant(modulus), _integer_constant(factor)
    if added is None or modulus is None or factor is None or np.any(modulus < 2):
        return None
    return tuple(tuple(np.ravel(value).tolist()) for value in (added, factor, modulus))


def _period_of_steps(start, added, factor, modulus, count):
    """The period of the read of a variable the map x -> (x + added) *
    factor mod modulus advances `count` times a draw: the map's period from
    `start` over its gcd with `count` (`LONG_PERIOD` when over it)."""
    length = _orbit_length(start, added, factor, modulus, count * LONG_PERIOD)
    return length // math.gcd(length, count) if length else LONG_PERIOD


@functools.lru_cache(maxsize=256)  # Each draw of one trace asks again.
def _orbit_length(start, added, factor, modulus, limit):
    """The period the map x -> (x + added) * factor mod modulus settles into
    from `start`, or 0 when none shows within `limit` steps."""
    x = (start + added) * factor % modulus
    if math.gcd(factor, modulus) == 1:  # A bijection: x is on a cycle.
        first = x
        for step in range(1, limit + 1):
            x = (x + added) * factor % modulus
            if x == first:
                return step
        return 0
    seen = {}
    for step in range(limit + 1):
        if x in seen:
            return step - seen[x]
        seen[x] = step
        x = (x + added) * factor % modulus
    return 0


def _value_of(read):
    """The value of the variable `read` reads, from the handle captured from
    outside its graph (None where it is not known)."""
    captured = {id(internal): external for external, internal in
                getattr(read.graph, "captures", ())}
    external = captured.get(id(read.inputs[0]))
    if external is None or getattr(external, "graph", None) is not None:
        return None
    with tf.init_scope():
        return tf.raw_ops.ReadVariableOp(resource=external,
                                         dtype=read.outputs[0].dtype).numpy()


def _same_variable(handle, other):
    return any(alias is other for alias in rowstate.aliases(handle))


def _integer_constant(tensor):
    value = const(tensor)
    if value is None or not np.issubdtype(np.asarray(value).dtype, np.integer):
        return None
    return np.asarray(value).astype(object)
