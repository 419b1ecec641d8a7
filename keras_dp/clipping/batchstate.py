"""What a traced private step may keep of its batch beyond the step.

A variable (or table, file, printout, Python object) that a step's forward
or backward pass writes from the batch's values is neither clipped nor
noised: saved, it tells whether an example was trained on; read by a later
step, it lets one example move other examples' gradients. `keepers` finds,
in the ops of a traced step, those that may keep values of the batch:

* an op taking a resource that is not a known read (`rowstate.READS`),
  whose inputs, the handle included, depend on the batch;
* any other op that may keep its inputs (`_may_keep`: stateful, taking a
  handle, sharing state by name, or a debugger's or file's write registered
  as stateless) whose inputs depend on the batch: a Python function, a file
  or summary write, a print, TF1's queues and stacks, a stateful random op
  drawing as many values, or as many times, as the batch says (its
  generator's state shows it to later steps), an assertion whose message
  data (not its condition) depend on the batch;
* the ops inside the functions, loops and conditionals the step calls, with
  the batch followed into them input by input (a loop's carried values to
  their fixpoint), and every op counting as dependent where a conditional's
  predicate or a loop's condition depends on the batch (whether it runs
  does).

"Depends" is data flow, through any op: the shape of a tensor computed from
the batch's values (a boolean mask) depends on them too.
"""

import tensorflow as tf

from keras_dp.clipping import rowstate

# Stateful ops that keep nothing of their inputs.
_KEEPS_NOTHING = frozenset(["NoOp"])
# Random ops whose generator state advances with each draw: how many they
# drew, when it depends on the batch, shows in later steps' draws (Keras'
# own random ops are stateless, seeded from a SeedGenerator).
STATEFUL_RANDOM = frozenset("""RandomUniform RandomUniformInt RandomStandardNormal
TruncatedNormal ParameterizedTruncatedNormal RandomShuffle Multinomial RandomGamma
RandomPoisson RandomPoissonV2""".split())
# Ops TensorFlow registers as stateless that write their inputs elsewhere
# (a file, a debugger, another device's tensor by name).
_WRITES_THOUGH_STATELESS = frozenset("""DebugIdentity DebugIdentityV2 DebugIdentityV3
DebugNanCount DebugNumericSummary DebugNumericSummaryV2 DebugGradientIdentity Copy
CopyHost""".split())
# Attributes of ops that share state across runs, or write out, by name.
_SHARING_ATTRS = frozenset(["shared_name", "container", "debug_urls", "tensor_name"])
# Ops that pass values between the replicas of one step (keeping nothing
# beyond it): the sum over replicas of the clipped sums and the logs.
COLLECTIVES = frozenset("""CollectiveReduce CollectiveReduceV2 CollectiveReduceV3
CollectiveGather CollectiveGatherV2 CollectiveAllToAllV2 CollectiveAllToAllV3
NcclAllReduce""".split())
_MAX_DEPTH = 16
# Ops giving a tensor's shape, not its values.
_SHAPES = frozenset(["Shape", "ShapeN", "Size", "Rank"])


def keepers(ops, sources, barriers=()):
    """Each op of `ops` (or of a function they call) that may keep values of
    `sources`, as the ops from the step's graph down to it.

    Args:
        ops: operations of one graph, in the order they were created.
        sources: tensors of that graph (the batch).
        barriers: ops of that graph of one output each, whose output counts
            as not depending on `sources` (what the step releases privatized).

    Yields:
        Lists of ops, outermost first: the function, loop or conditional ops
        that lead to a keeper, then the keeper itself.
    """
    yield from _keepers(ops, DataFlow(sources, barriers), control=False, depth=0)


def _keepers(ops, flow, control, depth):
    for op in ops:
        if op.type == "Assert":
            # It shows its data when it fails (the step fails with it); its
            # condition only decides that. Shapes are what a kernel's own
            # error prints: TensorFlow's and Keras' shape checks (sparse
            # cross-entropy on sequences) show no value of the batch.
            values = flow.of_values()
            dependent = any(values.depends(t) for t in op.inputs[1:])
        else:
            dependent = control or any(flow.depends(t) for t in op.inputs)
        if not dependent:
            continue
        if op.type in rowstate.CALLS or op.type in rowstate.LOOPS or (
                op.type in rowstate.BRANCHES):
            yield from ([op] + inner for inner in _keepers_in_functions(op, flow, control, depth))
        elif _may_keep(op):
            yield [op]


