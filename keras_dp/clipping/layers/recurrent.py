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

The norm function therefore computes `z = x W + b` for the whole sequence
(the watched tensor: its gradient is dz_t for every t), then runs the
recurrence with Keras' own loop (`keras.src.backend.rnn`: the same masking,
`go_backwards`, `unroll` and `zero_output_for_mask` semantics as the layer),
each step also emitting h_{t-1} (and r_t for GRU). The cell maths are those
of Keras' cells (same activations, `use_bias`, `reset_after`); a masked step
keeps its state, so its dz_t is exactly 0. One forward and one backward pass
of the batch, as for the layers' ordinary training.

Covered: the layers above and `keras.layers.RNN` with a SimpleRNNCell,
LSTMCell or GRUCell, not stateful, with dropout and recurrent_dropout 0
(`check_covered` says what else to do); Bidirectional wrappers hold two
such layers. The vectorized engine cannot batch the loop
(`keras_dp.validation` refuses recurrent layers where ghost clipping does
not apply).
"""

import keras
from keras import ops
from keras.src import backend
from keras.src import tree

from keras_dp.clipping.factors import OuterProduct
from keras_dp.clipping.factors import PerExample
from keras_dp.clipping.registry import computational_methods
from keras_dp.clipping.registry import first_input
from keras_dp.clipping.registry import register_norm_function

_CELLS = (keras.layers.SimpleRNNCell, keras.layers.LSTMCell, keras.layers.GRUCell)


def _cell_class(cell):
    """The Keras cell class whose maths `cell` computes, or None."""
    base = next((c for c in _CELLS if isinstance(cell, c)), None)
    if base is None or computational_methods(type(cell), base):
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
        h_prev = states[0]
        h = ops.add(z, ops.matmul(h_prev, recurrent_kernel))
        if cell.activation is not None:
            h = cell.activation(h)
        return ops.concatenate([h, h_prev], axis=-1), [h]
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
        return ops.concatenate([h, h_prev], axis=-1), [h, c]
    return step


def _gru_step(cell, recurrent_kernel, recurrent_bias):
    units = cell.units

    def step(z, states):
        h_prev = states[0]
        x_z, x_r, x_h = ops.split(z, 3, axis=-1)
        if cell.reset_after:
            inner = ops.matmul(h_prev, recurrent_kernel)
            if recurrent_bias is not None:
                inner = ops.add(inner, recurrent_bias)
        else:
            inner = ops.matmul(h_prev, recurrent_kernel[:, :2 * units])
        update = cell.recurrent_activation(x_z + inner[:, :units])
        reset = cell.recurrent_activation(x_r + inner[:, units:2 * units])
        if cell.reset_after:
            candidate = reset * inner[:, 2 * units:]
        else:
            candidate = ops.matmul(reset * h_prev, recurrent_kernel[:, 2 * units:])
        h = update * h_prev + (1 - update) * cell.activation(x_h + candidate)
        return ops.concatenate([h, h_prev, reset], axis=-1), [h]
    return step


def _biases(cell):
    """(input bias, recurrent bias) as the cell applies them (None if absent)."""
    if not cell.use_bias:
        return None, None
    bias = ops.cast(cell.bias, cell.compute_dtype)
    if isinstance(cell, keras.layers.GRUCell) and cell.reset_after:
        return bias[0], bias[1]
    return bias, None


def _gradients(cell, inputs, extras, reset_blocks):
    """`gradients_fn` of one recurrent call.

    Args:
        cell: the layer's cell.
        inputs: `[B, T, d]` step inputs, in the order the loop ran them.
        extras: `[B, T, k * units]` what each step emitted after h_t: h_{t-1}
            (and the reset gate r_t for GRU).
        reset_blocks: for GRU, "after" or "before" (its `reset_after`); else None.
    """
    units = cell.units

    def gradients(dz):
        h_prev = extras[..., :units]
        found = [(cell.kernel, OuterProduct(inputs, dz))]
        du = dz
        if reset_blocks == "after":
            reset = extras[..., units:2 * units]
            du = ops.concatenate([dz[..., :2 * units], reset * dz[..., 2 * units:]], axis=-1)
            found.append((cell.recurrent_kernel, OuterProduct(h_prev, du)))
        elif reset_blocks == "before":
            # Gate columns see h_{t-1}, candidate columns r_t h_{t-1}: two
            # blocks of positions, zero outside their columns.
            reset = extras[..., units:2 * units]
            gates = ops.concatenate([dz[..., :2 * units], ops.zeros_like(dz[..., 2 * units:])], -1)
            candidate = ops.concatenate([ops.zeros_like(dz[..., :2 * units]),
                                         dz[..., 2 * units:]], -1)
            found.append((cell.recurrent_kernel,
                          OuterProduct(ops.concatenate([h_prev, reset * h_prev], axis=1),
                                       ops.concatenate([gates, candidate], axis=1))))
        else:
            found.append((cell.recurrent_kernel, OuterProduct(h_prev, dz)))
        if cell.use_bias:
            bias = ops.sum(dz, axis=1)
            if reset_blocks == "after":
                bias = ops.stack([bias, ops.sum(du, axis=1)], axis=1)
            found.append((cell.bias, PerExample(bias)))
        return found

    return gradients


def _step_and_blocks(cell, recurrent_kernel, recurrent_bias):
    """The loop's step function and the GRU reset layout of `cell`."""
    if isinstance(cell, keras.layers.GRUCell):
        return (_gru_step(cell, recurrent_kernel, recurrent_bias),
                "after" if cell.reset_after else "before")
    if isinstance(cell, keras.layers.LSTMCell):
        return _lstm_step(cell, recurrent_kernel), None
    return _simple_rnn_step(cell, recurrent_kernel), None


def _initial_state(layer, sequences, initial_state):
    if initial_state is None:
        initial_state = layer.get_initial_state(batch_size=ops.shape(sequences)[0])
    if not tree.is_nested(initial_state):
        initial_state = [initial_state]
    return [ops.cast(s, layer.cell.compute_dtype) for s in initial_state]


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
    z = ops.matmul(sequences, ops.cast(cell.kernel, dtype))
    if input_bias is not None:
        z = ops.add(z, input_bias)
    step, reset_blocks = _step_and_blocks(cell, ops.cast(cell.recurrent_kernel, dtype),
                                          recurrent_bias)
    last, outputs, states = backend.rnn(
        step, z, states, mask=mask, unroll=layer.unroll, input_length=sequences.shape[1],
        zero_output_for_mask=layer.zero_output_for_mask, return_all_outputs=True)
    units = cell.units
    output = outputs[..., :units] if layer.return_sequences else last[..., :units]
    output = ops.cast(output, layer.compute_dtype)
    states = [ops.cast(s, layer.compute_dtype) for s in states]
    result = (output, *states) if layer.return_state else output
    return result, z, _gradients(cell, sequences, outputs[..., units:], reset_blocks)


for _layer_class in (keras.layers.RNN, keras.layers.SimpleRNN, keras.layers.LSTM,
                     keras.layers.GRU):
    register_norm_function(_layer_class, _recurrent, applies_to=_is_covered)
