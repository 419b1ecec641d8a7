"""SimpleRNN, LSTM, GRU and Bidirectional on the ghost engine, against brute force.

Tolerance: the issue's rtol 1e-4 on every clipped sum and norm (the loop's
float32 backward pass through time sums in another order than Keras' own);
a float64 run holds the same algebra to 1e-10, which only an exact formula
meets.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from brute_force import (assert_sums_close, check, clipped_sum, labels, per_example_gradients,
                         per_example_loss, rng, with_unknown_rows)
from keras_dp.clipping import ghost

L = keras.layers
RTOL = 1e-4
STEPS, VOCAB = 5, 12

LAYERS = {
    "SimpleRNN": lambda **kw: L.SimpleRNN(4, **kw),
    "LSTM": lambda **kw: L.LSTM(4, **kw),
    "GRU": lambda **kw: L.GRU(4, **kw),
    "GRU_reset_before": lambda **kw: L.GRU(4, reset_after=False, **kw),
}


def on_tokens(*layers, mask_zero=False, dtype="float32"):
    """Embedding(mask_zero), `layers`, and a Dense head of 3 logits."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((STEPS,), dtype="int32"),
                             L.Embedding(VOCAB, 3, mask_zero=mask_zero, dtype=dtype),
                             *layers, L.Dense(3, dtype=dtype)])


def token_ids(padded, n=6):
    """`[n, STEPS]` ids; padded: with trailing, leading and inner zeros (id 0)."""
    ids = rng().integers(1, VOCAB, size=(n, STEPS)).astype("int32")
    if padded:
        ids[0, 3:], ids[1, :2], ids[2, 1], ids[3, 1:] = 0, 0, 0, 0
    return ids


def batch_of(padded, n=6):
    return {"x": token_ids(padded, n), "y": labels(n)}


def branches(tokens, layers, mask_zero):
    """A model of one Embedding feeding `layers` side by side (those returning
    sequences pooled by their masked mean), concatenated into a Dense head."""
    embedded = L.Embedding(VOCAB, 3, mask_zero=mask_zero)(tokens)
    outputs = []
    for layer in layers:
        output = layer(embedded)
        outputs.append(L.GlobalAveragePooling1D()(output) if len(output.shape) == 3 else output)
    return keras.Model(tokens, L.Dense(3)(L.Concatenate()(outputs)))


def each_kind(padded, sequences_first):
    """One layer of each kind, every other one returning its sequence."""
    keras.utils.set_random_seed(0)
    layers = [make(return_sequences=(k % 2 == 0) == sequences_first)
              for k, make in enumerate(LAYERS.values())]
    return branches(keras.Input((STEPS,), dtype="int32"), layers, mask_zero=padded)


@pytest.mark.parametrize("padded", [pytest.param(False, marks=pytest.mark.slow), True])
def test_each_kind_matches_brute_force(padded):
    """Each kind with and without masks; half of them return sequences (the
    other half in the slow test below, which also compares the norms: the
    same ghost pass, traced again; the clipped sum, most examples clipped, is
    off by the error of each clipped example's norm)."""
    check(each_kind(padded, sequences_first=padded), batch_of(padded), rtol=RTOL, norms=False)


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True])
def test_each_kind_matches_brute_force_both_ways(padded):
    check(each_kind(padded, sequences_first=not padded), batch_of(padded), rtol=RTOL)


# A Bidirectional's backward layer is its layer with go_backwards=True: the
# fast test_two_stacked_bidirectional_layers runs an LSTM returning sequences
# and a GRU that way (and fails when go_backwards is ignored).
@pytest.mark.slow
def test_go_backwards():
    keras.utils.set_random_seed(0)
    layers = [LAYERS["LSTM"](go_backwards=True, return_sequences=True),
              LAYERS["GRU"](go_backwards=True)]
    model = branches(keras.Input((STEPS,), dtype="int32"), layers, mask_zero=True)
    check(model, batch_of(True), rtol=RTOL, norms=False)  # Norms: in the test above.


@pytest.mark.slow  # bookkeeping=False is kept to measure; the default is tested above.
def test_second_backward_pass():
    """bookkeeping=False differentiates the weights again: U's gradient, which
    the loop does not accumulate, comes from its factor."""
    keras.utils.set_random_seed(0)
    layers = [LAYERS["GRU_reset_before"](), LAYERS["LSTM"](return_sequences=True)]
    model = branches(keras.Input((STEPS,), dtype="int32"), layers, mask_zero=True)
    check(model, batch_of(True), rtol=RTOL, bookkeeping=False)


@pytest.mark.slow  # 12 s; one Bidirectional of each merge mode is checked below.
def test_two_stacked_bidirectional_layers():
    model = on_tokens(L.Bidirectional(L.LSTM(4, return_sequences=True)),
                      L.Bidirectional(L.GRU(3), merge_mode="sum"), mask_zero=True)
    check(model, batch_of(True), rtol=RTOL, norms=False)


