"""Norm functions of SimpleRNN, LSTM and GRU (and `keras.layers.RNN` over their cells).

A recurrent layer is a Dense layer shared over time. With the step's input
projection `z_t = x_t W + b` and the recurrent kernel U applied to the
previous state h_{t-1}, example i's gradients are

    W: sum_t x_t^T dz_t      U: sum_t h_{t-1}^T du_t      b: sum_t dz_t

with du_t the gradient of the recurrent projection h_{t-1} U, which is dz_t
for SimpleRNN and LSTM (z_t + h_{t-1} U enter the gates together). For GRU
the candidate's recurrent part is scaled by the reset gate r_t: with
`reset_after=True` (Keras' default) du_t is dz_t with its candidate block
times r_t, and the recurrent bias has the same gradient; with
`reset_after=False` U's candidate columns multiply r_t h_{t-1} instead, so
U's factor has two blocks of positions (h_{t-1} with the gates' dz_t, r_t
h_{t-1} with the candidate's), which the engine sums exactly.

The norm function therefore runs the recurrence with Keras' own loop
(`keras.src.backend.rnn`: the same masking, `go_backwards`, `unroll` and
`zero_output_for_mask` semantics as the layer), each step computing z_t =
x_t W + b + p_t with p a watched tensor of zeros: its gradient is dz_t for
every t (computing z inside the steps, as Keras does, is faster on CPU than
feeding a precomputed [B, T, gates * units] projection through the loop).
The loop's outputs, carried over masked steps, are the states h_{t-1} the
steps started from (`_previous_states`); GRU's steps also output their reset
gates r_t (cheaper than recomputing them after the loop), and its two
kernels' Grams share the gate columns' block (`_gru_factors`). The loop runs
time-major with a time-major probe, so that neither the probe nor dz, the
largest tensors, is transposed on the way into the loop. The loop reads W
and U without a gradient, which book-keeping never uses
(`_with_kernel_gradients`). The cell maths are those of Keras' cells (same
activations, `use_bias`, `reset_after`); a masked step keeps its state, so
its dz_t is exactly 0. One forward and one backward pass of the batch, as
for the layers' ordinary training.

Covered: the layers above and `keras.layers.RNN` with a SimpleRNNCell,
LSTMCell or GRUCell, not stateful, with dropout and recurrent_dropout 0
(`check_covered` says what else to do); Bidirectional wrappers hold two
such layers. The vectorized engine cannot batch the loop
(`keras_dp.validation` refuses recurrent layers where ghost clipping does
not apply).
"""

import keras
import tensorflow as tf
from keras import ops
from keras.src import backend
from keras.src import tree

from keras_dp.clipping.factors import OuterProduct
from keras_dp.clipping.factors import PerExample
from keras_dp.clipping.factors import with_output_gram
from keras_dp.clipping.registry import computational_methods
from keras_dp.clipping.registry import first_input
from keras_dp.clipping.registry import register_norm_function
from keras_dp.clipping.registry import replaced_methods

_CELLS = (keras.layers.SimpleRNNCell, keras.layers.LSTMCell, keras.layers.GRUCell)


def _cell_class(cell):
    """The Keras cell class whose maths `cell` computes, or None."""
    base = next((c for c in _CELLS if isinstance(cell, c)), None)
    if base is None or computational_methods(type(cell), base) or replaced_methods(cell):
        return None
    return base


def check_covered(layer):
    """Refuses the recurrent `layer` when no norm function covers it.

    Args:
        layer: a `keras.layers.RNN` (SimpleRNN, LSTM and GRU are ones).

    Raises:
        ValueError: naming what to change.
    """
    name = f"Layer '{layer.name}' ({type(layer).__name__})"
    if getattr(layer, "stateful", False):
        raise ValueError(
            f"{name} is stateful: its state carries over from one batch to the next, so "
            "an example's gradient depends on the examples before it and DP-SGD cannot "
            "bound it. Use stateful=False (pass a state explicitly with initial_state=... "
            "if the task needs one).")
    cell = getattr(layer, "cell", None)
    if _cell_class(cell) is None:
        raise ValueError(
            f"{name} runs the cell {type(cell).__name__}, for which keras-dp has no exact "
            "per-example gradient. Use SimpleRNN, LSTM or GRU, or keras.layers.RNN over "
            "one SimpleRNNCell, LSTMCell or GRUCell (stack cells as several layers).")
    if cell.dropout or cell.recurrent_dropout:
        raise ValueError(
            f"{name} has dropout or recurrent_dropout, whose masks keras-dp's recurrent "
            "norm function does not draw. Set dropout=0 and recurrent_dropout=0, and put "
            "a keras.layers.Dropout (or SpatialDropout1D) before the layer instead.")