def resource_users(ops, depth=0):
    """Each op of `ops` (or of a function they call) that takes a resource,
    as the ops from the step's graph down to it (see `keepers`)."""
    for op in ops:
        if op.type in rowstate.CALLS or op.type in rowstate.LOOPS or (
                op.type in rowstate.BRANCHES):
            graphs = None if depth >= _MAX_DEPTH else _function_graphs(op)
            if graphs is None:
                yield [op]
            for graph, _ in graphs or []:
                yield from ([op] + inner for inner in resource_users(graph.get_operations(),
                                                                     depth + 1))
        elif any(t.dtype == tf.resource for t in op.inputs):
            yield [op]


def _may_keep(op):
    """Whether `op` may keep its inputs: stateful, or taking a handle (a
    resource, or a reference of TF1's queues, stacks and barriers), or
    sharing state by name, or writing out though registered as stateless;
    not a known read."""
    if op.type in rowstate.READS or op.type in _KEEPS_NOTHING:
        return False
    return (op.op_def.is_stateful or op.type in _WRITES_THOUGH_STATELESS
            or any(attr.name in _SHARING_ATTRS for attr in op.op_def.attr)
            or any(t.dtype == tf.resource or t.dtype != t.dtype.base_dtype  # A reference.
                   for t in op.inputs))


def _keepers_in_functions(op, flow, control, depth):
    """`_keepers` in the bodies of the function, loop or conditional `op`
    (the op itself when they cannot be read)."""
    graphs = None if depth >= _MAX_DEPTH else _function_graphs(op)
    if graphs is None:
        if _may_keep(op) or op.op_def.is_stateful:
            yield []
        return
    dependent = [flow.depends(t) for t in op.inputs]
    if op.type in rowstate.LOOPS:
        dependent = _loop_fixpoint(graphs, dependent)
        cond_graph = graphs[0][0]
        control = control or DataFlow(_chosen(cond_graph.inputs, dependent)).depends(
            cond_graph.outputs[0])
    elif op.type in rowstate.BRANCHES:
        control = control or dependent[0]  # The predicate or branch index.
    for graph, offset in graphs:
        inner_flow = DataFlow(_chosen(graph.inputs, dependent[offset:]))
        yield from _keepers(graph.get_operations(), inner_flow, control, depth + 1)


def _function_graphs(op):
    try:
        return rowstate.function_graphs(op)
    except (AttributeError, KeyError, ValueError):
        return None


def _chosen(tensors, flags):
    return [t for t, flag in zip(tensors, flags) if flag]


def _loop_fixpoint(graphs, dependent):
    """The loop variables that may depend on the batch in some iteration."""
    body = graphs[1][0]
    dependent = list(dependent)
    while True:
        flow = DataFlow(_chosen(body.inputs, dependent))
        after = [was or flow.depends(out) for was, out in zip(dependent, body.outputs)]
        after += dependent[len(after):]
        if after == dependent:
            return dependent
        dependent = after


class DataFlow:
    """Whether tensors of one graph depend on `sources` by data flow, memoized
    per op (an op's outputs all depend when any of its inputs does)."""

    def __init__(self, sources, barriers=(), shapes=True):
        self._sources = {t.ref() for t in sources}
        self._barriers = tuple(barriers)
        self._memo = dict.fromkeys(barriers, False)
        self._shapes = shapes
        self._values = None

    def of_values(self):
        """The same flow through values only: a tensor's shape (`Shape`,
        `Size`, `Rank`) counts as depending on nothing."""
        if self._values is None:
            sources = [ref.deref() for ref in self._sources]
            self._values = DataFlow(sources, self._barriers, shapes=False)
        return self._values

    def depends(self, tensor):
        return tensor.ref() in self._sources or self._op_depends(tensor.op)

    def _op_depends(self, op):
        stack, visiting = [op], set()
        while stack:
            current = stack[-1]
            if current in self._memo:
                stack.pop()
                continue
            missing = [t.op for t in current.inputs if t.op not in self._memo]
            if missing and current not in visiting:
                visiting.add(current)
                stack.extend(missing)
                continue
            stack.pop()
            if not self._shapes and current.type in _SHAPES:
                self._memo[current] = False
                continue
            # An input still unknown here closes a cycle: it counts.
            self._memo[current] = any(t.ref() in self._sources for t in current.outputs) or any(
                t.ref() in self._sources or self._memo.get(t.op, True)
                for t in current.inputs)
        return self._memo[op]
