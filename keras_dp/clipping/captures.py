"""What the step's per-example computations read from the step around them.

The vectorized engine's per-example pass runs as a function of its own,
so that everything it reads from the step is in its list of captures; the
ghost engine's per-example losses and trusted norm functions are read by
the inputs of the ops they make (`reads_from_before`). None may be
computed from the batch (`batch_source`), or one example's gradient would
depend on the others.
"""

import tensorflow as tf


def batch_captured(graph):
    """The first capture of a function's `graph` computed from the step's
    batch, with the input of the step it comes from, as a pair; or None."""
    for external, _ in graph.captures:
        source = batch_source(external)
        if source is not None:
            return external, source
    return None


def batch_source(tensor):
    """An input of the step that `tensor` is computed from (following captures
    out of nested functions), or None when it comes from variables,
    constants and values fixed before the step alone."""
    seen, stack = set(), [tensor]
    while stack:
        t = stack.pop()
        if getattr(t, "graph", None) is None or t.dtype == tf.resource or t.ref() in seen:
            continue  # A value fixed before the step, or a variable.
        seen.add(t.ref())
        if t.op.type == "Placeholder":
            outer = {id(internal): external for external, internal in t.graph.captures}
            if id(t) not in outer:
                return t  # An argument of the step's function: its batch.
            stack.append(outer[id(t)])
        elif t.op.type != "ReadVariableOp":
            stack.extend(t.op.inputs)
    return None


def last_op_id(graph):
    """The id of the newest op of `graph` (op ids grow as ops are added)."""
    return max(graph._nodes_by_id, default=0)


def reads_from_before(graph, span, declared):
    """The tensors that the ops `graph` gained in `span` (ids after its
    first, up to its last) read from ops made before it, other than the
    `declared` arguments and variables: what a computation takes from the
    step around it."""
    start, end = span
    declared = {t.ref() for t in tf.nest.flatten(declared)}
    made = graph._nodes_by_id
    for op_id in range(start + 1, end + 1):
        for t in made[op_id].inputs if op_id in made else ():
            if t.op._id <= start and t.ref() not in declared and t.dtype != tf.resource:
                yield t
