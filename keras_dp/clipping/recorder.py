"""The recorded forward pass: layer calls routed through their norm functions.

During the ghost engine's one forward pass every layer with trainable
weights runs its norm function instead of `call` (recording what the
backward pass must reach), and every other layer runs under a guard tape
that catches reads of trainable weights no norm function accounts for.
"""

import contextlib
import threading

import keras
import tensorflow as tf

try:  # TensorFlow's watcher of variable reads (tf.custom_gradient's).
    from tensorflow.python.eager.record import VariableWatcher
except ImportError:  # Moved in a later TensorFlow: a tape sees the same reads.
    VariableWatcher = tf.GradientTape

from keras_dp.clipping.independence import Analysis
from keras_dp.clipping.registry import UnsupportedModelError
from keras_dp.clipping.registry import rule_for

# One patch of Keras objects at a time: layer calls here, compiled losses in
# `keras_dp.clipping.losses`.
PATCH_LOCK = threading.RLock()


def variable_key(variable):
    """Identity of a variable (a Keras variable and the tf.Variable it wraps agree)."""
    if isinstance(variable, keras.Variable):
        variable = variable._value
    return id(variable)


def own_trainable(layer, keys):
    """The trainable variables `layer` itself holds among those of `keys`."""
    return [v for v in getattr(layer, "_trainable_variables", []) if variable_key(v) in keys]


def routed_layers(model, keys):
    """The layers of `model`, outermost first, each with the norm function
    the recorded pass runs for it (None: it is only guarded).

    A layer's norm function covers the variables of `keys` that the layer or
    its sublayers hold (an RNN's weights are in its cell); those sublayers
    are left out, as the norm function stands for their calls too.
    """
    left_out = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if id(layer) in left_out:
            continue
        rule = rule_for(layer)
        inside = layer._flatten_layers(include_self=True, recursive=True)
        if rule is not None and any(own_trainable(l, keys) for l in inside):
            left_out.update(id(l) for l in inside)
            yield layer, rule
        else:
            yield layer, None


class _Call:
    def __init__(self, layer, watched, gradients_fn, reads):
        self.layer = layer
        self.watched = watched
        self.gradients_fn = gradients_fn
        self.reads = reads
        self.target = watched  # What the backward pass differentiates.

    def shaped(self, grad):
        """`grad` of `target` with its static shape (some gradients, a
        concatenation's slices, lose static dims when the batch size is
        unknown, as for bucketed Poisson batches; norm functions need them)."""
        return tf.nest.map_structure(lambda g, t: tf.ensure_shape(g, t.shape), grad, self.target)


_MISSING = object()


