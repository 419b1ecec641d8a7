"""State in the traced forward pass: which ops may write a variable that a later op reads.

A variable written from the batch and read back carries values of every
example into every row (BatchNormalization's moving statistics, a layer
remembering the batch mean). `independence` asks, for each op taking a
variable (a resource) as input, which earlier ops of the same graph may have
written it: any op taking that resource that is not a known read (and not a
function, loop or conditional whose body only reads it) counts, whatever
its type, so a write op missing from a list (a sliced assignment, a scatter)
is not overlooked. The value written is taken from all the writer's other
inputs: none may depend on the batch.
"""

import functools

import tensorflow as tf
from google.protobuf import message
from tensorflow.core.framework import resource_handle_pb2
from tensorflow.core.framework import tensor_pb2

# Ops that read a variable (or its shape) and never write it.
READS = frozenset("""ReadVariableOp ResourceGather ResourceGatherNd VariableShape
VarIsInitializedOp LookupTableFindV2 LookupTableSizeV2""".split())
CALLS = frozenset(["PartitionedCall", "StatefulPartitionedCall"])
LOOPS = frozenset(["While", "StatelessWhile"])
BRANCHES = {"If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
            "Case": ("branches",), "StatelessCase": ("branches",)}


def operations_within(graph, depth=0):
    """The ops of `graph` and of the functions, loops and conditionals it
    runs, however deep (a function keras-dp cannot read adds nothing)."""
    for op in graph.get_operations():
        yield op
        if (op.type in CALLS or op.type in LOOPS or op.type in BRANCHES) and depth < 32:
            for inner, _ in function_graphs(op) or ():
                yield from operations_within(inner, depth + 1)


def function_graphs(op):
    """The graphs of the functions `op` runs, each with the offset of its
    inputs among `op`'s (None when one cannot be read)."""
    if op.type in CALLS:
        names, offset = [op.get_attr("f").name], 0
    elif op.type in LOOPS:
        names, offset = [op.get_attr("cond").name, op.get_attr("body").name], 0
    else:
        names = [f.name for attr in BRANCHES[op.type] for f in
                 (op.get_attr(attr) if attr == "branches" else [op.get_attr(attr)])]
        offset = 1  # The predicate or branch index comes first.
    found = []
    for name in names:
        graph = getattr(op.graph._get_function(name), "graph", None)
        if graph is None:
            return None
        found.append((graph, offset))
    return found


def may_write(op, resource, depth=0):
    """Whether `op`, which takes `resource`, may write the variable it handles."""
    if op.type in READS:
        return False
    if op.type not in CALLS and op.type not in LOOPS and op.type not in BRANCHES:
        return True  # A write op, or one keras-dp does not know: it may write.
    inner = None if depth > 8 else passed_into(op, resource)
    return inner is None or any(may_write(consumer, argument, depth + 1)
                                for argument in inner for consumer in argument.consumers())


def passed_into(op, tensor):
    """The arguments of the functions `op` (a call, loop or conditional)
    runs that receive `tensor`, or None when one cannot be read."""
    try:
        graphs = function_graphs(op)
    except (AttributeError, KeyError, ValueError):
        return None
    if graphs is None:
        return None
    positions = [i for i, t in enumerate(op.inputs) if t is tensor]
    arguments = []
    for graph, offset in graphs:
        for position in positions:
            index = position - offset
            if not 0 <= index < len(graph.inputs):
                return None
            arguments.append(graph.inputs[index])
    return arguments


_ALIASES = frozenset(["Identity", "IdentityN", "Snapshot"])


def aliases(resource):
    """The tensors of `resource`'s graph that hold the same handle: its root
    (through identities), the other captures of the same resource, and every
    identity of them, with the input each takes."""
    while resource.op.type in _ALIASES:
        resource = resource.op.inputs[resource.value_index if resource.op.type == "IdentityN"
                                      else 0]
    found = [resource, *_same_resource(resource)]
    work = list(found)
    while work:
        for consumer in work.pop().consumers():
            if consumer.type in _ALIASES:
                outputs = [o for o in consumer.outputs if o.dtype == tf.resource]
                found += outputs
                work += outputs
    return found


