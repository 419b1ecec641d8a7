"""Clipping variants through the private step: per-layer clipping,
normalization and adaptive clipping (keras_dp/clip_norms.py).

Updates are read off SGD at learning rate 1 with noise 0 (update = -sum / B)
and checked against a brute-force per-example loop; noise scales are checked
statistically on zero gradients; adaptive clipping's count and its update of
C are checked through the C each step leaves; the refusals each raise.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from brute_force import per_example_gradients
from keras_dp import clip_norms

# Whole private steps, whose kernel-level parts (each layer family's
# per-example gradients, the engines, noise) tests/clipping checks under
# both oneDNN settings: `make test` runs each test, and each parametrized
# case, in one of its two runs (pytest.ini's marker).
pytestmark = pytest.mark.alternating

BATCH = 16
# Adaptive clipping's count, its noise and the update of C: no CPU kernel set
# changes them (the norms counted are checked under both oneDNN settings by the
# variant tests), so `make test` runs those tests once (pytest.ini's marker).
KERNEL_INDEPENDENT = pytest.mark.once


def mlp(outputs=3, activation="tanh"):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)),
                             keras.layers.Dense(6, activation=activation, name="hidden"),
                             keras.layers.Dense(outputs, name="out")])


def data(n=BATCH, scale=3.0):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype("float32") * scale, rng.integers(0, 3, n)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def private(model=None, engine="auto", loss=LOSS, **optimizer_args):
    optimizer_args.setdefault("noise_multiplier", 0.0)
    optimizer_args.setdefault("learning_rate", 1.0)
    model = keras_dp.make_private(model or mlp(), clipping_engine=engine)
    with warnings_of_zero_noise(optimizer_args["noise_multiplier"]):
        optimizer = keras_dp.DPKerasSGD(**optimizer_args)
    model.compile(optimizer=optimizer, loss=loss)
    return model


def warnings_of_zero_noise(noise_multiplier):
    if noise_multiplier == 0:
        return pytest.warns(UserWarning, match="NOT differentially private")
    return _Nothing()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def update_of_one_step(model, x, y):
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.train_on_batch(x, y)
    return [b - v.numpy() for b, v in zip(before, model.trainable_variables)]


def brute_force_update(model, x, y, clips, gamma=None):
    """-sum of per-layer bounded gradients / B (each Dense layer its own group)."""
    batch = {"x": tf.constant(x), "y": tf.constant(y)}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    gradients, _, _ = per_example_gradients(
        model, batch, lambda b, p: loss(b["y"], p))
    groups = [0, 0, 1, 1] if len(clips) == 2 else [0, 0, 0, 0]
    total = [np.zeros(g.shape) for g in gradients[0]]
    for grads in gradients:
        sq = np.zeros(len(clips))
        for g, group in zip(grads, groups):
            sq[group] += np.sum(g ** 2)
        norms = np.sqrt(sq)
        scales = clips / (norms + gamma) if gamma else np.minimum(1.0, clips / norms)
        total = [t + g * scales[k] for t, g, k in zip(total, grads, groups)]
    return [t / len(x) for t in total]


@pytest.mark.parametrize("engine", ["auto", "vectorized"])
@pytest.mark.parametrize("variant", ["per_layer", "normalize"])
def test_the_step_bounds_each_example_as_the_variant_says(variant, engine):
    x, y = data()
    if variant == "per_layer":
        clips, kwargs = [0.3, 0.1], {"l2_norm_clip": {"hidden": 0.3, "out": 0.1}}
    else:
        clips, kwargs = [0.2], {"l2_norm_clip": 0.2, "clipping": "normalize"}
    model = private(engine=engine, **kwargs)
    expected = brute_force_update(model, x, y, np.array(clips),
                                  0.01 if variant == "normalize" else None)
    got = update_of_one_step(model, x, y)
    assert model.clipping_engine_in_use == ("ghost" if engine == "auto" else "vectorized")
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-7)


def zero_gradient_noise(**optimizer_args):
    """The update of the first layer in one step whose clipped gradients are
    all 0 (zero inputs, no biases): pure noise."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((100,)),
                              keras.layers.Dense(1000, use_bias=False, name="wide"),
                              keras.layers.Dense(2, use_bias=False, name="out")])
    model = private(model, loss="mse", seed=3, **optimizer_args)
    before = model.trainable_variables[0].numpy()
    model.train_on_batch(np.zeros((BATCH, 100), "float32"), np.zeros((BATCH, 2), "float32"))
    return before - model.trainable_variables[0].numpy()


