"""Ghost clipping by construction: which examples each tensor of the forward pass reads.

Ghost clipping takes row i of every recorded tensor, and of its gradient,
as example i's. A weightless op that mixes the rows of a batch (a Lambda
subtracting the batch mean, or imputing NaN with the batch mean of a
column) breaks that silently: one example would move the clipped sum by
more than C. The vectorized engine runs each example alone, so it needs no
such check.

`Analysis` reads the graph that the ghost engine's recorded forward pass
builds (in training mode, as the step runs it) and tags every tensor on the
way from the model's inputs to its outputs with the examples it depends on
(`keras_dp.clipping.rowops`: `Rows` when entry i of its batch axis depends
on example i alone, `FREE` when it depends on none, `Mixed` otherwise). The
rules come from an allowlist of op types; an op not on it, a custom
gradient (`tf.custom_gradient`, a gradient override, a gradient registered
outside TensorFlow: whose backward pass nothing describes), a Python
function op, a variable that an op not known to only read it may have
written from the batch before it is read (`rowstate`), a loop whose trip
count depends on the batch: all are `Mixed`. The backward pass of the other
ops is TensorFlow's registered gradient, row-wise where the op is. Loops,
conditionals and nested functions are read through their function graphs.
Layers with a built-in norm function are known: the analysis checks that
they run on a tensor whose rows are the examples and takes their outputs as
rows, without reading their ops. Nothing is run: it
is a proof about the graph, not a probe on a sample, so an op that would
mix rows only for some inputs (NaN, a rare id) is refused as well.

A layer with a norm function whose inputs hold no example (keras-io's
position embedding, `Embedding` called on `range(maxlen)`) is handled when
its output reaches the batch through additions: row i of the sum's
gradient is then example i's gradient of that output (`Entry`).

The analysis runs once per trace of the step: its cost is a walk over the
ops of the forward pass (see `benchmarks/ghost_bert.py`). In eager mode the
forward pass builds no graph, so `check_traced` traces it once per input
signature.
"""

import inspect
import weakref

import keras
import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask
from tensorflow.python.framework import ops as tf_ops

from keras_dp.clipping import rowops
from keras_dp.clipping import rowseeds
from keras_dp.clipping import rowstate
from keras_dp.clipping.captures import reads_from_before
from keras_dp.clipping.rowstate import BRANCHES as _BRANCHES
from keras_dp.clipping.rowstate import CALLS as _CALLS
from keras_dp.clipping.rowstate import LOOPS as _LOOPS
from keras_dp.clipping.factors import sum_to_shape
from keras_dp.clipping.registry import UnsupportedModelError
from keras_dp.clipping.registry import registered_class
from keras_dp.clipping.rowtags import FREE
from keras_dp.clipping.rowtags import Listed
from keras_dp.clipping.rowtags import Mixed
from keras_dp.clipping.rowtags import Rows
from keras_dp.clipping.rowtags import mixed

UNKNOWN_OP = ("is not one of the ops keras-dp knows to keep the examples of a batch apart "
            "(it accepts only ops on its allowlist)")
# Custom gradients known to be element-wise, as (module, qualified name) of
# the gradient function: TensorFlow's swish (silu), which Keras' silu and
# swish activations call.
_KNOWN_GRADIENTS = frozenset([
    ("tensorflow.python.ops.nn_impl", "swish.<locals>.swish_impl.<locals>.grad")])
# Layers whose norm function may run on inputs that hold no example: they
# compute each entry of their last axis alone, so on inputs broadcast over
# the batch they compute, row by row, what they computed once.
FREE_CALLS = (keras.layers.Embedding, keras.layers.Dense)


def _graph_tensors(structure, graph):
    return [t for t in tf.nest.flatten(structure)
            if isinstance(t, tf.Tensor) and getattr(t, "graph", None) is graph]


