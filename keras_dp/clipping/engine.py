"""The clipping engine of a private model's step: which one, and running it.

A private model's `clipping_engine` is "auto" (default), "ghost" or
"vectorized". "auto" picks ghost clipping (`ghost`) when each example is its
own microbatch and every trainable layer has a norm function, else the
vectorized engine (`vectorized`); both are exact, so the choice changes
speed and memory, never the clipped sum. The engines take a batch as a dict
(`as_batch`), bound each example as the step's `bounds.Bound` says, and return
the same `bounds.ClippedSum`.

User-level privacy (`rows_per_unit=k > 1`): rows `[i*k, (i+1)*k)` of the
batch are the rows of one unit (a user). The unit's gradient is the SUM of
its rows' gradients (each row's loss as with one example per microbatch,
sample weight included), bounded once, so removing the unit moves the
clipped sum by at most the bound, whatever its k rows hold. A sum, not a
mean: a row of weight 0 (padding a user with fewer than k rows) then
changes nothing, and a user's weight does not depend on how many rows it
brought. A unit whose rows all have weight 0 contributes nothing and is not
counted. The ghost engine gets a unit's norm from the concatenation of its
rows (`contributions.per_unit`), the vectorized engine runs the unit as one
microbatch of k rows and differentiates the sum of their losses. There, a
layer that mixes the rows of a call (a batch mean) sees the unit's rows
together, its padding rows as copies of its first real row:
the unit's gradient is then not the sum of its rows' separate gradients,
but it still depends on that unit's rows alone, so the bound holds.
"""

import contextlib
import dataclasses
import functools
import numbers
import threading
import weakref

import tensorflow as tf
from tensorflow.python.framework.errors_impl import InaccessibleTensorError
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask

from keras_dp import distribute
from keras_dp.clipping import batchstate
from keras_dp.clipping import ghost
from keras_dp.clipping import rowstate
from keras_dp.clipping import vectorized
from keras_dp.clipping.layers import recurrent
from keras_dp.clipping.losses import real_rows
from keras_dp.clipping.onednn import first_op_without_xla_kernel

ENGINES = ("auto", "ghost", "vectorized")


def check_engine(engine):
    """Refuses a `clipping_engine` other than those of `ENGINES`.

    Args:
        engine: the value given for `clipping_engine`.

    Raises:
        ValueError: for any other value.
    """
    if engine not in ENGINES:
        raise ValueError(f'clipping_engine must be "auto", "ghost" or "vectorized"; '
                         f"received {engine!r}.")


def uses_ghost(model):
    """Whether `model`'s step clips with the ghost engine.

    Args:
        model: a private model, compiled with a DP optimizer.

    Returns:
        True for "ghost", and for "auto" when `ghost.supports(model)` with
        one microbatch per example; False otherwise.

    Raises:
        ValueError: for `clipping_engine="ghost"` on a model it does not cover.
    """
    engine = model.clipping_engine
    if engine == "vectorized":
        return False
    per_example = model.optimizer.dp_settings.num_microbatches is None
    if engine == "ghost" and not per_example:
        raise ValueError(
            'clipping_engine="ghost" clips each example, so it needs num_microbatches=None '
            "(microbatches of several examples are clipped by the vectorized engine): "
            'drop num_microbatches, or use clipping_engine="auto".')
    if engine == "ghost" and not ghost.supports(model):
        raise ValueError(
            'clipping_engine="ghost" needs num_microbatches=None and a norm '
            "function for every trainable layer; missing for: "
            f"{ghost.unsupported_layers(model)}. Register one with "
            'keras_dp.register_norm_function, or use clipping_engine="auto".')
    return per_example and ghost.supports(model)


def with_unknown_rows(data):
    """`data` (tensors with a batch axis first) with that axis's length
    unknown while tracing, as fit's Poisson batches have it: Python in the
    step (a layer's call, a loss) can never read the batch size as a number.
    Each example added to a batch changes it, and a layer branching on
    `x.shape[0]` would change every example's output (a sign flipped at an
    odd batch size: 16 C under ghost at train_on_batch); as a tensor, the
    analysis of the traced pass reads any use of it as a value."""
    def unknown_rows(tensor):
        if not isinstance(tensor, tf.Tensor) or not tensor.shape.rank:
            return tensor
        return tf.compat.v1.placeholder_with_default(tensor, [None, *tensor.shape[1:]])
    return tf.nest.map_structure(unknown_rows, data)


def as_batch(x, y, sample_weight):
    """The engines' batch: a dict of `x`, `y` and, if given, `sample_weight`."""
    batch = {"x": x, "y": y}
    if sample_weight is not None:
        batch["sample_weight"] = sample_weight
    return batch


