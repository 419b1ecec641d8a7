"""Maps after `poisson_dataset`: kept only where each row stays its example's.

A map of a Poisson dataset is the user's function of each whole batch. The
batch keeps its Poisson accounting (one example moves the clipped sum by at
most C) only if the function keeps the examples apart:

* row i of every output depends on row i of the batch alone (and on values
  that depend on no example), with the batch on axis 0;
* the sample weights pass through unchanged (padding rows keep weight 0:
  with any other weight, a padding row, a copy of a real row, would count
  its example twice);
* nothing of the batch is left in state a later batch could read (a
  variable written from the batch, a Python function).

keras-dp reads the map's traced function with the allowlist of
`keras_dp.clipping.independence`, and a split of strings by
`keras_dp.data.ragged_text`: nothing is run, and an op it does not know
refuses the map. Per-example maps belong before sampling
(`poisson_dataset(dataset.map(f), ...)`), where any function is allowed.
"""

import tensorflow as tf
from keras.src.backend.common import global_state  # Keras' global SeedGenerator.
from keras.src.random import seed_generator

from keras_dp.clipping import independence
from keras_dp.clipping import rowseeds
from keras_dp.clipping import rowstate
from keras_dp.clipping.rowtags import FREE
from keras_dp.clipping.rowtags import Mixed
from keras_dp.clipping.rowtags import Rows
from keras_dp.data import ragged_text

# Stateful ops that keep nothing of the batch: checks that stop the
# pipeline (a lookup's error for an unknown value).
_KNOWN_EFFECTS = frozenset(["Assert", "NoOp"])
_FIX = ("Apply per-example maps before sampling: keras_dp.data.poisson_dataset("
        "dataset.map(f), expected_batch_size=...), where any function is allowed.")


def check_batch_map(dataset):
    """Refuses a map of Poisson batches that may not keep its examples apart.

    Args:
        dataset: a `tf.data.Dataset.map` of batches of (x, y, sample_weight),
            each leaf with the batch on axis 0.

    Raises:
        ValueError: naming the op that may combine rows, keep state or change
            the sample weights, and the fix.
    """
    problem = rows_problem(dataset) or _weights_problem(dataset)
    if problem:
        raise ValueError(f"A map after keras_dp.data.poisson_dataset {problem}, so its "
                         f"batches may no longer be Poisson samples. {_FIX}")


def rows_problem(dataset):
    """Why a map of batches may not give back row i from row i alone (one
    row per row, nothing kept for a later batch), in words; None if it does.

    Args:
        dataset: a `tf.data.Dataset.map` whose elements are batches.
    """
    graph = dataset._map_func.function.graph
    tags = _tags(graph)
    return (_unknown_effect(graph) or _state_written(graph, tags)
            or _outputs_problem(graph, tags) or _length_problem(dataset, tags))


def shared_state_problem(maps):
    """Why the maps (`tf.data.Dataset.map`s of one pipeline's batches) may
    pass state to each other, in words, or None: each map is read alone, so
    a variable one writes and another reads or writes is followed in
    neither (review round 121: a seed set back to a constant in one map and
    stepped before its draw in the next, signs fixed by position, 2.64 C)."""
    touched = [rowstate.variables_touched(m._map_func.function.graph) for m in maps]
    for index, ours in enumerate(touched):
        for other in touched[index + 1:]:
            if any(name in other and (written or other[name]) for name, written in ours.items()):
                return ("two of its maps share a variable that one of them writes (a "
                        "random seed, a counter): keras-dp reads each map alone")
    return None


def predicate_problem(dataset):
    """Why a filter of batches may keep or drop a batch by its values (one
    example would decide whether the others train: review round 15, B C),
    in words; None when its predicate depends on no example."""
    graph = dataset._predicate.function.graph
    tags = _tags(graph)
    problem = _unknown_effect(graph) or _state_written(graph, tags)
    if problem or tags.tag(graph.outputs[0]) is FREE:
        return problem
    return "depends on the values of the batch"


