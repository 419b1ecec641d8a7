"""The clipping variants (per-layer clipping, normalization) on both engines
against a brute-force per-example loop, and the count adaptive clipping
releases.

The loop differentiates every example alone (`brute_force.per_example_gradients`,
float64), bounds it as the variant says and sums; the engines run traced with
an unknown batch size, as in fit. Tolerances as in tests/brute_force.py.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from brute_force import assert_sums_close
from brute_force import labels
from brute_force import per_example_gradients
from brute_force import per_example_loss
from brute_force import rng
from brute_force import with_unknown_rows
from keras_dp import clip_norms
from keras_dp.clipping import Bound
from keras_dp.clipping import ghost
from keras_dp.clipping import vectorized
from small_models import sequential
from small_models import transformer_block

GAMMA = 0.01


def dense_model():
    return sequential((5,), keras.layers.Dense(6, activation="tanh", name="hidden"),
                      keras.layers.Dense(3, name="out"))


def conv_model():
    return sequential((6, 6, 2), keras.layers.Conv2D(3, 3, activation="tanh", name="conv"),
                      keras.layers.Flatten(), keras.layers.Dense(3, name="out"))


def embedding_model():
    return sequential((4,), keras.layers.Embedding(9, 5, name="embed"),
                      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3, name="out"),
                      input_dtype="int32")


MODELS = {
    "dense": (dense_model, lambda r: r.normal(size=(8, 5)) * 3),
    "conv": (conv_model, lambda r: r.normal(size=(8, 6, 6, 2)) * 3),
    "embedding": (embedding_model, lambda r: r.integers(0, 9, size=(8, 4))),
    "transformer": (transformer_block, lambda r: r.integers(0, 11, size=(8, 6))),
}


def batch_of(name, sample_weight=None):
    make_model, make_x = MODELS[name]
    keras.utils.set_random_seed(0)
    model = make_model()
    x = make_x(rng())
    x = x.astype("int32" if x.dtype.kind == "i" else "float32")
    batch = {"x": tf.constant(x), "y": tf.constant(labels(len(x)))}
    if sample_weight is not None:
        batch["sample_weight"] = tf.constant(sample_weight, tf.float32)
    return model, batch


def top_level_groups(model):
    """One group per layer of `model` that holds trainable weights."""
    names = [layer.name for layer in model.layers if layer.trainable_weights]
    return clip_norms.ClipNorms({name: 1.0 for name in names}).groups(
        model.trainable_variables), len(names)


def reference(gradients, groups, clips, gamma, counted):
    """Brute force: each example's groups bounded as the variant says, summed;
    and the centered count of the examples within their bounds."""
    total = [np.zeros(g.shape, np.float64) for g in gradients[0]]
    centered = 0.0
    for grads, count in zip(gradients, counted):
        sq = np.zeros(len(clips))
        for g, group in zip(grads, groups):
            sq[group] += np.sum(g ** 2)
        norms = np.sqrt(sq)
        scales = clips / (norms + gamma) if gamma else np.minimum(1.0, clips / norms)
        if count:
            total = [t + g * scales[group] for t, g, group in zip(total, grads, groups)]
            centered += float(np.all(norms <= clips)) - 0.5
    return total, centered


def engine_step(engine, model, bound):
    """The engine's clipped sum as a tf.function: traced once per batch
    structure (`with_unknown_rows` traces it with an unknown batch size)."""
    variables = model.trainable_variables

    @tf.function(autograph=False)
    def run(batch):
        if engine == "ghost":
            return ghost.clipped_gradient_sum(model, batch, variables, bound, per_example_loss)

        def microbatch_loss(microbatch):
            y_pred = model(microbatch["x"], training=True)
            return tf.reduce_sum(per_example_loss(microbatch, y_pred)), y_pred

        size = tf.shape(batch["y"])[0]
        return vectorized.clipped_gradient_sum(microbatch_loss, variables, batch, size, bound)

    return run


def run_engine(engine, model, batch, bound):
    return with_unknown_rows(engine_step(engine, model, bound), batch)


def group_norms(gradients, groups, num_groups):
    return np.array([[np.sqrt(sum(np.sum(g ** 2) for g, k in zip(grads, groups) if k == group))
                      for group in range(num_groups)] for grads in gradients])


@functools.cache
def model_and_gradients(name):
    """A model, its batch and the brute-force per-example gradients, once per model."""
    model, batch = batch_of(name)
    return model, batch, per_example_gradients(model, batch)[0]


VARIANTS = [(name, variant) for name in sorted(MODELS) for variant in ("per_layer", "normalize")]
# The ghost engine forms each group's norms from its layers' norm functions:
# every model on every variant. The vectorized engine bounds each example's
# gradient by the same `Bound.clip` whatever the model: each variant on the
# small models; on the transformer, whose vectorized trace takes longest, slow.
CASES = [(name, variant, "ghost") for name, variant in VARIANTS] + [
    ("transformer", "normalize_per_layer", "ghost"),
    ("dense", "normalize_per_layer", "vectorized")] + [
    (name, variant, "vectorized") if name != "transformer" else
    pytest.param(name, variant, "vectorized", marks=pytest.mark.slow)
    for name, variant in VARIANTS + [("transformer", "normalize_per_layer")]]


@pytest.mark.parametrize("name, variant, engine", CASES)
def test_a_variant_equals_the_brute_force_loop(name, variant, engine):
    model, batch, gradients = model_and_gradients(name)
    if variant == "normalize":
        groups, num_groups = [0] * len(gradients[0]), 1
    else:
        groups, num_groups = top_level_groups(model)
    assert num_groups >= (1 if variant == "normalize" else 2)
    # Per group, the 30% quantile of its norms (most examples are clipped in
    # some group, and the groups' bounds differ), raised to fit example 0 in
    # every group, so that the count holds an example within its bounds.
    norms = group_norms(gradients, groups, num_groups)
    clips = np.maximum(np.quantile(norms, 0.3, axis=0), norms[0] * (1 + 1e-3))
    gamma = GAMMA if variant.startswith("normalize") else None
    bound = Bound(clips, None if variant == "normalize" else groups, gamma)
    expected, centered = reference(gradients, groups, clips, gamma, [True] * len(gradients))
    result = run_engine(engine, model, batch, bound)
    assert_sums_close(result.grad_sum, expected, model.trainable_variables)
    assert float(result.centered_within) == centered
    assert 0 < centered + len(gradients) / 2 < len(gradients)  # Some in, some out.


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_padding_rows_add_nothing_and_are_not_counted(engine):
    weights = np.array([1, 1, 0, 1, 0, 1, 1, 0], np.float32)
    model, batch = batch_of("dense", weights)
    gradients, norms, _ = per_example_gradients(model, batch)
    real = np.sort(norms[weights > 0])
    clip = (real[1] + real[2]) / 2  # Between two norms: no example sits on the bound.
    groups = [0] * len(gradients[0])
    expected, centered = reference(gradients, groups, np.array([clip]), None, weights > 0)
    result = run_engine(engine, model, batch, Bound(clip))
    assert_sums_close(result.grad_sum, expected, model.trainable_variables)
    assert float(result.centered_within) == centered


def test_normalization_bounds_every_example_below_c_and_zeroes_nonfinite():
    bound = Bound(2.0, normalize_gamma=GAMMA)
    for scale in [1e-3, 1.0, 1e6]:
        grads = [tf.constant([3.0, 4.0]) * scale, tf.constant([[12.0]]) * scale]
        bounded, finite, _ = bound.clip(grads)
        norm = np.sqrt(sum(np.sum(g.numpy() ** 2) for g in bounded))
        assert bool(finite) and norm <= 2.0 * (1 + 1e-6)  # Float32 rounding.
        np.testing.assert_allclose(norm, 2.0 * 13 * scale / (13 * scale + GAMMA), rtol=1e-6)
    bounded, finite, within = bound.clip([tf.constant([np.inf, 1.0])])
    assert not bool(finite) and not bool(within)
    np.testing.assert_array_equal(bounded[0].numpy(), [0.0, 0.0])


def test_per_layer_groups_take_the_innermost_named_layer():
    model = transformer_block()
    variables = model.trainable_variables
    attention = next(layer for layer in model.layers if layer.trainable_weights
                     and isinstance(layer, keras.layers.MultiHeadAttention))
    names = {layer.name: 1.0 for layer in model.layers if layer.trainable_weights}
    names[attention.query_dense.name] = 0.5  # Inside the attention layer.
    groups = clip_norms.ClipNorms(names).groups(variables)
    query = list(names).index(attention.query_dense.name)
    for variable, group in zip(variables, groups):
        assert (group == query) == ("/query/" in variable.path), variable.path


@pytest.fixture
def policy(request):
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("policy, engine", [("mixed_bfloat16", "ghost"),
                                            ("mixed_float16", "vectorized")],
                         indirect=["policy"])
def test_under_mixed_precision_each_layer_is_bounded_in_float32(policy, engine):
    # Norms far below every example's: each layer's part of a one-example sum
    # is scaled to exactly its C_l, as the float32 bound promises.
    model, batch = batch_of("conv")
    assert model.layers[0].compute_dtype != "float32"
    groups, num_groups = top_level_groups(model)
    clips = np.array([1e-3, 2e-3, 3e-3])[:num_groups]
    step = engine_step(engine, model, Bound(clips, groups))  # Traced once, for all three.
    for i in range(3):
        example = {k: v[i:i + 1] for k, v in batch.items()}
        result = with_unknown_rows(step, example)
        sq = np.zeros(num_groups)
        for g, group in zip(result.grad_sum, groups):
            assert g.dtype == tf.float32
            sq[group] += np.sum(np.square(g.numpy().astype(np.float64)))
        np.testing.assert_allclose(np.sqrt(sq), clips, rtol=1e-5)