def clipped_gradient_sum(model, batch, num_microbatches, variables, l2_norm_clip,
                         report=None, rows_per_unit=1):
    """Runs `model`'s engine (see `uses_ghost`) on one replica's batch.

    Args:
        model: a private model, compiled with a DP optimizer.
        batch: the batch, as made by `as_batch`.
        num_microbatches: scalar int tensor; the batch size when each example
            is its own microbatch. With `rows_per_unit > 1`, None or the
            number of units (batch size / `rows_per_unit`).
        variables: the trainable variables to differentiate.
        l2_norm_clip: C of the step (a float32 tensor: the one its mechanism
            fixed), or its `keras_dp.clipping.bounds.Bound` (per-layer
            clipping, normalization).
        report: optional `report(engine, reason)`, called once per trace with
            the engine that runs ("ghost" or "vectorized") and, when "auto"
            did not use ghost clipping, why (else None).
        rows_per_unit: k, a Python int: each k consecutive rows are one unit
            (a user), whose summed gradient is bounded once (see the module
            docstring). 1: each row is an example.

    Returns:
        A `keras_dp.clipping.bounds.ClippedSum`: the clipped sums (one per
        variable), the per-microbatch (per-unit) losses, the model's outputs,
        how many microbatches (units) had a non-finite gradient (they
        contributed zero) and the centered count of those within their bound
        (for adaptive clipping).

    Raises:
        ValueError: for a `rows_per_unit` that is not a positive int, or a
            batch whose static size it does not divide; for a step that may
            keep values of the batch beyond it (`refuse_batch_writes`); for a
            variable of half precision (`_refuse_half_precision`); for a
            batch holding a sparse or ragged tensor (`_refuse_composite_inputs`).
    """
    _refuse_half_precision(variables)
    _refuse_composite_inputs(batch)
    if tf.executing_eagerly():
        return _checked_eager_step(model, batch, num_microbatches, variables, l2_norm_clip,
                                   report, rows_per_unit)
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    result = _run_engine(model, batch, num_microbatches, variables, l2_norm_clip, report,
                         rows_per_unit)
    ops = graph.get_operations()[first:]
    refuse_batch_writes(ops, tf.nest.flatten(batch), tf.nest.flatten(result), model)
    _refuse_ops_xla_cannot_compile(ops)
    return result


def _refuse_half_precision(variables):
    """Refuses trainable variables of float16 or bfloat16: each example's
    norm, its bound and the clipped sum need the precision of float32 (review
    round 53: squared entries below 1.7e-4 underflowed to 0 in float16, so a
    gradient of 10 C was not clipped; a sum rounded to float16 moves by more
    than C). A mixed precision policy keeps the variables in float32."""
    half = sorted({v.path for v in variables if v.dtype in ("float16", "bfloat16")})
    if half:
        raise ValueError(
            f"Trainable variables {half} are float16 or bfloat16, too coarse to bound "
            "each example's gradient and its sum exactly. Keep the variables in float32: "
            "build the layers with dtype='float32', or use a mixed precision policy "
            "(keras.mixed_precision.set_global_policy('mixed_float16')), which computes "
            "in half precision but keeps the weights in float32.")


def _refuse_composite_inputs(batch):
    """Refuses a batch holding a `tf.SparseTensor` or `tf.RaggedTensor`:
    neither engine follows an example's row through their ops, so it could
    not bound what each row adds (they failed with an AttributeError or a
    TypeError before)."""
    for tensor in tf.nest.flatten(batch):
        if isinstance(tensor, (tf.SparseTensor, tf.RaggedTensor)):
            raise ValueError(
                f"The batch holds a {type(tensor).__name__}, whose rows keras-dp cannot clip "
                "one by one. Make it dense before the step: ragged rows padded to one "
                "length (TextVectorization(output_sequence_length=...), "
                "ragged.to_tensor(shape=[None, length])), sparse ones with "
                "tf.sparse.to_dense; and build the model's inputs dense.")