def state_problem(dataset):
    """Why a map or filter of single examples may leave values of one in a
    variable or table a later one reads (review round 15: a running sum
    gave each example the ones before it, 9 C), in words; or None."""
    function = getattr(dataset, "_map_func", None) or getattr(dataset, "_predicate", None)
    if function is None:
        return None
    graph = function.function.graph
    return _unknown_effect(graph, _KNOWN_EFFECTS_OF_EXAMPLE_MAPS) or _state_written(
        graph, _tags(graph))


def position_problem(graphs, readers=None):
    """Why the maps and filters of a pipeline's single examples (their
    traced `graphs`) may give an example a value of its position, or the
    `readers` (the maps of the batches made of them; by default `graphs`
    themselves) a count of the examples, in words, or None. A variable one
    of them writes, even by a constant step (a counter), holds how many
    elements came before; read into an output or a predicate, one added
    example changes it for every later one (review round 124: a sign by a
    counter's parity, 8 C moved; round 134: a map of the Poisson batches
    reading the count the examples' map left, 16 C). A read that only seeds
    a stateless draw (Keras' SeedGenerator) gives values as random as the
    seed's state: a state you fix is docs/security.md row g's statement."""
    written = {name for graph in graphs
               for name, writes in rowstate.variables_touched(graph).items() if writes}
    _WRITTEN_BY_EXAMPLE_MAPS.update(written)
    if written & _CAPTURED_BY_STEPS:
        # A step traced before this pipeline was built is not traced again
        # (review round 142: a second fit on a counting pipeline, 22 C).
        return ("writes a variable a private step already traced reads: a count of the "
                "examples, which one added example changes for every step")
    if written & _READ_BY_MAPS:
        return ("writes a variable a map of another pipeline reads: a count of the "
                "examples, which one added example changes for every element of that one")
    for graph in graphs if readers is None else readers:
        for handle in graph.inputs:
            found = None if handle.dtype != tf.resource else _read_into_outputs(handle)
            if found is None:
                continue
            name = rowstate.resource_name(handle)
            _READ_BY_MAPS.add(name)
            # Also another pipeline's: the count its maps left when keras-dp
            # read it (review round 143: 16 C).
            if name in _WRITTEN_BY_EXAMPLE_MAPS:
                whose = ("the pipeline's maps write" if name in written
                         else "the maps of another pipeline's examples write")
                return (f"reads a variable {whose} ({found.name}): a "
                        "count of the elements before, which one added example changes "
                        "for every later one")
    return None


def step_reads_problem(graph):
    """Why the private step's `graph` may read a variable the maps of a
    pipeline's examples write (a count of the examples: one added changes
    it for every step, review round 141, 17 C) other than as a random draw's
    seed, in words, or None. The variables are those of every pipeline of
    examples keras-dp read in this process (`position_problem`)."""
    names = {rowstate.resource_name(handle) for handle in graph.inputs
             if handle.dtype == tf.resource}
    # Keras' global SeedGenerator, which every unseeded keras.random call
    # steps (in a map and in a model alike), is read as a seed there.
    # (Read where Keras keeps it: made here, inside a trace, it would be a
    # variable of the step.)
    generator = global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
    seeds = None
    if generator is not None:
        with tf.init_scope():
            seeds = rowstate.variable_name(generator.state)
    _CAPTURED_BY_STEPS.update(names - {None, seeds})
    for handle in graph.inputs:
        if (handle.dtype == tf.resource
                and rowstate.resource_name(handle) in _WRITTEN_BY_EXAMPLE_MAPS):
            found = _read_into_outputs(handle)
            if found is not None:
                return (f"reads a variable a map of a pipeline's examples writes "
                        f"({found.name}): a count of the examples, which one added example "
                        "changes for every step")
    return None


# The resources the maps and filters of examples keras-dp read write (their
# names), which a private step may read only as a random draw's seed.
_WRITTEN_BY_EXAMPLE_MAPS = set()
# The resources the private steps traced in this process take (their names),
# which no map of examples built later may write.
_CAPTURED_BY_STEPS = set()
# The resources maps of pipelines keras-dp read read into their outputs
# (their names), which no map of examples built later may write.
_READ_BY_MAPS = set()