class Recorder:
    """Routes layer calls through norm functions during one forward pass."""

    def __init__(self, variables, batch_size=None):
        """`batch_size`: the static batch size of the forward pass (None if unknown)."""
        self.index = {variable_key(v): i for i, v in enumerate(variables)}
        self.batch_size = batch_size
        self.calls = []
        self.guards = []
        self.analysis = None
        self._active_guards = []
        self._tape = None

    @contextlib.contextmanager
    def patched(self, model, tape, x=None):
        """Within: `model`'s layers run through their norm functions or guards.

        With the model's inputs `x`, in a traced function, the forward pass
        is also analysed (`independence.Analysis`; see `check_rows`).
        """
        self._tape = tape
        if x is not None and not tf.executing_eagerly():
            self.analysis = Analysis(model, [t for t in tf.nest.flatten(x) if tf.is_tensor(t)],
                                     self.batch_size)
        patched = []
        with PATCH_LOCK:
            try:
                for layer, rule in routed_layers(model, self.index):
                    original = layer.call
                    wrapper = (self._rule_call(layer, rule) if rule is not None
                               else self._guarded_call(layer, original))
                    patched.append((layer, layer.__dict__.get("call", _MISSING)))
                    object.__setattr__(layer, "call", wrapper)
                yield
            finally:
                for layer, previous in reversed(patched):
                    if previous is _MISSING:
                        layer.__dict__.pop("call", None)
                    else:
                        object.__setattr__(layer, "call", previous)

    def _version(self):
        return self.analysis.last_id() if self.analysis is not None else None

    def _rule_call(self, layer, rule):
        def call(*args, **kwargs):
            start = self._version()
            # Recording from the inputs on makes every tensor the norm function
            # computes differentiable, also one that no trainable weight feeds.
            self._tape.watch([t for t in tf.nest.flatten((args, kwargs))
                              if tf.is_tensor(t) and t.dtype.is_floating])
            with contextlib.ExitStack() as paused:
                # Reads inside the norm function are accounted for by it.
                for guard in self._active_guards:
                    paused.enter_context(guard.stop_recording())
                # A watcher, not a second tape: an op on tensors two tapes watch
                # is a higher-order gradient case, for which TensorFlow builds a
                # while loop's gradient three times at trace time.
                with VariableWatcher() as reads:
                    outputs, watched, gradients_fn = rule(layer, args, kwargs)
            self._tape.watch(watched)
            record = _Call(layer, watched, gradients_fn, reads.watched_variables())
            record.rerun = (rule, args, kwargs)
            self.calls.append(record)
            if self.analysis is not None:
                span = (start, self._version())
                trusted = (_built_in(rule) and _calls_keras_activations(layer)
                           and _batch_is_not_last(outputs))
                self.analysis.call(layer, args, kwargs, outputs, trusted, span)
                self.analysis.span(layer, *span)
            return outputs
        return call

    def _guarded_call(self, layer, original):
        def call(*args, **kwargs):
            start = self._version()
            guard = tf.GradientTape()
            with guard:
                self._active_guards.append(guard)
                try:
                    outputs = original(*args, **kwargs)
                finally:
                    self._active_guards.pop()
            self.guards.append((layer, guard))
            if self.analysis is not None:
                self.analysis.span(layer, start, self._version())
            return outputs
        return call

    def check_rows(self, outputs):
        """After the forward pass: refuses it where ghost clipping would not be
        exact (`independence.Analysis.check`), and routes the calls on inputs
        that hold no example through their `Entry`s.

        Args:
            outputs: the model's outputs.

        Returns:
            {index of the call: its entries} for those calls (empty in eager
            mode, where `independence.check_traced` checks instead).
        """
        if self.analysis is None:
            return {}
        free = self.analysis.check(outputs)
        for index, entries in free.items():
            _route_through_entries(self.calls[index], entries)
        return free

    @contextlib.contextmanager
    def guarding_loss(self):
        """Catches a loss that reads trainable weights itself (a penalty on a
        kernel): the backward pass reaches only the recorded layers' outputs."""
        guard = tf.GradientTape()
        with guard:
            yield
        stray = self._stray_reads(guard)
        if stray:
            raise UnsupportedModelError(
                f"The loss reads trainable weights {stray} itself, which ghost "
                "clipping does not differentiate (it reaches the weights through the "
                "layers' outputs only). Put weight penalties in the layers' "
                "kernel_regularizer, or use the vectorized engine.")

    def _stray_reads(self, guard):
        return sorted({v.name for v in guard.watched_variables()
                       if variable_key(v) in self.index})

    def check_guards(self):
        for layer, guard in self.guards:
            stray = self._stray_reads(guard)
            if stray:
                raise UnsupportedModelError(
                    f"Layer '{layer.name}' ({type(layer).__name__}) reads trainable weights "
                    f"{stray} outside any registered norm function, so "
                    "ghost clipping cannot compute exact per-example norms. Register a norm "
                    "function for it (keras_dp.register_norm_function) or use the "
                    "vectorized engine (keras_dp.clipping.clipped_gradient_sum).")

    def _check_rows_are_examples(self, layer, factor):
        """Refuses a factor whose first axis is not the batch's (a layer
        applied to a transposed or flattened tensor): its rows are not the
        examples, and their norms would not bound any example's gradient."""
        rows = {t.shape[0] for t in vars(factor).values()
                if isinstance(t, tf.Tensor) and t.shape.rank}
        if self.batch_size is not None:
            rows.discard(None)  # Unknown here: nothing to tell.
        if rows - {self.batch_size}:
            raise UnsupportedModelError(
                f"Layer '{layer.name}' ({type(layer).__name__}) runs on a tensor whose "
                f"first axis is not the batch ({sorted(rows, key=str)} rows for a batch of "
                f"{self.batch_size}), so ghost clipping cannot tell its examples apart. "
                "Use the vectorized engine (clipping_engine=\"auto\" falls back to it).")

    def factors(self, grads):
        """Factors of every covered variable: {variable index: [factor, ...]}."""
        found = {}
        for call, grad in zip(self.calls, grads):
            reported = set()
            for variable, factor in call.gradients_fn(grad):
                key = variable_key(variable)
                if key in self.index:
                    self._check_rows_are_examples(call.layer, factor)
                    found.setdefault(self.index[key], []).append(factor)
                    reported.add(key)
            missing = [v.name for v in call.reads
                       if variable_key(v) in self.index and variable_key(v) not in reported]
            if missing:
                raise UnsupportedModelError(
                    f"The norm function of layer '{call.layer.name}' "
                    f"({type(call.layer).__name__}) reads trainable weights {sorted(missing)} "
                    "but reports no per-example gradient for them.")
        return found