def refuse_batch_writes(ops, batch, outputs, model):
    """Refuses a step whose forward or backward pass (`ops`, of the traced
    step, giving `outputs`) may keep values computed from `batch` (its
    tensors) beyond the step: in a variable (named in the error when it is
    `model`'s), a table, a file, a printout or a Python function
    (`keras_dp.clipping.batchstate`).

    What it keeps is neither clipped nor noised: saved, it would release
    training examples outside the guarantee, and a later step reading it
    would let one example move the gradients of others. The step is refused
    while it is traced, before it runs, whatever calls it (fit,
    train_on_batch or a custom loop). Only the losses Keras' loss function
    tracks per output for the logs, which are not saved and are not private
    (docs/security.md), may be written, and no metric of the logs read.

    Raises:
        ValueError: naming the op (whose name holds its layer's) and the variable.
    """
    _refuse_log_metrics_in_step(ops, outputs, model)
    writable = set(_handles_of(_compile_loss_metric_variables(model)))
    chain = _first_keeper_outside(batchstate.keepers(ops, batch), writable)
    if chain is not None:
        handles = _kept_handles(chain)
        paths = dict(zip(_handles_of(model.variables), (v.path for v in model.variables)))
        kept = next((paths[id(h)] for h in handles if h is not None and id(h) in paths), None)
        op = chain[-1]
        raise ValueError(
            f"{op.name} ({op.type}) may keep values computed from the batch beyond the "
            f"private step{f', in the variable {kept}' if kept else ''}. Nothing clips or "
            "noises what it keeps, so it would release training examples outside the "
            "guarantee, and a later step reading it would let one example move other "
            "examples' gradients. Compute such state outside training (before fit, e.g. "
            "with keras_dp.adapt), or update it only when training is False."
            f"{_RANDOM_HINT if op.type in batchstate.STATEFUL_RANDOM else ''}")


def _refuse_ops_xla_cannot_compile(ops):
    """Refuses a step whose function compiled by XLA (the vectorized
    engine's per-example pass on CPUs with oneDNN) runs an op XLA has no
    kernel for (Keras' RandomRotation), before TensorFlow's own error at the
    first step (a new user's train_on_batch). After the batch-writes check,
    whose refusal says more of the ops that keep what they are given."""
    for call in ops:
        if call.type not in rowstate.CALLS or not call.node_def.attr[
                "_XlaMustCompile"].b:
            continue
        found = first_op_without_xla_kernel(
            op for inner, _ in rowstate.function_graphs(call) or ()
            for op in rowstate.operations_within(inner))
        if found is not None:
            raise ValueError(
                f"The per-example pass runs {found.type} ({found.name}), which XLA cannot "
                "compile, and on this CPU (oneDNN on) the vectorized engine compiles the "
                "pass with XLA (TensorFlow 2.21's oneDNN batch matmul corrupts per-example "
                "passes). Nothing was updated. Fit on arrays or on "
                "keras_dp.data.poisson_dataset, where clipping_engine=\"auto\" runs ghost "
                "clipping if the model allows it; or set TF_ENABLE_ONEDNN_OPTS=0 before "
                "TensorFlow is imported; or move the layer into the tf.data pipeline.")


# What the refusal of a stateful random op adds (docs/errors.md lists it).
_RANDOM_HINT = (" A stateful random op's generator advances by what it draws: draw with "
                "keras.random and a keras.random.SeedGenerator (stateless), as Keras' "
                "layers do.")


# Reads of whether a variable exists, or its shape, not of its value.
_METADATA_READS = frozenset(["VarIsInitializedOp", "VariableShape"])


def _refuse_log_metrics_in_step(ops, outputs, model):
    """Refuses a step (`ops`, giving `outputs`) that uses the metric
    variables of Keras' training logs otherwise than Keras' loss function
    updating the losses it tracks per output: the logs hold un-noised values
    of earlier batches. A value read from them may flow only into writes of
    those losses, never into `outputs` (the clipped sums, losses and
    predictions) nor anywhere else."""
    logs = _trainer_metric_variables(model)
    paths = dict(zip(_handles_of(logs), (v.path for v in logs)))
    writable = set(_handles_of(_compile_loss_metric_variables(model)))
    for chain in batchstate.resource_users(ops):
        op = chain[-1]
        if op.type in _METADATA_READS:
            continue
        handles = _kept_handles(chain)
        if None in handles:
            _refuse_unknown_variable(op)
        used = [h for h in handles if id(h) in paths]
        if not used:
            continue
        if any(id(h) not in writable for h in used):
            _refuse_log_metric(op, paths[id(used[0])])
        if op.type in rowstate.READS:
            _refuse_flow_of_log_read(chain, outputs, writable)


def _refuse_flow_of_log_read(chain, outputs, writable):
    """Refuses a read of a log metric (`chain[-1]`, in the step or in a
    function it calls) whose value reaches the step's `outputs` (or its
    function's outputs) or a write of anything but the `writable` losses."""
    read = chain[-1]
    targets = outputs if len(chain) == 1 else read.graph.outputs
    flow = batchstate.DataFlow(read.outputs)
    if any(flow.depends(t) for t in targets):
        _refuse_log_metric(read, "a metric")
    inner = _first_keeper_outside(
        (chain[:-1] + found for found in batchstate.keepers(read.graph.get_operations(),
                                                            read.outputs)), writable)
    if inner is not None:
        _refuse_log_metric(inner[-1], "a metric")