class Tags:
    """The tags of the tensors of one graph, computed on demand.

    Args:
        graph: the graph.
        seeds: (tensor, tag) pairs known beforehand (the model's inputs, or
            a function graph's inputs).
        top: True for the graph of the step, whose other placeholders are
            captures (free) or inputs of the step (not the model's).
        more_rules: rules `rule(op, tags)` by op type, read before the
            allowlist's (also for inputs already mixed) by a caller that
            knows more ops (`keras_dp.data.ragged_text`); a rule returning
            None leaves the op to the allowlist. A tag of a subclass of
            `Mixed` carries a claim only such rules read: any other op
            makes it plainly mixed.
    """

    def __init__(self, graph, seeds, top=False, start=0, more_rules=None):
        self.graph = graph
        self.top = top
        self.start = start
        self.memo = {t.ref(): tag for t, tag in seeds}
        self.overrides = {}
        self.more_rules = more_rules or {}

    def tag(self, tensor):
        """The tag of `tensor` (a tensor of this graph)."""
        stack, visiting = [tensor], set()
        while stack:
            t = stack[-1]
            if t.ref() in self.memo:
                stack.pop()
                continue
            missing = [d for d in self._dependencies(t) if d.ref() not in self.memo]
            if missing and t.ref() not in visiting:
                visiting.add(t.ref())
                stack.extend(missing)
                continue
            stack.pop()
            self._compute(t)
        return self.memo[tensor.ref()]

    def _dependencies(self, t):
        if t.ref() in self.overrides:
            return self.overrides[t.ref()][0]
        # What a variable the op takes may hold: the values written to it before.
        return list(t.op.inputs) + rowstate.written_values(t.op, self.start)

    def _compute(self, t):
        if t.ref() in self.overrides:
            inputs, rule = self.overrides[t.ref()]
            self.memo[t.ref()] = rule([self.memo.get(i.ref(), _cycle(t.op)) for i in inputs])
            return
        op = t.op
        tags = [self.memo.get(i.ref(), _cycle(op)) for i in op.inputs]
        outputs = self._op_tags(op, tags)
        if not isinstance(outputs, list):
            outputs = [outputs] * len(op.outputs)
        for output, tag in zip(op.outputs, outputs):
            if type(tag) is Mixed and tag.anchor is None and self.top:
                tag = Mixed(tag.op_name, tag.op_type, tag.why, op._id)
            self.memo.setdefault(output.ref(), tag)

    def _op_tags(self, op, tags):
        if op.type == "Placeholder":
            return self._placeholder(op)
        if "_gradient_op_type" in op.node_def.attr and not _known_gradient(op):
            return mixed(op, "has a custom gradient (tf.custom_gradient or a gradient "
                             "override), whose backward pass keras-dp cannot read")
        if not _gradient_of_tensorflow(op.type):
            return mixed(op, "has a gradient registered outside TensorFlow "
                             "(tf.RegisterGradient), whose backward pass keras-dp cannot read")
        if any(self.memo.get(w.ref()) is not FREE
               for w in rowstate.written_values(op, self.start)):
            return mixed(op, "reads a variable written from the batch (or by an op "
                             "keras-dp does not know) earlier in the step")
        if op.type == "ReadVariableOp":
            return FREE
        if op.type in ("Identity", "IdentityN", "Snapshot"):
            return list(tags)  # Each output is its input (Mixed ones included).
        rule = self.more_rules.get(op.type)
        found = rule(op, tags) if rule else None
        if found is not None:
            return found
        broken = next((t for t in tags if isinstance(t, Mixed)), None)
        if broken is not None and op.type not in rowops.SEES_MIXED:
            return broken if type(broken) is Mixed else mixed(
                op, f"works on values {broken.op_name} made of the whole batch")
        try:
            if op.type in _CALLS:
                return self._function(op, "f", tags)
            if op.type in _LOOPS:
                return self._loop(op, tags)
            if op.type in _BRANCHES:
                return self._branches(op, tags)
            rule = LIST_RULES.get(op.type) or rowops.RULES.get(op.type)
            if rule is None:
                return mixed(op, UNKNOWN_OP)
            if op.type not in LIST_RULES and any(isinstance(t, Listed) for t in tags):
                return mixed(op, "receives a TensorList")
            return _shared_only_if_free(op, tags, rule(op, tags))
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
            return mixed(op, f"has arguments keras-dp cannot read ({type(error).__name__})")

    def _placeholder(self, op):
        t = op.outputs[0]
        if not self.top:
            return mixed(op, "is an input of a function graph that keras-dp did not pass")
        captures = {id(internal): external for external, internal in self.graph.captures}
        if id(t) in captures:
            external = captures[id(t)]
            if t.dtype == tf.resource or getattr(external, "graph", None) is None:
                return FREE  # A variable, or a value fixed before the step.
            return mixed(op, "reads a tensor captured from an enclosing function")
        return mixed(op, "reads an input of the step other than the model's inputs")

    def _function_tags(self, op, name, tags):
        function = op.graph._get_function(name)
        graph = getattr(function, "graph", None)
        if graph is None or len(graph.inputs) != len(tags):
            return mixed(op, "calls a function whose graph keras-dp cannot read")
        inner = Tags(graph, zip(graph.inputs, tags), more_rules=self.more_rules)
        with rowseeds.called_from(op, graph):
            return [inner.tag(t) for t in graph.outputs]

    def _function(self, op, attr, tags):
        return self._function_tags(op, op.get_attr(attr).name, tags)

    def _branches(self, op, tags):
        if tags[0] is not FREE:
            return mixed(op, "chooses a branch from values of the batch")
        names = [f.name for attr in _BRANCHES[op.type] for f in
                 (op.get_attr(attr) if attr == "branches" else [op.get_attr(attr)])]
        found = [self._function_tags(op, name, tags[1:]) for name in names]
        outputs = [op.graph._get_function(name).graph.outputs for name in names]
        return [_join_free_and_rows(op, column, tensors)
                for column, tensors in zip(zip(*found), zip(*outputs))]

    def _loop(self, op, tags):
        cond, body = op.get_attr("cond").name, op.get_attr("body").name
        for _ in range(8):
            goes_on = self._function_tags(op, cond, tags)[0]
            if goes_on is not FREE:
                return [mixed(op, "runs a loop as long as a value of the batch says")] * len(tags)
            after = self._function_tags(op, body, tags)
            outputs = op.graph._get_function(body).graph.outputs
            joined = [_join_free_and_rows(op, pair, given)
                      for pair, given in zip(zip(tags, after), zip(op.inputs, outputs))]
            if joined == tags:
                return tags
            tags = joined
        return mixed(op, "runs a loop whose values keras-dp cannot follow")