def _read_into_outputs(handle, depth=0, seeds=None):
    """The first op reading the variable `handle` holds whose values may
    reach its function's outputs, or any write but one back to the variable
    (review round 147: a count copied into a SeedGenerator's state, 15 C),
    other than, for a random generator's state (`seeds`, by default
    `rowseeds.is_generator_state`), as a draw's seed, or None."""
    seeds = rowseeds.is_generator_state(handle) if seeds is None else seeds
    own = {alias.ref() for alias in rowstate.aliases(handle)}
    for alias in rowstate.aliases(handle):
        for op in alias.consumers():
            if op.type in rowstate.CALLS or op.type in rowstate.LOOPS \
                    or op.type in rowstate.BRANCHES:
                found = _read_inside(op, alias, depth, seeds)
            elif (seeds and rowseeds.draws_from_state(op)) or not _reaches_outputs(
                    op, own, seeds):
                continue
            else:
                found = op
            if found is not None:
                return found
    return None


def _read_inside(op, handle, depth, seeds):
    """`_read_into_outputs` for the functions `op` runs, given `handle`."""
    inner = None if depth > 8 else rowstate.passed_into(op, handle)
    if inner is None or any(_read_into_outputs(argument, depth + 1, seeds) is not None
                            for argument in inner):
        return op
    return None


def _reaches_outputs(op, own, seeds):
    """Whether a value `op` gives may reach its graph's outputs, or an op
    without outputs other than a write back to the variable read (whose
    handles are `own`), through any op but (given `seeds`) a stateless draw
    taking it as its seed (a function, loop or conditional taking it counts
    as reaching them)."""
    outputs = {t.ref() for t in op.graph.outputs}
    work = [t for t in op.outputs if t.dtype != tf.resource]
    seen = set()
    while work:
        tensor = work.pop()
        if tensor.ref() in seen:
            continue
        seen.add(tensor.ref())
        if tensor.ref() in outputs:
            return True
        for consumer in tensor.consumers():
            indices = [i for i, t in enumerate(consumer.inputs) if t is tensor]
            # Unless the draw's seed is known at every draw (a generator's
            # counter entry alone: review round 167).
            if seeds and rowseeds.seeds_only(consumer, indices) and not rowseeds.fixed_seed(
                    consumer):
                continue
            if (consumer.type in rowstate.CALLS or consumer.type in rowstate.LOOPS
                    or consumer.type in rowstate.BRANCHES):
                return True
            given = [t for t in consumer.outputs if t.dtype != tf.resource]
            if not given and consumer.type != "NoOp" and not any(
                    t.ref() in own for t in consumer.inputs):
                return True
            work.extend(given)
    return False


# A map of single examples may also call Python (`tf.py_function`, keras-io's
# loaders): what the Python keeps is the user's statement (docs/security.md).
# Any other stateful op without a rule may keep an example for the next
# (review round 17: a running sum in a file written and read by the map, 17 C).
_KNOWN_EFFECTS_OF_EXAMPLE_MAPS = _KNOWN_EFFECTS | {"PyFunc", "EagerPyFunc"}


def _tags(graph):
    """The tags of a function of batches (or of examples) of the pipeline."""
    return independence.Tags(graph, [(t, Rows(0)) for t in _arguments(graph)], top=True,
                             more_rules=ragged_text.RULES)


def _arguments(graph):
    """The map function's inputs that are its arguments (its captures follow them)."""
    return graph.inputs[:len(graph.inputs) - len(graph.captures)]