def _refuse_unknown_variable(op):
    """Refuses an op using a variable (or table) whose handle the step makes
    itself (looked up by a shared name): nothing shows which one it is, one
    of the training logs among them."""
    raise ValueError(
        f"{op.name} ({op.type}) uses a variable or table that the private step looks up "
        "itself (by its shared name), so nothing shows whether it holds values of earlier "
        "batches or keeps this one's. Create the variable outside the step (in the "
        "layer's build()) and use it there.")


def _refuse_log_metric(op, path):
    raise ValueError(
        f"{op.name} ({op.type}) uses {path} of the training logs inside the private "
        "step otherwise than Keras' loss function does. The logs hold un-noised values of "
        "earlier batches: a step that reads them, or writes them from the batch, would let "
        "those examples move its gradients or keep values of this batch. Read the logs in a "
        "callback, outside the step.")


def _trainer_metric_variables(model):
    """The variables of the loss trackers and compiled metrics of `model`'s
    trainer (Keras' own, for the logs), but any that is also the model's or
    its optimizer's: a metric holding a weight (as an attribute, or in the
    `variables` it reports) would make the weight writable from the batch."""
    trackers = [getattr(model, "_loss_tracker", None), getattr(model, "_compile_metrics", None)]
    logs = [v for tracker in trackers if tracker is not None
            for v in tracker.variables] + _compile_loss_metric_variables(model)
    optimizer = getattr(model, "optimizer", None)
    owned = set(_handles_of(list(model.variables) + list(
        getattr(optimizer, "variables", []) if not isinstance(optimizer, str) else [])))
    return [v for v, handle in zip(logs, _handles_of(logs)) if handle not in owned]


def _compile_loss_metric_variables(model):
    """The variables of the losses Keras' loss function tracks per output,
    which it updates inside the step (a model of several outputs)."""
    metrics = getattr(getattr(model, "_compile_loss", None), "metrics", [])
    return [v for metric in metrics for v in metric.variables]


def _handles_of(variables):
    """The ids of the handles of Keras `variables` (-1 where there is none)."""
    return [id(v.value.handle) if hasattr(v.value, "handle") else -1 for v in variables]


def _first_keeper_outside(chains, allowed):
    """The first of `chains` (`batchstate.keepers`) whose keeper takes a
    handle that is not one of the variables whose handle ids are `allowed`
    (or takes none: a Python function, a file), or None."""
    for chain in chains:
        handles = _kept_handles(chain)
        if not handles or not all(h is not None and id(h) in allowed for h in handles):
            return chain
    return None


def _kept_handles(chain):
    """The handles the keeper `chain[-1]` takes, each followed out through the
    functions of `chain` and the captures of the enclosing ones (None for
    one that cannot be followed out)."""
    handles = []
    for tensor in chain[-1].inputs:
        if tensor.dtype != tf.resource:
            continue
        handle = rowstate.aliases(tensor)[0]
        for parent in reversed(chain[:-1]):
            index = next((i for i, t in enumerate(handle.graph.inputs) if t is handle), None)
            if index is None:
                handle = None
                break
            offset = 1 if parent.type in rowstate.BRANCHES else 0
            handle = rowstate.aliases(parent.inputs[index + offset])[0]
        while handle is not None and getattr(handle, "graph", None) is not None:
            captured = {internal.ref(): external for external, internal in handle.graph.captures}
            handle = captured.get(handle.ref())
        handles.append(handle)
    return handles


def rows_agree(batch_size, data):
    """Whether every leaf of `data` has `batch_size` rows (a bool tensor): a
    leaf of fewer would be broadcast over the examples, read with shapes
    unknown while tracing as rows of its own (review round 15: a second input
    of one row added to every example, 8 C)."""
    agree = tf.constant(True)
    for leaf in (leaf for leaf in tf.nest.flatten(data) if leaf is not None):
        if leaf.shape.rank == 0:
            return tf.constant(False)
        rows = leaf.nrows() if isinstance(leaf, tf.RaggedTensor) else tf.shape(leaf)[0]
        agree = tf.logical_and(agree, tf.equal(tf.cast(rows, batch_size.dtype), batch_size))
    return agree