def _shared_only_if_free(op, tags, found):
    """`found`, the tags of `op`'s outputs, unless they are all FREE (one
    value shared by every example) though `op` reads values of the batch's
    rows, then in a parameter: a slice's begin, a pad's paddings, an axis
    (review round 55: a constant sliced at a begin read from a batch of two
    rows let one example set the other's scale, 3 C). Ops reading only
    shapes (`rowops.SEES_MIXED`) make shared values of any input."""
    outputs = found if isinstance(found, list) else [found]
    if (all(t is FREE for t in outputs) and any(isinstance(t, Rows) for t in tags)
            and op.type not in rowops.SEES_MIXED):
        return mixed(op, "reads values of the batch's examples into a value shared by "
                         "every example (an op parameter such as a begin, a padding, "
                         "an axis or a size)")
    return found


def _known_gradient(op):
    """Whether `op`'s custom gradient is one of `_KNOWN_GRADIENTS` (found
    among the closures of the function tf.custom_gradient registered)."""
    try:
        found = [tf_ops._gradient_registry.lookup(op.get_attr("_gradient_op_type").decode())]
    except (AttributeError, LookupError, ValueError):
        return False
    for _ in range(8):
        if any((f.__module__, f.__qualname__) in _KNOWN_GRADIENTS for f in found):
            return True
        found = [cell.cell_contents for f in found for cell in f.__closure__ or ()
                 if _function_in(cell)]
    return False


def _gradient_of_tensorflow(op_type):
    """Whether the gradient registered for `op_type` is TensorFlow's own (or
    none: nothing flows back), not one a user registered for an op that had none."""
    try:
        gradient = tf_ops._gradient_registry.lookup(op_type)
    except LookupError:
        return True
    return gradient is None or getattr(gradient, "__module__", "").startswith("tensorflow.")


def _function_in(cell):
    try:
        return inspect.isfunction(cell.cell_contents)
    except ValueError:  # An empty cell.
        return False


def _cycle(op):
    return mixed(op, "is part of a cycle")


def _join(a, b):
    """The tag of a value that may be `a` or `b` (None: no tag covers both)."""
    if a == b or type(a) is Mixed:
        return a
    if type(b) is Mixed:
        return b
    if isinstance(a, Mixed) or isinstance(b, Mixed):
        return None  # A claim of a caller's rules (a subclass) holds only if both make it.
    if a is FREE and isinstance(b, Rows) or b is FREE and isinstance(a, Rows):
        return a if a is not FREE else b
    if isinstance(a, Listed) and isinstance(b, Listed):
        if a.element is None or b.element is None:
            return a if b.element is None else b
        element = _join(a.element, b.element)
        return None if element is None else Listed(element)
    return None


