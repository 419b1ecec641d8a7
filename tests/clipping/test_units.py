"""User-level clipping (`rows_per_unit=k`) against a brute-force per-user loop.

`engine.clipped_gradient_sum` with `rows_per_unit=k` takes each k consecutive
rows as one user, whose gradient is the SUM of its rows' sample-weighted loss
gradients, bounded once. The reference differentiates each user's summed loss
alone with tf.GradientTape, bounds it in float64 and sums; both engines must
match it to the tolerance of tests/brute_force.py (float32 rounding of the
same quantity in another order), traced with an unknown batch size as fit
traces Poisson batches, with padding rows (sample weight 0, all-zero inputs,
whose forward pass may be 0 / 0) inside users and a user of padding alone.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from brute_force import assert_sums_close, per_example_loss, with_unknown_rows
from small_models import Scale
from keras_dp.clipping import engine
from keras_dp.clipping.bounds import Bound

ROWS_PER_USER = 3
USERS = 5


def private(model, clipping_engine):
    model = keras_dp.make_private(model, clipping_engine=clipping_engine)
    model.compile(optimizer=keras_dp.DPKerasSGD(learning_rate=1.0, l2_norm_clip=1.0,
                                                noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def users_batch(x, seed=0):
    """A batch of `USERS` users of `ROWS_PER_USER` rows from inputs `x`: user 1
    has one padding row, user 3 is padding alone, user 4 has unequal weights."""
    rows = USERS * ROWS_PER_USER
    weights = np.ones(rows, "float32")
    weights[4] = 0.0
    weights[9:12] = 0.0
    weights[12:15] = [0.5, 2.0, 1.0]
    x = np.array(x)
    x[weights == 0] = 0  # Padding as fit pads: zeros (all masked for mask_zero).
    labels = np.random.default_rng(seed + 1).integers(0, 3, rows)
    return {"x": x, "y": labels, "sample_weight": weights}


def user_gradients(model, batch):
    """Each user's gradient (float64): that of the sum of its rows' losses."""
    variables = model.trainable_variables
    gradients = []
    for user in range(len(batch["y"]) // ROWS_PER_USER):
        rows = tf.nest.map_structure(
            lambda t: t[user * ROWS_PER_USER:(user + 1) * ROWS_PER_USER], batch)
        if not rows["sample_weight"].any():
            gradients.append(None)  # Padding alone: no user.
            continue
        real = rows["sample_weight"] > 0
        rows = tf.nest.map_structure(lambda t: t[real], rows)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(per_example_loss(rows, model(rows["x"], training=True)))
        grads = tape.gradient(loss, variables, unconnected_gradients="zero")
        gradients.append([np.asarray(tf.convert_to_tensor(g), np.float64) for g in grads])
    return gradients


def bounded_sum(gradients, bound):
    """sum over users of the gradient bounded by `bound` (groups, normalization)."""
    clips = np.asarray(bound.clips, np.float64)
    total = [np.zeros_like(g) for g in next(g for g in gradients if g is not None)]
    for grads in gradients:
        if grads is None:
            continue
        groups = [bound.group_of(i) for i in range(len(grads))]
        norms = np.sqrt([sum(np.sum(g ** 2) for g, j in zip(grads, groups) if j == group)
                         for group in range(bound.num_groups)])
        if bound.normalize_gamma is None:
            scales = np.minimum(1.0, clips / norms)
        else:
            scales = clips / (norms + bound.normalize_gamma)
        total = [t + g * scales[j] for t, g, j in zip(total, grads, groups)]
    return total


def norms(gradients):
    return np.array([np.sqrt(sum(np.sum(g ** 2) for g in grads))
                     for grads in gradients if grads is not None])


def engine_sums(model, batches, bound, expected_engine=None, xla=False):
    """The engine's `ClippedSum` of each of `batches` (of one structure: one
    trace), asserting which engine ran (`expected_engine`, by default the
    model's `clipping_engine`)."""
    variables = model.trainable_variables
    used = []

    @tf.function(autograph=False, jit_compile=xla)  # As Keras traces its train step.
    def run(batch):
        return engine.clipped_gradient_sum(model, batch, None, variables, bound,
                                           report=lambda name, reason: used.append(name),
                                           rows_per_unit=ROWS_PER_USER)

    results = [with_unknown_rows(run, batch) for batch in batches]
    assert used == [expected_engine or model.clipping_engine]
    return results


def engine_sum(model, batch, bound, expected_engine=None, xla=False):
    """The engine's `ClippedSum` of `batch` (see `engine_sums`)."""
    return engine_sums(model, [batch], bound, expected_engine, xla)[0]


def check(model, batch, bound_of_norms=lambda norms: Bound(np.quantile(norms, 0.3)), xla=False):
    """Asserts the engine's per-user clipped sum, losses and counts equal brute force."""
    gradients = user_gradients(model, batch)
    bound = bound_of_norms(norms(gradients))
    result = engine_sum(model, batch, bound, xla=xla)
    variables = model.trainable_variables
    assert_sums_close(result.grad_sum, bounded_sum(gradients, bound), variables)
    real_users = [g is not None for g in gradients]
    losses = per_example_loss(batch, model(batch["x"], training=True)).numpy()
    losses[batch["sample_weight"] == 0] = 0  # NaN for masked padding: 0 / 0.
    np.testing.assert_allclose(result.losses, losses.reshape(USERS, -1).sum(axis=1),
                               rtol=1e-5, atol=1e-6)
    assert int(result.num_nonfinite) == 0
    within = norms(gradients) <= float(bound.clips[0])
    if bound.num_groups == 1 and bound.normalize_gamma is None:
        assert float(result.centered_within) == np.sum(within) - 0.5 * sum(real_users)
    return result


def sequences(seed=0):
    return np.random.default_rng(seed).normal(size=(USERS * ROWS_PER_USER, 6, 4)).astype("float32")


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(3)])