def recurrent_layers(model):
    """The `keras.layers.RNN` layers of `model` (SimpleRNN, LSTM, GRU, ConvLSTM...)."""
    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.RNN)]


def _is_covered(layer):
    try:
        check_covered(layer)
    except ValueError:
        return False
    return True


def _simple_rnn_step(cell, recurrent_kernel):
    def step(z, states):
        h = ops.add(z, ops.matmul(states[0], recurrent_kernel))
        if cell.activation is not None:
            h = cell.activation(h)
        return h, [h]
    return step


def _lstm_step(cell, recurrent_kernel):
    def step(z, states):
        h_prev, c_prev = states[0], states[1]
        z = ops.split(ops.add(z, ops.matmul(h_prev, recurrent_kernel)), 4, axis=-1)
        i = cell.recurrent_activation(z[0])
        f = cell.recurrent_activation(z[1])
        c = f * c_prev + i * cell.activation(z[2])
        o = cell.recurrent_activation(z[3])
        h = o * cell.activation(c)
        return h, [h, c]
    return step


def _gru_inner(cell, h_prev, recurrent_kernel, recurrent_bias, columns):
    """The recurrent projection h_{t-1} U (+ recurrent bias) of `columns`."""
    inner = ops.matmul(h_prev, recurrent_kernel[:, columns])
    if cell.reset_after and recurrent_bias is not None:
        inner = ops.add(inner, recurrent_bias[columns])
    return inner


def _gru_step(cell, recurrent_kernel, recurrent_bias):
    units = cell.units

    def step(z, states):
        h_prev = states[0]
        x_z, x_r, x_h = ops.split(z, 3, axis=-1)
        gates = slice(None) if cell.reset_after else slice(0, 2 * units)
        inner = _gru_inner(cell, h_prev, recurrent_kernel, recurrent_bias, gates)
        update = cell.recurrent_activation(x_z + inner[:, :units])
        reset = cell.recurrent_activation(x_r + inner[:, units:2 * units])
        if cell.reset_after:
            candidate = reset * inner[:, 2 * units:]
        else:
            candidate = ops.matmul(reset * h_prev, recurrent_kernel[:, 2 * units:])
        h = update * h_prev + (1 - update) * cell.activation(x_h + candidate)
        return (h, reset), [h]  # r_t, for the recurrent kernel's factor.
    return step


def _biases(cell):
    """(input bias, recurrent bias) as the cell applies them (None if absent)."""
    if not cell.use_bias:
        return None, None
    bias = ops.cast(cell.bias, cell.compute_dtype)
    if isinstance(cell, keras.layers.GRUCell) and cell.reset_after:
        return bias[0], bias[1]
    return bias, None


def _previous_states(outputs, h0, mask):
    """`[B, T, units]` the state h_{t-1} that step t started from.

    The loop's output at t is h_t, carried over masked steps; a step before
    any unmasked one starts from the initial state h0 (where the carried
    output is still 0). Masked steps' values do not matter: their dz_t is 0.
    """
    shifted = ops.concatenate([h0[:, None], outputs[:, :-1]], axis=1)
    if mask is None:
        return shifted
    steps = ops.cast(mask, "int32")
    seen = (ops.cumsum(steps, axis=1) - steps) > 0  # An unmasked step before t.
    return ops.where(seen[..., None], shifted, h0[:, None])


def _gram(tensor):
    """`[B, T, T]` per-example Gram matrices of `[B, T, p]` rows, in float64,
    as the engine forms every Gram norm (`contributions._gram_sq_norms`)."""
    tensor = tf.cast(tensor, tf.float64)
    return tf.linalg.matmul(tensor, tensor, transpose_b=True)