@pytest.mark.slow  # 3 to 5 s in each run; GRU's own rule: test_each_kind_matches_brute_force.
def test_an_unrolled_gru_is_exact():
    """Keras' unrolled loop takes one output a step; a GRU's norm function
    steps give two (review round 113: a TensorFlow error under ghost)."""
    model = on_tokens(L.Bidirectional(L.GRU(3, unroll=True)))
    check(model, batch_of(False), rtol=RTOL)


@pytest.mark.slow
def test_bidirectional_merge_modes():
    model = on_tokens(L.Bidirectional(L.SimpleRNN(3, return_sequences=True), merge_mode="mul"),
                      L.Bidirectional(L.GRU(3, reset_after=False), merge_mode="ave"))
    check(model, batch_of(False), rtol=RTOL)


@pytest.mark.slow  # keras.layers.RNN runs the same norm function as the layers above.
def test_rnn_over_each_cell_with_other_options():
    """keras.layers.RNN over the three cells; activations, no bias, unroll,
    zero_output_for_mask: the options that change the step's maths."""
    model = on_tokens(
        L.RNN(L.SimpleRNNCell(4, activation="relu"), return_sequences=True, unroll=True),
        L.RNN(L.GRUCell(4, activation="softsign", use_bias=False), return_sequences=True,
              zero_output_for_mask=True),
        L.RNN(L.LSTMCell(4, activation="relu", recurrent_activation="hard_sigmoid")),
        mask_zero=True)
    check(model, batch_of(True), rtol=RTOL)


@pytest.mark.slow  # Beside the stacked layers above.
def test_encoder_states_start_the_decoder():
    """return_state and initial_state: the decoder's gradient reaches the encoder."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((STEPS,), dtype="int32")
    embedded = L.Embedding(VOCAB, 3, mask_zero=True)(tokens)
    _, h, c = L.LSTM(4, return_state=True)(embedded)
    decoded = L.GRU(4, reset_after=False)(embedded, initial_state=L.Dense(4)(h + c))
    model = keras.Model(tokens, L.Dense(3)(decoded))
    check(model, batch_of(True), rtol=RTOL)


@pytest.mark.slow  # Beside the float32 tests above.
def test_float64_is_exact():
    keras.config.set_dtype_policy("float64")
    try:
        model = on_tokens(L.Bidirectional(L.GRU(4, return_sequences=True)), L.LSTM(3),
                          mask_zero=True, dtype="float64")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None,
                                                          dtype="float64")
        check(model, batch_of(True), rtol=1e-10,
              loss_fn=lambda batch, y_pred: loss(batch["y"], y_pred))
        assert model.layers[1].forward_layer.cell.kernel.dtype == "float64"
    finally:
        keras.config.set_dtype_policy("float32")


def test_under_mixed_precision_a_gru_example_is_clipped_in_float32():
    """In bfloat16, one example's clipped GRU gradient has norm C to float32
    precision: the Grams its norm function forms itself are float32 (bfloat16
    ones were off by up to 3e-6 here). The embedding and head are frozen so
    that the GRU's weights make the whole norm."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = on_tokens(LAYERS["GRU"](), mask_zero=True)
        model.layers[0].trainable = model.layers[-1].trainable = False
        assert model.layers[1].compute_dtype == "bfloat16"
        batch, clip = batch_of(True), 1e-3
        for i in range(4):
            example = {key: value[i:i + 1] for key, value in batch.items()}
            sums = ghost.clipped_gradient_sum(model, example, model.trainable_variables,
                                              clip, per_example_loss).grad_sum
            norm = np.sqrt(sum(np.sum(np.square(g.numpy().astype(np.float64))) for g in sums))
            np.testing.assert_allclose(norm, clip, rtol=1e-6)
    finally:
        keras.config.set_dtype_policy("float32")


def test_padding_rows_contribute_exactly_nothing():
    """Rows of sample weight 0 (fit's Poisson padding: all-zero ids, fully masked)."""
    model = on_tokens(L.LSTM(4), mask_zero=True)
    batch = batch_of(True, n=8) | {"sample_weight": np.ones(8, "float32")}
    batch["x"][[2, 7]], batch["sample_weight"][[2, 7]] = 0, 0.0
    real = {key: value[batch["sample_weight"] > 0] for key, value in batch.items()}
    variables = model.trainable_variables
    gradients, norms, _ = per_example_gradients(model, real)
    clip = float(np.quantile(norms, 0.3))

    @tf.function(autograph=False)
    def run(batch):
        return ghost.clipped_gradient_sum(model, batch, variables, clip, per_example_loss)

    grad_sum, _, _, num_nonfinite = with_unknown_rows(run, batch)[:4]
    assert_sums_close(grad_sum, clipped_sum(gradients, norms, clip), variables, RTOL)
    assert int(num_nonfinite) == 0