def conv():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(3, 3, activation="tanh"),
                             keras.layers.Flatten(), keras.layers.Dense(3)])


def embedding():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,), dtype="int32"),
                             keras.layers.Embedding(10, 4, mask_zero=True),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])


def transformer():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 4))
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
    hidden = keras.layers.LayerNormalization()(inputs + attended)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(hidden))
    return keras.Model(inputs, outputs)


def lstm():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6, 4)), keras.layers.LSTM(4), keras.layers.Dense(3)])


def lora_and_group_normalization():
    keras.utils.set_random_seed(0)
    lora = keras.layers.Dense(5)
    model = keras.Sequential([keras.Input((6, 4)), keras.layers.Conv1D(4, 3),
                              keras.layers.GroupNormalization(2), lora,
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    lora.enable_lora(2)
    return model


def recurrent_family():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6, 4)),
        keras.layers.Bidirectional(keras.layers.SimpleRNN(3, return_sequences=True)),
        keras.layers.GRU(3), keras.layers.Dense(3)])


def convolution_family():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6, 4)), keras.layers.SeparableConv1D(4, 3), keras.layers.DepthwiseConv1D(2),
        keras.layers.Conv1DTranspose(3, 2), keras.layers.RMSNormalization(),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])


def inputs_for(name):
    generator = np.random.default_rng(0)
    rows = USERS * ROWS_PER_USER
    if name == "mlp":
        return generator.normal(size=(rows, 6)).astype("float32")
    if name == "conv":
        return generator.normal(size=(rows, 6, 6, 1)).astype("float32")
    if name == "embedding":
        ids = generator.integers(1, 10, size=(rows, 5)).astype("int32")
        ids[::2, 3:] = 0  # Masked positions in real rows too.
        return ids
    return sequences()


MODELS = {"mlp": mlp, "conv": conv, "embedding": embedding, "transformer": transformer,
          "lstm": lstm, "lora_and_group_normalization": lora_and_group_normalization}


# TF 2.21's vectorized_map cannot batch the while loop of recurrent layers.
# The vectorized engine on the transformer takes longest: slow.
CASES = [(name, "ghost") for name in sorted(MODELS)] + [
    (name, "vectorized") for name in ("conv", "embedding", "mlp")] + [
    pytest.param("transformer", "vectorized", marks=pytest.mark.slow)]


@pytest.mark.slow
@pytest.mark.parametrize("model_fn", [recurrent_family, convolution_family])
def test_more_layer_families_per_user_on_the_ghost_engine(model_fn):
    check(private(model_fn(), "ghost"), users_batch(sequences()))


@pytest.mark.parametrize("name, clipping_engine", CASES)
def test_clipped_sum_per_user_equals_brute_force(name, clipping_engine):
    model = private(MODELS[name](), clipping_engine)
    check(model, users_batch(inputs_for(name)))