def _gru_factors(cell, inputs, reset, h_prev, dz):
    """W's and U's factors and the recurrent projection's gradient du of a GRU.

    `reset`: the reset gates r_t the steps computed (any value at masked
    steps, whose dz_t is 0). With reset_after, du is dz with its candidate
    block times r_t: dz and du share their gate columns, so their Grams
    share that block's (`with_output_gram`). Without, U's gate columns see
    h_{t-1} and its candidate columns r_t h_{t-1}: two blocks of positions,
    each zero outside its columns.
    """
    units = cell.units
    gates, candidate = dz[..., :2 * units], dz[..., 2 * units:]
    if cell.reset_after:
        reset_candidate = reset * candidate
        du = ops.concatenate([gates, reset_candidate], axis=-1)
        gates_gram = _gram(gates)
        return (with_output_gram(OuterProduct(inputs, dz), gates_gram + _gram(candidate)),
                with_output_gram(OuterProduct(h_prev, du),
                                 gates_gram + _gram(reset_candidate)),
                du)
    blocks = ops.concatenate([
        ops.concatenate([gates, ops.zeros_like(candidate)], axis=-1),
        ops.concatenate([ops.zeros_like(gates), candidate], axis=-1)], axis=1)
    recurrent = OuterProduct(ops.concatenate([h_prev, reset * h_prev], axis=1), blocks)
    return OuterProduct(inputs, dz), recurrent, None


def _kernel_factors(cell, found, inputs, dz):
    """W's and U's factors and, for GRU with reset_after, the gradient du of
    its recurrent projection (else None: z_t and h_{t-1} U enter the gates
    as one sum). `found`: the loop's "h_prev" (and GRU's "reset")."""
    if isinstance(cell, keras.layers.GRUCell):
        return _gru_factors(cell, inputs, found["reset"], found["h_prev"], dz)
    return OuterProduct(inputs, dz), OuterProduct(found["h_prev"], dz), None


def _steps_first(tensor):
    """Swaps the batch and time axes (the loop runs time-major)."""
    return tf.transpose(tensor, [1, 0, *range(2, tensor.shape.rank)])


def _gradients(cell, kernel_factors):
    """`gradients_fn` of one recurrent call.

    Args:
        cell: the layer's cell.
        kernel_factors: `dz -> (W's factor, U's factor, du)`
            (`_kernel_factors`), dz batch-major.

    The function takes the probe's gradient, `[T, B, gates * units]`.
    """
    def gradients(dz):
        dz = _steps_first(dz)
        kernel, recurrent, du = kernel_factors(dz)
        found = [(cell.kernel, kernel), (cell.recurrent_kernel, recurrent)]
        if cell.use_bias:
            bias = ops.sum(dz, axis=1)
            if du is not None:  # GRU's [input bias, recurrent bias].
                bias = ops.stack([bias, ops.sum(du, axis=1)], axis=1)
            found.append((cell.bias, PerExample(bias)))
        return found

    return gradients


def _with_kernel_gradients(probe, kernel, recurrent_kernel, kernel_factors):
    """`probe`, whose gradient also carries W's and U's batch gradients.

    The loop reads W and U without a gradient (each step would otherwise
    accumulate x_t^T dz_t and h_{t-1}^T du_t, unused by the engine's
    book-keeping); a second backward pass of the weights (`bookkeeping=False`)
    gets them here instead, the same sums over examples and steps.
    """
    def batch_gradient(factor):
        return tf.einsum("btd,btp->dp", factor.inputs, factor.output_grads)

    @tf.custom_gradient
    def identity(probe, kernel, recurrent_kernel):
        def gradient(dz_steps_first):
            factors = kernel_factors(_steps_first(dz_steps_first))
            return (dz_steps_first, batch_gradient(factors[0]), batch_gradient(factors[1]))
        return tf.identity(probe), gradient

    return identity(probe, kernel, recurrent_kernel)


def _projecting(step, kernel, input_bias):
    """`step` on z_t = x_t W + b + p_t, from the step's (x_t, p_t)."""
    def projected(inputs, states):
        x, probe = inputs
        z = ops.matmul(x, kernel)
        if input_bias is not None:
            z = ops.add(z, input_bias)
        return step(ops.add(z, probe), states)
    return projected