def checked_step(model, step, data):
    """`step(data)`, `model`'s private train step, refused while traced if
    the batch may reach anything kept beyond the step otherwise than through
    what the step releases privatized (`refuse_batch_beyond_release`), or a
    value of the training logs' metrics anything but the logs
    (`refuse_log_values_beyond_logs`). Called eagerly, the step is traced on
    `data` and the traced function runs (`_run_checked_trace`): every check
    reads a trace, and the Python runs once, while tracing.

    Args:
        model: the private model.
        step: `step(data)` returns the step's logs; what it releases
            privatized goes through `released`.
        data: the step's batch.

    Returns:
        The step's logs.
    """
    if tf.executing_eagerly():
        return _run_checked_trace(lambda data: checked_step(model, step, data), (data,),
                                  lambda graph, inputs: None)
    _check_batch_handed_on(data)
    data = with_unknown_rows(data)  # Before any Python of the step, an override's too.
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    with _logs_hidden_while_traced(model):
        try:
            logs = step(data)
        except InaccessibleTensorError as error:
            # The per-example pass is a function of its own (`vectorized`).
            raise ValueError(
                "A tensor of the per-example pass, kept in a Python attribute, is read "
                "outside it: it may keep a value computed from the batch beyond the private "
                "step otherwise than through its noised clipped sum. Nothing clips or noises "
                "it. Compute such values inside the layer, from its own inputs, or outside "
                f"training. ({str(error).splitlines()[0]})") from error
    ops = graph.get_operations()[first:]
    refuse_batch_beyond_release(ops, _leaves(data), _RELEASED.get(graph, ()), model)
    refuse_log_values_beyond_logs(ops, model)
    return logs


def checked_override(train_step):
    """A private model subclass's own `train_step`, read as a whole as the
    private step is (`checked_step`): what it does before or after
    `super().train_step(data)` is checked too (review round 10: a running
    label sum added to a bias after it moved the bias by 320 C), and it must
    hand keras-dp's step the tensors of the batch it was given
    (`_check_batch_handed_on`). Converted by AutoGraph, as Keras' train
    function converts a train_step. Idempotent.

    Args:
        train_step: `train_step(model, data)`.

    Returns:
        The checked `train_step(model, data)`.
    """
    if is_checked_override(train_step):
        return train_step
    try:
        converted = tf.autograph.to_graph(train_step)
    except Exception:  # noqa: BLE001  No source to convert: run it as written, as Keras does.
        converted = train_step

    @functools.wraps(train_step)
    @tf.autograph.experimental.do_not_convert
    def train_step_checked(model, data):
        def step(data):
            _HANDED_ON.batches.append(_HandedOn(_leaves(data)))
            try:
                return converted(model, data)
            finally:
                _HANDED_ON.batches.pop()

        return checked_step(model, step, data)

    _CHECKED_OVERRIDES.add(train_step_checked)
    return train_step_checked


def is_checked_override(train_step):
    """Whether `train_step` is what `checked_override` returned."""
    return train_step in _CHECKED_OVERRIDES


# The functions `checked_override` made: a class's step is wrapped once.
_CHECKED_OVERRIDES = set()


@dataclasses.dataclass
class _HandedOn:
    """A batch an override being traced was given, and how many steps it
    handed it on to."""

    leaves: list
    steps: int = 0


class _BatchesHandedOn(threading.local):
    """The batches the overrides being traced were given, innermost last."""

    def __init__(self):
        super().__init__()
        self.batches = []


_HANDED_ON = _BatchesHandedOn()


def _leaves(data):
    return [t for t in tf.nest.flatten(data, expand_composites=True) if t is not None]


def _check_batch_handed_on(data):
    """Refuses a step whose batch is not made of tensors of the batch the
    override calling it was given: one that concatenated, scaled or mixed
    its rows (review round 11: `y + mean(y)` before super().train_step moved
    the clipped sum by B C, recorded C) would be clipped as the examples."""
    if not _HANDED_ON.batches:
        return
    handed_on = _HANDED_ON.batches[-1]
    handed_on.steps += 1
    if handed_on.steps > 1:
        raise ValueError(
            "A train_step override called super().train_step more than once on its batch: "
            "each call is recorded as a step of its own, but they share one sample, so "
            "the ledger would report less than what ran (review round 12: 7.90 reported, "
            "12.03 true). Call super().train_step(data) once per train_step; for more "
            "steps, train on more batches.")
    given = {id(t) for t in handed_on.leaves}
    if any(id(t) not in given for t in _leaves(data)):
        raise ValueError(
            "A train_step override handed super().train_step a batch other than the one "
            "it was given: keras-dp clips each row of what it receives as one example, so "
            "rows computed from several examples (a concatenation, a batch mean) would "
            "move the noised sum by more than l2_norm_clip. Pass super().train_step(data) "
            "the data your train_step received (unpacked and packed again is fine); "
            "transform each example in the model's call() or in the dataset before "
            ".batch().")