def private(model, engine="auto", **optimizer_kwargs):
    model = keras_dp.make_private(model, clipping_engine=engine)
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=0.5,
                                                 learning_rate=0.1, **optimizer_kwargs),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# Beside test_examples' private LSTM, a Poisson fit on the ghost engine, and
# the brute-force checks above of the same layers.
@pytest.mark.slow
def test_auto_picks_ghost_clipping_for_poisson_fit():
    model = on_tokens(L.Bidirectional(L.LSTM(4, return_sequences=True)), L.GRU(4),
                      mask_zero=True)
    before = [v.numpy() for v in model.trainable_variables]
    x = rng().integers(0, VOCAB, size=(32, STEPS))
    dp = private(model)
    history = dp.fit(x, x[:, 0] % 3, batch_size=8, epochs=1, verbose=0).history
    assert dp.clipping_engine_in_use == "ghost"
    assert np.isfinite(history["loss"][0]) and history["nonfinite_gradients"][0] == 0
    assert all(not np.array_equal(b, v.numpy())
               for b, v in zip(before, model.trainable_variables))


def fit_once(model, engine="auto", **optimizer_kwargs):
    x = rng().integers(1, VOCAB, size=(8, STEPS))
    private(model, engine, **optimizer_kwargs).fit(x, x[:, 0] % 3, batch_size=4, verbose=0)


class Mean(L.Layer):
    """Subtracts the batch mean: mixes the rows of a batch."""

    def call(self, inputs):
        return inputs - keras.ops.mean(inputs, axis=0, keepdims=True)


class CustomCell(L.SimpleRNNCell):
    """A cell computing otherwise than SimpleRNNCell, as far as keras-dp can tell."""

    def call(self, sequence, states, training=False):
        return super().call(sequence, states, training)


@pytest.mark.parametrize("make,engine,optimizer_kwargs,words", [
    (lambda: L.SimpleRNN(4, stateful=True), "auto", {},
     (r"is stateful", r"stateful=False")),
    (lambda: L.LSTM(4, dropout=0.2), "auto", {},
     (r"dropout", r"keras\.layers\.Dropout")),
    (lambda: L.RNN(CustomCell(4)), "auto", {},
     (r"runs the cell CustomCell", r"keras\.layers\.RNN over")),
    (lambda: L.GRU(4), "vectorized", {},
     (r"only ghost clipping trains recurrent layers", r'clipping_engine="auto"')),
    (lambda: L.GRU(4), "auto", {"num_microbatches": 2},
     (r"only ghost clipping", r"num_microbatches=None")),
])
def test_refusals_name_the_fix(make, engine, optimizer_kwargs, words):
    keras.utils.set_random_seed(0)
    batch_shape = (4, STEPS) if engine == "auto" and not optimizer_kwargs else None
    layers = [L.Embedding(VOCAB, 3), make(), L.Dense(3)]
    if batch_shape:  # A stateful layer needs a fixed batch size.
        model = keras.Sequential([keras.Input(batch_shape=batch_shape, dtype="int32"), *layers])
    else:
        model = keras.Sequential([keras.Input((STEPS,), dtype="int32"), *layers])
    before = [v.numpy() for v in model.weights]
    with pytest.raises(ValueError) as raised:
        fit_once(model, engine, **optimizer_kwargs)
    for word in words:
        assert re.search(word, str(raised.value)), (word, str(raised.value))
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.weights))


def test_conv_lstm_stays_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((STEPS, 3, 2)), L.ConvLSTM1D(2, 2), L.Flatten(),
                              L.Dense(3)])
    with pytest.raises(ValueError, match="convolutional recurrent layer"):
        private(model).fit(np.ones((4, STEPS, 3, 2), "float32"), np.zeros(4), batch_size=2,
                           verbose=0)


def test_no_fallback_to_the_vectorized_engine():
    """A model ghost clipping refuses while tracing (rows mixed) is refused, not
    handed to the vectorized engine, which cannot run the loop."""
    with pytest.raises(ValueError, match="vectorized engine cannot take over"):
        fit_once(on_tokens(L.LSTM(4), Mean()))


def test_the_loop_is_traced_under_one_tape():
    """The recorded pass watches a norm function's weight reads without a
    second tape: under two tapes TensorFlow takes the loop for a
    higher-order gradient and wraps it in forward and backward functions
    ("cflow_gradient_wrapper"), building its gradient three times at trace
    time (the brute-force checks above then took 2 to 4 times as long)."""
    model = on_tokens(L.LSTM(4), mask_zero=True)
    variables = model.trainable_variables
    step = tf.function(lambda batch: ghost.clipped_gradient_sum(
        model, batch, variables, 1.0, per_example_loss), autograph=False)
    traced = step.get_concrete_function({"x": tf.TensorSpec([None, STEPS], tf.int32),
                                         "y": tf.TensorSpec([None], tf.int64)})
    functions = [f.signature.name for f in traced.graph.as_graph_def().library.function]
    assert any("while_body" in name for name in functions)
    assert not [name for name in functions if "cflow_gradient_wrapper" in name]