def _join_all(op, tags):
    joined = tags[0]
    for tag in tags[1:]:
        joined = _join(joined, tag)
        if joined is None:
            return mixed(op, "gives a value whose batch axis differs between iterations or "
                             "branches")
    return joined


def _join_free_and_rows(op, tags, tensors):
    """`_join_all` of the tags one output of `op` takes in its branches (or
    iterations), where `tensors` hold those values: a free value joined
    with the batch's rows must be the same at every position of the batch
    (review round 36: a cond giving a constant of alternating signs in one
    branch and the batch's rows in the other, 6.7 C, tagged as rows)."""
    joined = _join_all(op, tags)
    if isinstance(joined, Rows) and any(
            tag is FREE and rowops.by_position(t, joined.axis) for tag, t in zip(tags, tensors)):
        return mixed(op, "gives a value that may differ by its position in the batch where "
                         "another branch or iteration gives the batch's rows")
    return joined


# --- TensorLists (the loops of recurrent layers).

def _list_from_tensor(op, tags):
    tag = tags[0]
    if tag is FREE:
        return Listed(FREE)
    if isinstance(tag, Rows) and tag.axis > 0:
        return Listed(Rows(tag.axis - 1, tag.block))
    return mixed(op, "makes a list of the examples of a batch")


def _list_reserve(op, tags):
    if tags[1] is not FREE:
        return mixed(op, "makes a list as long as the batch")
    return Listed()


def _list_get(op, tags):
    if tags[1] is not FREE or not isinstance(tags[0], Listed):
        return mixed(op, "reads a list at a position from the batch")
    return tags[0].element or FREE


def _list_set(op, tags):
    if tags[1] is not FREE or not isinstance(tags[0], Listed):
        return mixed(op, "writes a list at a position from the batch")
    element = tags[2] if tags[0].element is None else _join(tags[0].element, tags[2])
    return Listed(element) if element is not None else mixed(op, "mixes batch axes in a list")


def _list_stack(op, tags):
    element = tags[0].element if isinstance(tags[0], Listed) else None
    if isinstance(element, Rows):
        return Rows(element.axis + 1, element.block)
    return FREE if element in (None, FREE) else mixed(op, "stacks a list it cannot read")


def _list_length(op, tags):
    return FREE


LIST_RULES = {
    "TensorListFromTensor": _list_from_tensor, "TensorListReserve": _list_reserve,
    "EmptyTensorList": lambda op, tags: Listed(), "TensorListGetItem": _list_get,
    "TensorListSetItem": _list_set, "TensorListStack": _list_stack,
    "TensorListLength": _list_length,
}


# --- The recorded forward pass.

class Entry:
    """Where the output of a layer call on inputs that hold no example enters
    the batch: `tensor` (rows) = batch + `source` (free, made from the
    layer's output by `chain`, identities and casts), so the gradient of
    the layer's output for example i is row i of `tensor`'s gradient summed
    to `source`'s shape (negated for a subtraction), back through `chain`."""

    def __init__(self, tensor, source, sign, chain):
        self.tensor, self.source, self.sign, self.chain = tensor, source, sign, chain

    def per_example(self, grad):
        """`[B, *output.shape]` per-example gradients of the layer's output."""
        shape = self.source.shape.as_list()
        if len(shape) == grad.shape.rank:  # A leading axis of 1 met the batch's.
            grad = tf.reshape(sum_to_shape(grad, shape[1:]), [-1, *shape])
        else:
            grad = sum_to_shape(grad, shape)
        grad = grad * self.sign
        for op in reversed(self.chain):
            grad = tf.cast(grad, op.inputs[0].dtype)
            grad = tf.reshape(grad, [-1, *op.inputs[0].shape.as_list()])
        return grad


_CHAIN = frozenset(["Identity", "Cast", "Reshape", "ExpandDims", "Squeeze"])
_ENTRIES = frozenset(["AddV2", "Add", "Sub", "BiasAdd"])