def released(tensors):
    """`tensors` (a structure), each through an identity of its own: the
    step releases them privatized (the clipped sums, noised once; adaptive
    clipping's count, noised; the batch's size, which the accounting treats
    as public), so `refuse_batch_beyond_release` follows the batch no
    further through them.

    Returns:
        The copies, in `tensors`' structure.
    """
    copies = tf.nest.map_structure(tf.identity, tensors)
    _RELEASED.setdefault(tf.compat.v1.get_default_graph(), set()).update(
        t.op for t in tf.nest.flatten(copies))
    return copies


# The released ops of each graph being traced, every replica's: under a
# MirroredStrategy the replicas' steps are traced side by side in one graph
# and share its sum, whose parts each replica's check must pass. Trace-time
# bookkeeping only (dropped with its graph), never a record of what ran.
_RELEASED = weakref.WeakKeyDictionary()


def refuse_batch_beyond_release(ops, batch, released_ops, model):
    """Refuses a step (`ops`, from `batch`) in which a value of the batch
    may reach anything kept beyond it (a weight's update, the ledger, a
    layer's state, a file) otherwise than through the outputs of
    `released_ops` (`released`): a Python attribute holding a tensor of the
    forward pass, read by a weight's constraint or a learning rate, adds the
    batch to the weights un-noised, and a compiled Metric's `update_state`
    writing a layer's weight keeps the batch in it. Writes of the training
    logs' metrics, and the sums over replicas, keep nothing of it beyond
    the logs."""
    allowed = set(_handles_of(_trainer_metric_variables(model)))
    chain = _first_keeper_outside(
        (chain for chain in batchstate.keepers(ops, batch, released_ops)
         if chain[-1].type not in batchstate.COLLECTIVES), allowed)
    if chain is not None:
        op = chain[-1]
        raise ValueError(
            f"{op.name} ({op.type}) may keep a value computed from the batch beyond the "
            "private step otherwise than through its noised clipped sum (a tensor of the "
            "forward pass or the metrics kept in a Python attribute and read by a weight's "
            "constraint, a learning rate or the optimizer). Nothing clips or noises it. "
            "Compute such values inside the layer, from its own inputs, or outside "
            "training.")


@contextlib.contextmanager
def _logs_hidden_while_traced(model):
    """The training logs' metrics hold zeros while the step is traced, their
    values put back after: Python run by the trace that reads them eagerly
    (`tf.init_scope`, `.numpy()`) would bake un-noised values of earlier
    batches into the step as constants, which no op of the graph shows.
    Under a tf.distribute strategy each replica holds its own part of them;
    there they are not hidden (docs/security.md)."""
    if tf.distribute.has_strategy():
        yield
        return
    variables = _trainer_metric_variables(model)
    with tf.init_scope():
        values = [v.numpy() for v in variables]
        for v in variables:
            v.assign(tf.zeros(v.shape, v.dtype))
    try:
        yield
    finally:
        with tf.init_scope():
            for v, value in zip(variables, values):
                v.assign(value)


def refuse_log_values_beyond_logs(ops, model):
    """Refuses a step (`ops`) in which a value read from the training logs'
    metrics (un-noised values of earlier batches) may reach anything kept
    beyond the step but those metrics: a weight's update through a
    regularizer or a learning rate, a layer's state, a file. The reads in
    the step's own graph are followed together, through its ops; one inside
    a function may reach neither its outputs nor a keeper of that function."""
    allowed = set(_handles_of(_trainer_metric_variables(model)))
    reads = [chain for chain in batchstate.resource_users(ops)
             if chain[-1].type in rowstate.READS
             and allowed & {id(h) for h in _kept_handles(chain) if h is not None}]
    for chain in (c for c in reads if len(c) > 1):
        read = chain[-1]
        inner = _first_keeper_outside(
            (chain[:-1] + found for found in batchstate.keepers(read.graph.get_operations(),
                                                                read.outputs)), allowed)
        if inner is not None or any(batchstate.DataFlow(read.outputs).depends(t)
                                    for t in read.graph.outputs):
            _refuse_kept_log_value((inner or chain)[-1], read)
    top = [chain[-1] for chain in reads if len(chain) == 1]
    kept = _first_keeper_outside(
        batchstate.keepers(ops, [t for read in top for t in read.outputs]), allowed)
    if kept is not None:
        _refuse_kept_log_value(kept[-1], next(
            read for read in top if _first_keeper_outside(
                batchstate.keepers(ops, read.outputs), allowed) is not None))