def test_per_layer_noise_is_sigma_times_the_root_sum_of_squares():
    # 100,000 draws estimate the std to 0.3%; 3% is ten standard errors. The
    # layer's own C (0.6) or the sum (1.4) would be 40% off sqrt(0.6^2 + 0.8^2).
    sigma = 1.3
    update = zero_gradient_noise(l2_norm_clip={"wide": 0.6, "out": 0.8}, noise_multiplier=sigma)
    np.testing.assert_allclose(update.std(), sigma * 1.0 / BATCH, rtol=0.03)


def test_per_layer_sensitivity_is_the_root_sum_of_squares():
    # One example far outside both bounds moves the sum by sqrt(0.3^2 + 0.4^2)
    # (a linear hidden layer, so that its gradient does not saturate).
    x, y = data()
    model = private(mlp(activation=None), l2_norm_clip={"hidden": 0.3, "out": 0.4})
    weights = model.get_weights()
    without = update_of_one_step(model, x, y)
    model.set_weights(weights)
    big = np.concatenate([x, 1e3 * np.ones((1, 5), "float32")])
    with_z = update_of_one_step(model, big, np.concatenate([y, [1]]))
    moved = np.sqrt(sum(np.sum((a * (BATCH + 1) - b * BATCH) ** 2)
                        for a, b in zip(with_z, without)))
    assert moved <= 0.5 * (1 + 1e-4)
    assert moved >= 0.45  # The bound is nearly reached: both groups were clipped.


@KERNEL_INDEPENDENT
def test_adaptive_noise_is_raised_so_the_pair_is_worth_sigma():
    sigma, z = 1.3, 2.0
    update = zero_gradient_noise(
        l2_norm_clip=keras_dp.AdaptiveClipping(0.5, count_noise_multiplier=z),
        noise_multiplier=sigma)
    sigma_g = (sigma ** -2 - z ** -2) ** -0.5  # 1.71, 32% above sigma.
    np.testing.assert_allclose(update.std(), sigma_g * 0.5 / BATCH, rtol=0.03)


