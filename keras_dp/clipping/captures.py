"""What the step's per-example computations read from the step around them.

The vectorized engine's per-example pass runs as a function of its own,
so that everything it reads from the step is in its list of captures; the
ghost engine's per-example losses are read by the inputs of the ops they
make (`batch_source`). None may be computed from the batch, or one
example's gradient would depend on the others.
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