def writers(op, start):
    """{resource input of `op`: [ops of its graph that may write it before `op`]}."""
    found = {}
    for tensor in op.inputs:
        if tensor.dtype != tf.resource or tensor.ref() in found:
            continue
        found[tensor.ref()] = [w for w in writes_of(tensor)
                               if w is not op and start < w._id < op._id]
    return found


def writes_of(resource):
    """The ops of `resource`'s graph that may write the variable (or table)
    it handles, through any of its aliases."""
    return [op for alias in aliases(resource) for op in alias.consumers()
            if op.type not in _ALIASES and may_write(op, alias)]


def written_values(op, start):
    """The inputs of the ops that may write a variable `op` takes, before it:
    what the variable may hold when `op` runs (resources left out)."""
    return [t for ws in writers(op, start).values() for w in ws for t in w.inputs
            if t.dtype != tf.resource]


def _same_resource(placeholder):
    """The other captures of `placeholder`'s graph that hold a handle of the
    resource it does (review round 112: a seed set back through
    `tf.identity(v.handle)`, captured apart from `v`, was taken as another
    variable's write, 7.22 C)."""
    captures = getattr(placeholder.graph, "captures", ())
    names = _resource_names(placeholder.graph, len(captures))
    name = names.get(id(placeholder))
    if name is None:
        return []
    return [internal for _, internal in captures
            if internal is not placeholder and names.get(id(internal)) == name]


@functools.lru_cache(maxsize=16)  # Read for every op taking a variable.
def _resource_names(graph, num_captures):
    """{id(capture): the resource it names} for the captures of eager handles
    in `graph` (`num_captures` of them: a graph being traced gains more)."""
    names = {}
    for external, internal in getattr(graph, "captures", ()):
        if internal.dtype == tf.resource and getattr(external, "graph", None) is None:
            try:
                with tf.init_scope():
                    names[id(internal)] = _resource_of(external)
            except (TypeError, ValueError, tf.errors.OpError, message.DecodeError):
                continue
    return names


def _resource_of(handle):
    """The resource an eager `handle` names, as TensorFlow's resource
    manager finds it: device, container, type and name. Not the rest of the
    handle: two handles of one variable may declare other shapes (review
    round 126: a counter written through one handle and read through
    another of shape [-1] was taken for two variables, 81 C)."""
    serialized = tf.io.serialize_tensor(handle).numpy()
    content = tensor_pb2.TensorProto.FromString(serialized).tensor_content
    length, start = _varint(content)  # One handle, its length first.
    handle = resource_handle_pb2.ResourceHandleProto.FromString(content[start:start + length])
    return (handle.device, handle.container, handle.hash_code, handle.name)


def _varint(data):
    """The protocol buffers varint at the start of `data`, and its length."""
    value = 0
    for index, byte in enumerate(data[:10]):
        value |= (byte & 0x7F) << (7 * index)
        if byte < 0x80:
            return value, index + 1
    raise message.DecodeError()


def variable_name(variable):
    """The name of the resource an eager (Keras or tf) variable holds, as
    `resource_name` names its captured handles."""
    if isinstance(getattr(variable, "value", None), tf.Variable):
        variable = variable.value  # A Keras variable's tf.Variable.
    handle = getattr(variable, "handle", None)
    return None if handle is None else _resource_of(handle)


def resource_name(handle):
    """The name of the resource a captured `handle` of a function graph
    holds (see `_resource_names`), or None for any other tensor."""
    captures = getattr(handle.graph, "captures", ())
    return _resource_names(handle.graph, len(captures)).get(id(handle))


def variables_touched(graph):
    """{the name of each resource `graph` captures (`_resource_of`): whether
    `graph` (or a function it runs) may write it}, so that the graphs of two
    functions can be compared."""
    captures = getattr(graph, "captures", ())
    names = _resource_names(graph, len(captures))
    touched = {}
    for _, internal in captures:
        name = names.get(id(internal))
        if name is None:
            continue
        touched[name] = touched.get(name, False) or bool(writes_of(internal))
    return touched