# XLA compiles its own kernels: oneDNN's setting changes none of them, so one run.
@pytest.mark.once
def test_ghost_clipping_per_user_compiles_with_xla():
    check(private(embedding(), "ghost"), users_batch(inputs_for("embedding")), xla=True)


def per_layer(norms):
    return Bound([0.3 * np.median(norms), 0.2 * np.median(norms)], groups=[0, 0, 1, 1])


def normalized(norms):
    return Bound(np.median(norms), normalize_gamma=0.01)


# Both engines apply a Bound by the same code (`Bound.scales`): the
# vectorized engine's normalization is slow.
@pytest.mark.parametrize("bound_of_norms, clipping_engine", [
    (per_layer, "ghost"), (per_layer, "vectorized"), (normalized, "ghost"),
    pytest.param(normalized, "vectorized", marks=pytest.mark.slow)])
def test_per_layer_and_normalized_bounds_apply_to_each_user(bound_of_norms, clipping_engine):
    check(private(mlp(), clipping_engine), users_batch(inputs_for("mlp")), bound_of_norms)


@pytest.mark.parametrize("clipping_engine", ["ghost", "vectorized"])
def test_a_user_with_huge_gradients_moves_the_sum_by_at_most_c(clipping_engine):
    model = private(mlp(), clipping_engine)
    x = inputs_for("mlp")
    x[:ROWS_PER_USER] *= 1e4  # User 0's rows, each far beyond C on its own.
    with_user = users_batch(x)
    without_user = {**with_user, "sample_weight": with_user["sample_weight"].copy()}
    without_user["sample_weight"][:ROWS_PER_USER] = 0
    clip = 0.5
    present, absent = engine_sums(model, [with_user, without_user], Bound(clip))
    moved = np.sqrt(sum(np.sum((np.float64(a) - np.float64(b)) ** 2)
                        for a, b in zip(present.grad_sum, absent.grad_sum)))
    # Clipped to C exactly: the move is C up to float32 rounding, not k * C.
    assert clip * (1 - 1e-4) <= moved <= clip * (1 + 1e-5)
    assert float(present.centered_within) == float(absent.centered_within) - 0.5


@pytest.mark.parametrize("clipping_engine", ["ghost", "vectorized"])
def test_a_non_finite_row_removes_its_whole_user_only(clipping_engine):
    model = private(mlp(), clipping_engine)
    batch = users_batch(inputs_for("mlp"))
    broken = {**batch, "x": batch["x"].copy()}
    # The first real row of user 1, whose padding row runs as its copy.
    broken["x"][ROWS_PER_USER, 0] = np.inf
    finite, result = engine_sums(model, [batch, broken], Bound(1e6))  # No clipping: plain sums.
    assert int(result.num_nonfinite) == 1
    user_1 = user_gradients(model, batch)[1]
    expected = [np.float64(f) - g for f, g in zip(finite.grad_sum, user_1)]
    assert_sums_close(result.grad_sum, expected, model.trainable_variables)


def test_auto_takes_ghost_clipping_for_users_and_falls_back_where_it_does():
    batch = users_batch(inputs_for("mlp"))
    engine_sum(private(mlp(), "auto"), batch, Bound(1.0), expected_engine="ghost")
    keras.utils.set_random_seed(0)
    uncovered = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5), Scale(),
                                  keras.layers.Dense(3)])
    engine_sum(private(uncovered, "auto"), batch, Bound(1.0), expected_engine="vectorized")


def test_refusals_name_the_fix():
    model = private(mlp(), "ghost")
    variables = model.trainable_variables
    batch = engine.as_batch(tf.zeros([7, 6]), tf.zeros([7], tf.int32), tf.ones([7]))
    with pytest.raises(ValueError, match="rows of sample weight 0"):
        engine.clipped_gradient_sum(model, batch, None, variables, Bound(1.0), rows_per_unit=3)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="positive Python int"):
            engine.clipped_gradient_sum(model, batch, None, variables, Bound(1.0),
                                        rows_per_unit=bad)
    keras.utils.set_random_seed(0)
    regularized = private(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(3, activity_regularizer="l2")]), "vectorized")
    batch = engine.as_batch(tf.zeros([6, 6]), tf.zeros([6], tf.int32), None)
    with pytest.raises(ValueError, match="add_loss"):
        engine.clipped_gradient_sum(regularized, batch, None, regularized.trainable_variables,
                                    Bound(1.0), rows_per_unit=3)