class Analysis:
    """The analysis of one recorded forward pass of `model` (see the module docstring).

    The recorder reports each layer call (`span`) and each call through a
    norm function (`call`) while the forward pass is built; `check` then
    refuses the model, naming the layer, the op and the fix, or returns the
    `Entry`s of the calls on inputs that hold no example.
    """

    def __init__(self, model, sources, batch_size):
        self.model = model
        self.batch_size = batch_size or _fit_batch_size(model)
        self.graph = tf.compat.v1.get_default_graph()
        # Op ids grow as ops are added, with `graph.version` (the op count)
        # at a fixed offset: the spans of layer calls are ranges of ids.
        self._offset = max(self.graph._nodes_by_id, default=0) - self.graph.version
        self._start = self.last_id()
        self.tags = Tags(self.graph, [(t, Rows(0, 1)) for t in sources], top=True,
                         start=self._start)
        self.spans = []
        self.calls = []

    def last_id(self):
        """The id of the last op added to the graph."""
        return self.graph.version + self._offset

    def span(self, layer, start, end):
        self.spans.append((start, end, layer))

    def call(self, layer, args, kwargs, outputs, trusted, span):
        """Records a call through a norm function, whose inputs must be rows
        or free. With `trusted` (a built-in norm function, which keeps the
        batch axis first) its outputs are rows when its inputs are, whatever
        ops it runs (e.g. the loops of recurrent layers); otherwise (a norm
        function registered by the user) its ops are read as any others.
        `span`: the first and last id of the ops the call made.

        Raises:
            UnsupportedModelError: for a trusted norm function whose ops read
                a value of the batch other than its inputs.
        """
        inputs = _graph_tensors((args, kwargs), self.graph)
        record = _Call(layer, inputs, _graph_tensors(outputs, self.graph))
        self.calls.append(record)
        if not trusted:
            return record  # Its ops are read like any other layer's.
        stray = self._read_from_outside(span, inputs)
        if stray is not None:
            raise UnsupportedModelError(
                f"Layer '{layer.name}' ({type(layer).__name__}) reads {stray.name}, a value "
                "of the batch that is not one of its inputs (a setting such as epsilon "
                "holding a tensor another layer computed), so keras-dp cannot tell that "
                "it keeps the examples apart. Fix: give the layer's settings Python "
                'numbers; clipping_engine="auto" otherwise runs the vectorized engine.')
        positioned = self._set_by_position(inputs)
        if positioned is not None:
            raise UnsupportedModelError(
                f"Layer '{layer.name}' ({type(layer).__name__}) is given {positioned.name}, "
                "a value that holds no example but may differ by its position in the batch "
                "(e.g. an initial state or mask set per row), so each example would be "
                "given the value of its position. Fix: compute it from each example, or "
                'make it the same for every row; clipping_engine="auto" otherwise runs the '
                "vectorized engine.")
        for output in record.outputs:
            self.tags.overrides[output.ref()] = (inputs, record.output_tag)
        return record

    def _set_by_position(self, inputs):
        """A free input of a trusted call with the batch's rows that lines
        up with them and may differ along them, or None (review round 45: a
        recurrent layer's initial_state of alternating signs per row, 12.1 C
        under ghost; a built-in norm function reads its inputs row by row)."""
        rows = [t for t in inputs if self.tags.tag(t) == Rows(0, 1) and t.shape.rank]
        if not rows:
            return None
        batch = rows[0].shape[0]
        return next((t for t in inputs if self.tags.tag(t) is FREE and t.shape.rank
                     and (batch is None or t.shape[0] in (None, batch))
                     and rowops.by_position(t, 0)), None)

    def _read_from_outside(self, span, inputs):
        """A tensor made before `span` that its ops read, other than `inputs`,
        a variable or a free value (review round 24: LayerNormalization's
        epsilon, an object adding a batch statistic, 5.75 C at B = 9)."""
        return next((t for t in reads_from_before(self.graph, span, inputs)
                     if self.tags.tag(t) is not FREE), None)

    def check(self, outputs):
        """Refuses a forward pass ghost clipping cannot clip exactly.

        Args:
            outputs: the model's outputs.

        Returns:
            {index in `calls`: [Entry, ...]} for the calls on inputs that
            hold no example.

        Raises:
            UnsupportedModelError: naming the layer, the op and the fix.
        """
        self._refuse_draws_sharing_a_seed()
        for record in self.calls:
            tag = record.input_tag([self.tags.tag(t) for t in record.inputs])
            if isinstance(tag, Mixed):
                raise UnsupportedModelError(self.mixed_message(tag))
            if tag not in (FREE, Rows(0, 1)):
                raise UnsupportedModelError(self.rows_message(record.layer, _rows_detail(
                    tag, self.batch_size)))
        sinks = _graph_tensors(outputs, self.graph)
        sinks += [m for m in (get_keras_mask(t) for t in sinks) if m is not None]
        for sink in sinks:
            tag = self.tags.tag(sink)
            if isinstance(tag, Mixed):
                raise UnsupportedModelError(self.mixed_message(tag))
            if tag not in (FREE, Rows(0, 1)):
                raise UnsupportedModelError(self.mixed_message(Mixed(
                    sink.op.name, sink.op.type, "returns an output whose first axis is not "
                    "the batch", sink.op._id)))
            if tag is FREE and sink.shape.rank and rowops.by_position(sink, 0):
                # Review round 31: a constant mask alternating along the
                # batch weighed each example by its position, 6.3 C.
                raise UnsupportedModelError(self.mixed_message(Mixed(
                    sink.op.name, sink.op.type, "returns an output or mask whose rows differ "
                    "by position in the batch", sink.op._id)))
        return {index: self._entries(record) for index, record in enumerate(self.calls)
                if record.input_tag([self.tags.memo[t.ref()] for t in record.inputs]) is FREE}

    def _refuse_draws_sharing_a_seed(self):
        """Refuses two draws of the forward pass that may share one seed
        but lay its stream out otherwise (`rowseeds.draws_sharing_a_seed`)."""
        shared = rowseeds.draws_sharing_a_seed(
            (op for op in self.graph.get_operations() if op._id > self._start),
            lambda t: self.tags.tag(t) if t.graph is self.graph else None)
        if shared is not None:
            first, second = shared
            raise UnsupportedModelError(self.mixed_message(Mixed(
                second.name, second.type, f"draws from a seed {first.name} may draw from "
                "too, laid out otherwise: comparing the two tells examples' positions "
                "apart", second._id)))

    def _entries(self, record):
        """The `Entry`s through which a call on free inputs reaches the batch."""
        allowed = registered_class(type(record.layer)) in FREE_CALLS
        if not allowed or len(record.outputs) != 1:
            raise UnsupportedModelError(self.rows_message(record.layer, (
                "it holds no example (its inputs come from weights and constants only), "
                "and only Embedding and Dense layers may run on such inputs")))
        rule_inputs = {t.ref() for r in self.calls for t in r.inputs}
        entries, work = [], [(record.outputs[0], [])]
        while work:
            tensor, chain = work.pop()
            for op in tensor.consumers():
                out = op.outputs[0] if op.outputs else None
                if out is None or out.ref() not in self.tags.memo:
                    continue  # Not on the way to the model's outputs.
                tag = self.tags.memo[out.ref()]
                static = tensor.shape.is_fully_defined()
                if op.type in _CHAIN and tag is FREE and static and out.shape.is_fully_defined():
                    work.append((out, chain + [op]))
                elif (op.type in _ENTRIES and tag == Rows(0, 1) and static
                      and (tensor.shape.rank < out.shape.rank or tensor.shape[0] == 1)
                      and (op.type != "BiasAdd" or op.get_attr("data_format") == b"NHWC")):
                    sign = -1 if op.type == "Sub" and op.inputs[1] is tensor else 1
                    entries.append(Entry(out, tensor, sign, chain))
                else:
                    raise UnsupportedModelError(self.rows_message(record.layer, (
                        "it holds no example (its inputs come from weights and constants "
                        "only), and its output reaches the batch through op "
                        f"'{op.name}' ({op.type}), where keras-dp cannot split its gradient "
                        "per example (it can where the output is added to the batch)")))
            if tensor.ref() in rule_inputs:
                raise UnsupportedModelError(self.rows_message(record.layer, (
                    "it holds no example, and its output goes into another layer with a "
                    "norm function, where keras-dp cannot split its gradient per example")))
        return entries

    def _where(self, anchor):
        inside = [(start, layer) for start, end, layer in self.spans
                  if anchor is not None and start < anchor <= end]
        if not inside:
            return f"Model '{self.model.name}'"
        layer = max(inside, key=lambda s: s[0])[1]
        if layer is self.model:
            return f"Model '{self.model.name}'"
        return f"Layer '{layer.name}' ({type(layer).__name__})"

    def mixed_message(self, tag):
        size = f" (here a batch of {self.batch_size})" if self.batch_size else ""
        return (f"{self._where(tag.anchor)} mixes the examples of a batch: as far as "
                f"keras-dp can tell, its op '{tag.op_name}' ({tag.op_type}) {tag.why}. Ghost "
                f"clipping takes row i of every tensor and of its gradient as example i's"
                f"{size}, so it would not be exact. Fix: compute that value from each example "
                "alone (keras-dp reads the traced graph, with an allowlist of ops); "
                'clipping_engine="auto" otherwise runs the vectorized engine, which runs each '
                'example alone ("ghost" refuses the model).')

    def rows_message(self, layer, detail):
        return (f"Layer '{layer.name}' ({type(layer).__name__}) runs on a tensor whose first "
                f"axis is not the batch: {detail}. Its norm function takes row i as example "
                "i's, so ghost clipping cannot tell the examples apart. Fix: apply it to a "
                'tensor of shape [batch, ...]; clipping_engine="auto" otherwise runs the '
                'vectorized engine ("ghost" refuses the model).')