def _refuse_kept_log_value(keeper, read):
    raise ValueError(
        f"{keeper.name} ({keeper.type}) may keep a value read ({read.name}) from the "
        "metrics of the training logs, which hold un-noised values of earlier batches, "
        "beyond the private step: in a weight's update (a regularizer, a learning rate), "
        "a layer's state or a file. Read the logs in a callback, outside the step, and "
        "only for decisions stated outside the guarantee.")


def _checked_eager_step(model, batch, num_microbatches, variables, l2_norm_clip, report,
                        rows_per_unit):
    """An eager step as the traced step is checked: the step (forward pass,
    loss and backward pass) is traced on the batch, `refuse_batch_writes`
    reads the trace, and the traced function runs, not the Python again,
    which could do otherwise on a second call."""
    def step(batch):
        return _run_engine(model, batch, num_microbatches, variables, l2_norm_clip, report,
                           rows_per_unit)

    return _run_checked_trace(step, (batch,), lambda graph, inputs: refuse_batch_writes(
        graph.get_operations(), inputs, graph.outputs, model))


def _run_checked_trace(fn, args, check):
    """`fn(*args)`, in an eager step, as the function traced on `args`:
    `check(graph, inputs)` reads the trace (`inputs`: its tensors for
    `args`), then the traced function runs, not the Python again, which
    could do otherwise on a second call."""
    specs = tf.nest.map_structure(
        lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype), args)
    traced = tf.function(fn, autograph=False).get_concrete_function(*specs)
    graph = traced.graph
    check(graph, graph.inputs[:len(graph.inputs) - len(graph.captures)])
    return traced(*args)


def _run_engine(model, batch, num_microbatches, variables, l2_norm_clip, report,
                rows_per_unit):
    report = report or (lambda engine, reason: None)
    reason = None
    rows_per_unit = _checked_rows_per_unit(rows_per_unit, batch["x"])
    if rows_per_unit > 1:
        num_microbatches = tf.shape(tf.nest.flatten(batch["x"])[0])[0] // rows_per_unit
    if uses_ghost(model):
        try:
            result = ghost.clipped_gradient_sum(
                model, batch, variables, l2_norm_clip,
                distribute.unscaled_loss_fn(ghost.per_example_loss_fn(model)),
                rows_per_unit=rows_per_unit)
            report("ghost", None)
            return result
        except ghost.UnsupportedModelError as error:
            # add_loss() terms, stray weight reads and ops mixing the rows of a
            # batch (`independence`, which reads the traced forward pass) only
            # show while tracing; "auto" then falls back within the same trace.
            if model.clipping_engine == "ghost":
                raise
            if recurrent.recurrent_layers(model):
                raise ghost.UnsupportedModelError(
                    f"{error} The vectorized engine cannot take over: TF 2.21's "
                    "vectorized_map cannot batch the while loop of the recurrent layers "
                    f"{[layer.name for layer in recurrent.recurrent_layers(model)]}, so "
                    "remove the cause above.") from error
            reason = str(error)
    elif model.clipping_engine == "auto":
        reason = _why_not_ghost(model)
    report("vectorized", reason)
    loss_fn = _microbatch_loss_fn(model) if rows_per_unit == 1 else _unit_loss_fn(model)
    return vectorized.clipped_gradient_sum(
        loss_fn, variables, batch, num_microbatches, l2_norm_clip)


def _checked_rows_per_unit(rows_per_unit, x):
    """`rows_per_unit` as an int; refuses one that is not a positive integer,
    or that does not divide the batch's static size."""
    if (isinstance(rows_per_unit, bool) or not isinstance(rows_per_unit, numbers.Integral)
            or rows_per_unit < 1):
        raise ValueError(f"rows_per_unit must be a positive Python int (the rows of one "
                         f"user in a batch); received {rows_per_unit!r}.")
    rows = tf.nest.flatten(x)[0].shape[0]
    if rows is not None and rows % rows_per_unit:
        raise ValueError(
            f"A batch of {rows} rows cannot be split into units of rows_per_unit="
            f"{rows_per_unit} rows. Give each user exactly {rows_per_unit} rows per batch, "
            "padding a user with fewer rows with rows of sample weight 0.")
    return int(rows_per_unit)


def _why_not_ghost(model):
    if model.optimizer.dp_settings.num_microbatches is not None:
        return "num_microbatches is set (microbatches of several examples)"
    return "; ".join(ghost.unsupported_layers(model))