def count_noises(steps, z, learning_rate=0.01):
    """The count noise of each step, read back from the C it leaves.

    Zero gradients are all within C: the centered count is B/2, so
    log(C'/C) = -eta (1 + n / B - target) with n the count's noise."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False)])
    model = private(model, loss="mse", noise_multiplier=0.5, seed=5,
                    l2_norm_clip=keras_dp.AdaptiveClipping(
                        1.0, target_quantile=0.5, learning_rate=learning_rate,
                        count_noise_multiplier=z))
    zeros = np.zeros((BATCH, 3), "float32"), np.zeros((BATCH, 2), "float32")
    clips = [model.optimizer.l2_norm_clip]
    for _ in range(steps):
        model.train_on_batch(*zeros)
        clips.append(model.optimizer.l2_norm_clip)
    ratios = np.log(np.array(clips[1:]) / np.array(clips[:-1]))
    return (-ratios / learning_rate - 0.5) * BATCH


@KERNEL_INDEPENDENT
def test_adaptive_count_noise_has_std_z_over_2_and_c_moves_geometrically():
    # 400 draws estimate the std to 3.5%; 15% is four standard errors.
    noises = count_noises(400, z=4.0)
    assert abs(noises.mean()) < 4 * 2.0 / np.sqrt(400)
    np.testing.assert_allclose(noises.std(), 4.0 / 2, rtol=0.15)


@pytest.mark.slow  # Its utility, not its privacy (whose tests stay in make test): 4 s.
@KERNEL_INDEPENDENT
def test_adaptive_c_converges_to_the_target_quantile():
    # MAE with targets far below: every example's gradient is x_i, whose norm
    # is |r_i| for x_i = r_i e_1; learning rate 0 keeps the weights (and so
    # the norm distribution) fixed while C adapts from 10x off.
    rng = np.random.default_rng(1)
    radii = rng.lognormal(mean=0.0, sigma=0.5, size=4096)
    x = np.zeros((4096, 3), "float32")
    x[:, 0] = radii
    y = -1e4 * np.ones((4096, 1), "float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
    model = private(model, loss="mae", noise_multiplier=1.0, learning_rate=0.0, seed=1,
                    l2_norm_clip=keras_dp.AdaptiveClipping(10.0, target_quantile=0.5))
    history = model.fit(x, y, batch_size=256, epochs=20, verbose=0)  # 320 steps.
    median = np.median(radii)
    assert abs(model.optimizer.l2_norm_clip / median - 1) < 0.10
    clips = history.history["l2_norm_clip"]  # One C per epoch, as the progress bar shows.
    assert len(clips) == 20 and clips[0] < 10.0 and abs(clips[-1] / median - 1) < 0.15


@KERNEL_INDEPENDENT
def test_adaptive_epsilon_is_that_of_sigma_for_the_steps_run():
    # The ledger records the pair's sigma (never the raised sigma_g): the same
    # epsilon as flat clipping with the same sampling, sigma and steps.
    x, y = data(n=128)

    def spent(l2_norm_clip):
        model = private(l2_norm_clip=l2_norm_clip, noise_multiplier=1.1, seed=2)
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        [segment] = model.privacy_ledger.segments()
        assert segment.noise_multiplier == 1.1 and model.privacy_steps == 2
        return model.privacy_spent(delta=1e-5)[0]

    adaptive = spent(keras_dp.AdaptiveClipping(1.0))
    assert np.isfinite(adaptive) and adaptive == spent(1.0)


@KERNEL_INDEPENDENT
def test_adaptive_c_is_fixed_for_a_whole_accumulated_step():
    model = private(l2_norm_clip=keras_dp.AdaptiveClipping(1.0, count_noise_multiplier=4.0),
                    noise_multiplier=1.0, gradient_accumulation_steps=2)
    x, y = data()
    clips = [model.optimizer.l2_norm_clip]
    logged = []
    for _ in range(4):
        logged.append(model.train_on_batch(x, y, return_dict=True)["l2_norm_clip"])
        clips.append(model.optimizer.l2_norm_clip)
    assert clips[0] == clips[1] != clips[2] == clips[3] != clips[4]
    np.testing.assert_allclose(logged, [clips[0], clips[0], clips[2], clips[2]], rtol=1e-6)


@pytest.mark.once  # Configs and saved files: one run.
@pytest.mark.parametrize("l2_norm_clip, extra", [
    ({"hidden": 0.3, "out": 0.1}, {}),
    (0.5, {"clipping": "normalize", "normalize_gamma": 0.1}),
    (keras_dp.AdaptiveClipping(0.7, target_quantile=0.4, learning_rate=0.1,
                               count_noise_multiplier=30.0), {}),
])
def test_variants_serialize_with_the_optimizer_and_the_model(tmp_path, l2_norm_clip, extra):
    model = private(l2_norm_clip=l2_norm_clip, noise_multiplier=1.0, **extra)
    model.fit(*data(n=64), batch_size=16, epochs=1, verbose=0)
    optimizer = model.optimizer
    again = type(optimizer).from_config(optimizer.get_config())
    for loaded in (again, keras.models.load_model(_saved(model, tmp_path)).optimizer):
        assert loaded.l2_norm_clip == pytest.approx(optimizer.l2_norm_clip)
        assert (loaded.clipping, loaded.normalize_gamma) == (optimizer.clipping,
                                                             optimizer.normalize_gamma)
        assert repr(loaded.adaptive_clipping) == repr(
            optimizer.adaptive_clipping and clip_norms.AdaptiveClipping(
                **dict(optimizer.adaptive_clipping.get_config(),
                       initial_l2_norm_clip=loaded.l2_norm_clip)))


def _saved(model, tmp_path):
    path = str(tmp_path / "model.keras")
    model.save(path)
    return path


def test_per_layer_clipping_names_the_layers_it_misses_and_the_ones_it_does_not_know():
    x, y = data()
    with pytest.raises(ValueError, match=r"names none of the layers of \['sequential\w*/out'\]"):
        private(l2_norm_clip={"hidden": 1.0}).train_on_batch(x, y)
    with pytest.raises(ValueError, match=r"names \['hiden'\], which hold no trainable"):
        private(l2_norm_clip={"hidden": 1.0, "out": 1.0, "hiden": 1.0}).train_on_batch(x, y)
    model = private(l2_norm_clip={"hidden": 1.0, "out": 1.0})
    with pytest.raises(ValueError, match="set l2_norm_clip to a dict"):
        model.optimizer.l2_norm_clip = 1.0
    model.optimizer.l2_norm_clip = {"out": 2.0, "hidden": 0.5}
    assert model.optimizer.l2_norm_clip == {"hidden": 0.5, "out": 2.0}


@pytest.mark.parametrize("kwargs, message", [
    ({"l2_norm_clip": keras_dp.AdaptiveClipping(), "clipping": "normalize"},
     "no clipping norm for AdaptiveClipping"),
    ({"l2_norm_clip": keras_dp.AdaptiveClipping(), "num_microbatches": 4},
     "num_microbatches=None"),
    ({"l2_norm_clip": keras_dp.AdaptiveClipping(count_noise_multiplier=1.0)},
     "must exceed noise_multiplier=1.1"),
    ({"l2_norm_clip": 1.0, "clipping": "per_layer"}, 'clipping must be "flat" or "normalize"'),
    ({"l2_norm_clip": 1.0, "clipping": "normalize", "normalize_gamma": 0.0},
     "normalize_gamma must be a finite number > 0"),
    ({"l2_norm_clip": {}}, "names no layer"),
    ({"l2_norm_clip": {"hidden": -1.0}}, r"l2_norm_clip\['hidden'\] must be a finite number"),
])
def test_each_bad_variant_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        keras_dp.DPKerasSGD(noise_multiplier=1.1, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"target_quantile": 1.0}, "target_quantile must be in"),
    ({"learning_rate": 0.0}, "learning_rate must be a finite number > 0"),
    ({"initial_l2_norm_clip": float("nan")}, "initial_l2_norm_clip must be"),
])
def test_bad_adaptive_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        keras_dp.AdaptiveClipping(**kwargs)


def test_a_default_count_noise_below_sigma_is_refused_before_any_step():
    # A tenth of a batch of 16 is 1.6 < sigma = 2: no noise would be left for
    # the gradient. Refused in fit and train_on_batch, the weights untouched.
    model = private(l2_norm_clip=keras_dp.AdaptiveClipping(), noise_multiplier=2.0)
    weights = model.get_weights()
    x, y = data()
    with pytest.raises(ValueError, match="a tenth of the batch size 16"):
        model.fit(x, y, batch_size=16, verbose=0)
    with pytest.raises(ValueError, match="a tenth of the batch size 16"):
        model.train_on_batch(x, y)
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    assert model.privacy_steps == 0


@KERNEL_INDEPENDENT
def test_adaptive_clipping_runs_the_same_under_xla():
    # The count draws its own noise block under XLA too (XLA once cut the
    # noise seeds to 32 bits, so the count's block was the gradient's).
    x, y = data()

    def clips(jit_compile):
        model = private(l2_norm_clip=keras_dp.AdaptiveClipping(0.5, count_noise_multiplier=5.0),
                        noise_multiplier=1.0, learning_rate=0.1, seed=3)
        model.compile(optimizer=model.optimizer, loss=LOSS, jit_compile=jit_compile)
        result = []
        for _ in range(3):
            model.train_on_batch(x, y)
            result.append(model.optimizer.l2_norm_clip)
        return result

    np.testing.assert_allclose(clips(True), clips(False), rtol=1e-6)


def test_adaptive_clipping_is_read_only():
    """Review round 97: count_noise_multiplier set to 0 after construction
    released the count without noise in a custom loop, sigma recorded."""
    adaptive = keras_dp.AdaptiveClipping(count_noise_multiplier=5.0)
    for name in ("initial_l2_norm_clip", "target_quantile", "learning_rate",
                 "count_noise_multiplier"):
        with pytest.raises(AttributeError):
            setattr(adaptive, name, 0.0)
    assert adaptive.count_noise_multiplier == 5.0