def _fit_batch_size(model):
    """The batch size fit was given (`SamplingInfo.batch_size`: the expected
    size of Poisson batches), for messages, when the traced one is unknown."""
    size = getattr(getattr(model, "sampling_info", None), "batch_size", None)
    return int(round(size)) if isinstance(size, (int, float)) and size >= 1 else None


def _rows_detail(tag, batch_size):
    if isinstance(tag, Rows) and tag.axis == 0:
        rows = f" ({tag.block * batch_size} rows for a batch of {batch_size})" if batch_size else ""
        return f"it holds {tag.block} rows per example{rows}"
    if isinstance(tag, Rows):
        return f"its examples are along axis {tag.axis}"
    return "it is made from the batch size"


class _Call:
    def __init__(self, layer, inputs, outputs):
        self.layer, self.inputs, self.outputs = layer, inputs, outputs

    @staticmethod
    def input_tag(tags):
        broken = next((t for t in tags if isinstance(t, Mixed)), None)
        if broken is not None:
            return broken
        found = {t for t in tags if t is not FREE}
        if not found:
            return FREE
        return next((t for t in tags if t not in (FREE, Rows(0, 1))), Rows(0, 1))

    def output_tag(self, tags):
        tag = self.input_tag(tags)
        return tag if tag in (FREE, Rows(0, 1)) or isinstance(tag, Mixed) else Mixed(
            self.layer.name, type(self.layer).__name__, "runs on a tensor whose first axis is "
            "not the batch")