def _built_in(rule):
    """Whether `rule` is one of keras-dp's norm functions (`keras_dp.clipping.layers`)."""
    return getattr(rule, "__module__", "").startswith("keras_dp.clipping.layers.")


# Keras' own activations: element-wise, or along the last axis (softmax,
# glu), never the batch's.
_KERAS_ACTIVATIONS = frozenset(
    function for name, function in vars(keras.activations).items()
    if callable(function) and not name.startswith("_")
    and name not in ("get", "serialize", "deserialize"))


def _calls_keras_activations(layer):
    """Whether every activation a built-in norm function calls for `layer`
    (its own, its cell's) is Keras' own. A user's function may mix the rows
    of the batch (review round 22: an activation centring the batch on a
    Dense, 8 C at B = 9): then the norm function's ops are read like any
    other layer's, not trusted.

    Raises:
        UnsupportedModelError: for a recurrent layer, whose loop cannot be
            read that way (nor run by the vectorized engine).
    """
    others = [activation for part in layer._flatten_layers(include_self=True, recursive=True)
              for name in ("activation", "recurrent_activation")
              if (activation := getattr(part, name, None)) not in _KERAS_ACTIVATIONS | {None}]
    if others and isinstance(layer, keras.layers.RNN):
        raise UnsupportedModelError(
            f"Layer '{layer.name}' ({type(layer).__name__}) calls {others[0]!r}, which is not "
            "one of Keras' activations, inside its recurrent loop: keras-dp cannot tell "
            "that it keeps the examples of a batch apart. Use an activation of "
            "keras.activations (by name, e.g. activation=\"tanh\").")
    return not others


def _batch_is_not_last(outputs):
    """Whether every output has an axis after the batch's: Keras' activations
    act along the last axis (softmax, glu), which would otherwise be the
    batch's (review round 113: an EinsumDense "ab,b->a" with log_softmax
    normalized over the examples, 5.31 C)."""
    return all(len(t.shape) >= 2 for t in tf.nest.flatten(outputs) if tf.is_tensor(t))


def _route_through_entries(call, entries):
    """Makes `call`, a layer call on inputs that hold no example, take the
    gradients of its `entries` (rows) instead of its output's (summed over
    the batch): the norm function runs again on its inputs broadcast over the
    batch, whose output's gradient for example i is what the entries give.
    """
    rule, args, kwargs = call.rerun
    call.target = [entry.tensor for entry in entries]
    if not entries:  # Its output does not reach the loss: no gradient.
        call.gradients_fn, call.reads = (lambda grads: []), []
        return

    def gradients(entry_grads):
        grad = tf.add_n([entry.per_example(g) for entry, g in zip(entries, entry_grads)])
        rows = tf.shape(grad)[0]

        def broadcast(t):
            if not tf.is_tensor(t):
                return t
            return tf.ensure_shape(tf.broadcast_to(t[None], tf.concat([[rows], tf.shape(t)], 0)),
                                   [None, *t.shape])

        args_b, kwargs_b = tf.nest.map_structure(broadcast, (args, kwargs))
        with tf.GradientTape() as tape:
            tape.watch([t for t in tf.nest.flatten((args_b, kwargs_b))
                        if tf.is_tensor(t) and t.dtype.is_floating])
            outputs, watched, gradients_fn = rule(call.layer, args_b, kwargs_b)
        watched_grad = tape.gradient(
            outputs, watched, output_gradients=tf.cast(grad, outputs.dtype),
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return gradients_fn(watched_grad)

    call.gradients_fn = gradients