def _step(cell, recurrent_kernel, recurrent_bias):
    """The loop's step function for `cell`."""
    if isinstance(cell, keras.layers.GRUCell):
        return _gru_step(cell, recurrent_kernel, recurrent_bias)
    if isinstance(cell, keras.layers.LSTMCell):
        return _lstm_step(cell, recurrent_kernel)
    return _simple_rnn_step(cell, recurrent_kernel)


def _initial_state(layer, sequences, initial_state):
    if initial_state is None:
        initial_state = layer.get_initial_state(batch_size=ops.shape(sequences)[0])
    if not tree.is_nested(initial_state):
        initial_state = [initial_state]
    return [ops.cast(s, layer.cell.compute_dtype) for s in initial_state]


def _zeroed(outputs, last, mask):
    """Outputs as `zero_output_for_mask=True` gives them: 0 at masked steps."""
    keep = ops.cast(mask, "bool")[..., None]
    zero = ops.zeros((), outputs.dtype)
    return ops.where(keep, outputs, zero), ops.where(keep[:, -1], last, zero)


def _recurrent(layer, args, kwargs):
    sequences = first_input(args, kwargs)
    initial_state = kwargs.get("initial_state", args[1] if len(args) > 1 else None)
    mask = kwargs.get("mask")
    if tree.is_nested(mask):
        mask = tree.flatten(mask)[0]
    cell = layer.cell
    states = _initial_state(layer, sequences, initial_state)
    if layer.go_backwards:  # The loop then runs forwards over reversed steps.
        sequences = ops.flip(sequences, axis=1)
        mask = None if mask is None else ops.flip(mask, axis=1)
    dtype = cell.compute_dtype
    input_bias, recurrent_bias = _biases(cell)
    kernel = ops.cast(cell.kernel, dtype)
    recurrent_kernel = ops.cast(cell.recurrent_kernel, dtype)
    # Zeros added to each step's input projection z_t = x_t W + b inside the
    # loop (as Keras computes it): their gradient is dz_t. The loop runs
    # time-major, and the probe is made so: it and its gradient, the largest
    # tensors here, are not transposed on their way into and out of the loop.
    shape = tf.shape(sequences)
    probe = tf.zeros(tf.stack([shape[1], shape[0], kernel.shape[-1]]), dtype)
    probe = tf.ensure_shape(probe, [sequences.shape[1], sequences.shape[0], kernel.shape[-1]])
    found = {}  # Known after the loop: the states each step started from (GRU: r_t).

    def kernel_factors(dz):
        return _kernel_factors(cell, found, sequences, dz)

    step = _projecting(_step(cell, tf.stop_gradient(recurrent_kernel), recurrent_bias),
                       tf.stop_gradient(kernel), input_bias)
    watched = _with_kernel_gradients(probe, kernel, recurrent_kernel, kernel_factors)
    # Outputs carried over masked steps (zeroed after, if asked): they are
    # the states each step started from.
    # Keras' unrolled loop takes one output a step, and a GRU's steps give two
    # (the loop computes the same either way: unroll only trades memory for speed).
    unroll = layer.unroll and not isinstance(cell, keras.layers.GRUCell)
    last, outputs, final_states = backend.rnn(
        step, (_steps_first(sequences), watched), states,
        mask=None if mask is None else _steps_first(mask), unroll=unroll,
        input_length=sequences.shape[1], time_major=True, return_all_outputs=True)
    outputs = tree.map_structure(_steps_first, outputs)
    if isinstance(cell, keras.layers.GRUCell):  # Its steps also output r_t.
        (last, _), (outputs, found["reset"]) = last, outputs
    found["h_prev"] = _previous_states(outputs, states[0], mask)
    if layer.zero_output_for_mask and mask is not None:
        outputs, last = _zeroed(outputs, last, mask)
    output = ops.cast(outputs if layer.return_sequences else last, layer.compute_dtype)
    final_states = [ops.cast(s, layer.compute_dtype) for s in final_states]
    result = (output, *final_states) if layer.return_state else output
    return result, probe, _gradients(cell, kernel_factors)


for _layer_class in (keras.layers.RNN, keras.layers.SimpleRNN, keras.layers.LSTM,
                     keras.layers.GRU):
    register_norm_function(_layer_class, _recurrent, applies_to=_is_covered)