_VERDICTS = weakref.WeakKeyDictionary()


def check_traced(model, x, variables, recorder_class):
    """In eager mode: traces the recorded forward pass of `model` on inputs
    shaped like `x` (batch size unknown) and checks it, once per signature.

    Raises:
        UnsupportedModelError: as `Analysis.check`, or for a layer on inputs
            that hold no example (its gradient is split in a traced step only).
    """
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), x)
    key = (repr(specs), tuple(id(v) for v in variables))
    verdicts = _VERDICTS.setdefault(model, {})
    if key not in verdicts:
        def forward(x):
            recorder = recorder_class(variables, None)
            with tf.GradientTape() as tape:
                with recorder.patched(model, tape, x):
                    y_pred = model(x, training=True)
            free = recorder.check_rows(y_pred)
            if free:
                raise UnsupportedModelError(recorder.analysis.rows_message(
                    recorder.calls[min(free)].layer, "it holds no example, which ghost "
                    "clipping splits per example in a traced step only (run_eagerly=False)"))

        try:
            tf.function(forward, autograph=False).get_concrete_function(specs)
            verdicts[key] = None
        except UnsupportedModelError as error:
            verdicts[key] = error.with_traceback(None)  # Kept without the trace's frames.
    if verdicts[key] is not None:
        raise verdicts[key]


def has_rule(op_type):
    """Whether the allowlist has a rule for ops of `op_type` (for other
    readers of traced functions: `keras_dp.data.batch_maps`)."""
    return op_type in LIST_RULES or op_type in rowops.RULES