def _microbatch_loss_fn(model):
    """The vectorized engine's loss function for `model`.

    Returns:
        A function of one microbatch returning `(loss, y_pred)`: its compiled
        loss plus its add_loss() terms, and the model's outputs.
    """
    compile_loss = distribute.unscaled_loss_fn(model._compile_loss)

    def microbatch_loss(microbatch):
        real = real_rows(microbatch)
        y_pred = _outputs_without_padding(model, microbatch["x"], real)
        if real is not None:
            y_pred = _masking_padding(y_pred, real)
        loss = compile_loss(_labels_without_padding(microbatch, real), y_pred,
                            microbatch.get("sample_weight"))
        # add_loss() terms (e.g. activity regularizers) depend on this
        # microbatch only, so they belong to its clipped loss. (They ignore
        # sample weights; a microbatch of padding alone has loss 0 in the
        # vectorized engine.)
        data_losses = [l for layer in model._flatten_layers()
                       for l in layer._get_own_losses()]
        if data_losses:
            loss = loss + tf.add_n(data_losses)
        return loss, y_pred

    return microbatch_loss


def _unit_loss_fn(model):
    """The vectorized engine's loss function for units of several rows.

    Returns:
        A function of one unit (its k rows) returning `(loss, y_pred)`: the
        SUM of its rows' losses, each the compiled loss of that row alone
        (`ghost.per_example_loss_fn`: sample weights, masks and loss weights
        as Keras applies them), and the model's outputs.

    Raises:
        ValueError: while tracing, for a model with add_loss() terms.
    """
    per_example_loss = distribute.unscaled_loss_fn(ghost.per_example_loss_fn(model))

    def unit_loss(unit):
        real = real_rows(unit)
        y_pred = _outputs_without_padding(model, unit["x"], real)
        if any(layer._get_own_losses() for layer in model._flatten_layers()):
            # Keras divides an activity regularizer by the rows it sees, so
            # on a unit it is not the sum of its rows' terms.
            raise ValueError(
                f"Model '{model.name}' adds add_loss() terms (e.g. an activity "
                "regularizer), which Keras computes over the rows of a call together: "
                "with several rows per user they are not the sum of the rows' own terms. "
                "Remove them (a kernel_regularizer is fine) to train with user-level "
                "privacy.")
        losses = per_example_loss(dict(unit, y=_labels_without_padding(unit, real)), y_pred)
        if real is not None:
            losses = tf.where(real, losses, tf.zeros([], losses.dtype))
        return tf.reduce_sum(losses), y_pred

    return unit_loss


def _outputs_without_padding(model, x, real):
    """The model's outputs on `x`, its padding rows replaced (see
    `_padding_as_a_real_row`) when `real` says which rows are real."""
    if real is not None:
        x = _padding_as_a_real_row(x, real)
    return model(x, training=True)


def _padding_as_a_real_row(x, real):
    """`x` with its padding rows replaced by its first real row.

    A padding row's forward pass may not be finite (a fully masked mean
    pooling is 0 / 0), and a NaN in one row of a microbatch poisons its
    whole gradient (0 * NaN in the weights' matmuls). On a copy of a real
    row it is finite, and its sample weight 0 removes it from the compiled
    loss exactly; add_loss() terms, which ignore sample weights, see the copy.
    A microbatch of padding alone keeps its rows (the engine zeroes it).

    Args:
        x: the microbatch's inputs (any structure, rows first).
        real: `[m]` bool, from `real_rows`.

    Returns:
        `x` with the rows where `real` is False replaced.
    """
    first = tf.argmax(tf.cast(real, tf.int32), output_type=tf.int32)

    def replaced(t):
        keep = tf.reshape(real, [-1] + [1] * (t.shape.rank - 1))
        return tf.where(keep, t, tf.gather(t, first)[None])

    return tf.nest.map_structure(replaced, x)


def _labels_without_padding(batch, real):
    """The labels of `batch` (a microbatch or unit), its padding rows' set
    to its first real row's: a padding row copies another example's label,
    and a label that is not finite (NaN), even at sample weight 0, made
    every microbatch's gradient NaN, so each was zeroed (review round 44: one
    example with a NaN label erased the whole clipped sum, 4 C at m = 4)."""
    labels = batch.get("y")
    if real is None or labels is None:
        return labels
    return _padding_as_a_real_row(labels, real)


def _masking_padding(y_pred, real):
    """`y_pred` whose Keras masks, if any, also mask the padding rows, so
    that a loss averaging over unmasked entries divides as it did before
    `_padding_as_a_real_row` (the padding's own mask is that of all-zero
    inputs: fully masked by mask_zero and Masking)."""
    def masked(t):
        mask = get_keras_mask(t)
        if mask is not None:
            rows = tf.reshape(real, [-1] + [1] * (mask.shape.rank - 1))
            set_keras_mask(t, tf.logical_and(mask, rows))
        return t

    return tf.nest.map_structure(masked, y_pred)
