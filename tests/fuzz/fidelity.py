"""A third, cheap check: without noise and with a clipping norm no gradient
reaches, a private step is the model's own Keras step.

Defined only for models whose rows do not mix (each output row a function of
its input row alone): there keras-dp's sum of per-example gradients, divided
by the batch size, is the gradient of the mean loss that Keras' own
`train_on_batch` takes, through the model's own `compute_loss`.
"""

import warnings

import keras
import numpy as np

import keras_dp
from fuzz import builders
from fuzz import oracles

MIXING = ("batch_mean_mix", "impute_batch_mean")
HUGE_CLIP = 1e9


def _update(model, step, x, y):
    before = [np.asarray(v, np.float64) for v in model.get_weights()]
    step(x, y)
    return np.concatenate([(np.asarray(v, np.float64) - b).ravel()
                           for v, b in zip(model.get_weights(), before)])


def findings(program):
    """[Finding] when keras-dp's step is not the model's own step."""
    if any(layer in MIXING for layer in program.layers):
        return []
    x, y = builders.dataset(program)
    x, y = x[:10], y[:10]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        updates = _updates(program, x, y)
    if updates is None:
        return []
    own, private = updates
    scale = max(float(np.linalg.norm(own)), 1e-6)
    if float(np.linalg.norm(private - own)) > 1e-3 * scale:
        return [oracles.Finding("fidelity", "with noise 0 and no clipping, the private step "
                                f"is not the model's own step (relative difference "
                                f"{float(np.linalg.norm(private - own)) / scale:.3f})")]
    return []


def _updates(program, x, y):
    """The weight changes of Keras' own step and of the private step."""
    updates = []
    for private in (False, True):
        keras.backend.clear_session()
        keras.utils.set_random_seed(program.seed)
        base = builders.base_model(program)
        try:
            if private:
                model = keras_dp.make_private(base)
                optimizer = keras_dp.DPKerasSGD(l2_norm_clip=HUGE_CLIP, noise_multiplier=0.0,
                                                learning_rate=1.0, seed=1)
            else:
                model, optimizer = base, keras.optimizers.SGD(learning_rate=1.0)
            model.compile(optimizer=optimizer, loss="mse")
            updates.append(_update(base, lambda a, b: model.train_on_batch(a, b), x, y))
        except Exception:  # noqa: BLE001  A refused model has no step to compare.
            return None
    return updates