def _unknown_effect(graph, known=_KNOWN_EFFECTS, depth=0):
    """The first op with effects beyond its outputs (in `graph` or a function
    it calls) that keras-dp does not know (`known` are), as words. Ops that
    lead to the outputs are read by their rules, ops taking a variable by
    `_state_written`; a stateless op that leads nowhere does nothing."""
    for op in graph.get_operations():
        if op.type in rowstate.CALLS or op.type in rowstate.LOOPS or op.type in rowstate.BRANCHES:
            inner = rowstate.function_graphs(op)
            if inner is None or depth > 8:
                return f"calls a function keras-dp cannot read ({op.name})"
            found = next(filter(None, (_unknown_effect(g, known, depth + 1) for g, _ in inner)),
                         None)
            if found:
                return found
        elif (op.op_def.is_stateful and op.type not in known
              and not independence.has_rule(op.type)
              and not any(t.dtype == tf.resource for t in op.inputs)):
            return f"runs {op.type} ({op.name}), which keras-dp does not know to keep rows apart"
    return None


def _state_written(graph, tags):
    """Why an op of `graph` may leave values of the batch in a variable (or a
    table) it captures, which a later batch reads, or None. State the
    function makes itself (a table or variable op, kept by its kernel across
    elements: review round 16, 16 C) is refused by `_unknown_effect`, which
    every caller runs first."""
    for handle in graph.inputs:
        if handle.dtype != tf.resource:
            continue
        for op in rowstate.writes_of(handle):
            if any(tags.tag(t) is not FREE for t in op.inputs if t.dtype != tf.resource):
                return f"writes values of the batch into a variable ({op.name})"
    return None


def _outputs_problem(graph, tags):
    """Why the outputs may not be the batch's rows, or None."""
    for output in graph.outputs:
        tag = tags.tag(output)
        if ragged_text.is_ragged_batch(tag):
            continue
        if isinstance(tag, Mixed):
            return f"runs {tag.op_type} ({tag.op_name}), which {tag.why}"
        if tag != Rows(0):
            return f"gives an output ({output.name}) whose axis 0 is not the batch's rows"
    return None


def _length_problem(dataset, tags):
    """Why the map may not keep its batches' number of rows, or None: a
    tensor of its rows whose batch axis has a length other than the one the
    dataset's batches have while tracing (a `set_shape`, an `ensure_shape`
    or a broadcast fixed it). The rules compare lengths as tracing shows
    them, which `set_shape` sets without an op (review round 119: a
    one-row batch claimed as two and broadcast into two rows, 2 C)."""
    lengths = {spec.shape[0] for spec in tf.nest.flatten(dataset._input_dataset.element_spec)
               if isinstance(spec, tf.TensorSpec) and spec.shape.rank} - {None}
    # The parts' rows agree (the step applies nothing otherwise): one known
    # length is the batch's (a Poisson batch laid out for microbatches has
    # 44 rows of x and y, and weights of a length unknown while tracing).
    given = lengths.pop() if len(lengths) == 1 else None
    for key, tag in list(tags.memo.items()):
        tensor = key.deref()
        if (type(tag) is Rows and tag.block == 1 and tensor.graph is tags.graph
                and tensor.shape.rank and tensor.shape[tag.axis] not in (None, given)):
            return (f"sets the length of the batch axis of {tensor.name} to "
                    f"{tensor.shape[tag.axis]} while its batches have {given or 'any number of'} "
                    "rows (set_shape, ensure_shape or a broadcast)")
    return None


def _weights_problem(dataset):
    """Why the sample weights may not pass through the map unchanged, or None."""
    graph = dataset._map_func.function.graph
    weights_in = _weights(_arguments(graph), dataset._input_dataset.element_spec)
    weights_out = _weights(graph.outputs, dataset.element_spec)
    if (weights_in is None or weights_out is None or len(weights_in) != len(weights_out)
            or any(_source(out) is not arg for out, arg in zip(weights_out, weights_in))):
        return "changes the sample weights (its padding rows have weight 0)"
    return None


def _weights(tensors, spec):
    """The last of `tensors`, those of the sample weights of (x, y, sample_weight)."""
    if not (isinstance(spec, tuple) and len(spec) == 3):
        return None
    count = len(tf.nest.flatten(spec[2]))
    return list(tensors[len(tensors) - count:])


def _source(tensor):
    """`tensor` before the identities that pass it on."""
    while tensor.op.type in ("Identity", "Snapshot"):
        tensor = tensor.op.inputs[0]
    return tensor
