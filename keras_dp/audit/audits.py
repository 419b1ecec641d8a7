"""Whole audits: private training with canaries, then the one-run bound."""

import dataclasses
import math

import numpy as np

from keras_dp import accounting
from keras_dp import callbacks
from keras_dp import models
from keras_dp import optimizers
from keras_dp.audit.canaries import model_losses
from keras_dp.audit.statistics import MembershipInferenceResult
from keras_dp.audit.statistics import OneRunResult
from keras_dp.audit.statistics import loss_threshold_attack
from keras_dp.audit.statistics import one_run_audit


@dataclasses.dataclass(frozen=True, eq=False)
class AuditResult:
    """The outcome of `audit_training`.

    Attributes:
        claimed_epsilon: the epsilon keras-dp's accountant reports for the
            run (inf without noise).
        delta: the delta of the claim and of the audit.
        epsilon_lower_bound: the empirical lower bound (95% confidence by
            default) from the one-run audit.
        one_run: the `OneRunResult` behind it.
        num_examples: size of the private training set, canaries included.
        scores: [m] canary scores; included: [m] bools.
        membership: a `MembershipInferenceResult` on training vs held-out
            examples, or None without `holdout`.
    """

    claimed_epsilon: float
    delta: float
    epsilon_lower_bound: float
    one_run: OneRunResult
    num_examples: int
    scores: np.ndarray
    included: np.ndarray
    membership: MembershipInferenceResult | None = None


def audit_training(model, x, y, canaries, *, loss, optimizer, batch_size, epochs,
                   delta=None, significance=0.05, holdout=None, verbose=0):
    """Trains `model` privately with canaries and lower-bounds its epsilon.

    The canaries join the private training set (Poisson-sampled, clipped,
    noised and accounted like the other examples); the claimed epsilon is
    that of the whole set, canaries included. `model` is trained in place.

    Args:
        model: an uncompiled Keras model taking one array and returning [B, K].
        x, y: the private training data, numpy arrays.
        canaries: a `GradientCanaries` or `ExampleCanaries`.
        loss: the per-example loss (name, function or `keras.losses.Loss`).
        optimizer: a fresh keras-dp DP optimizer, e.g. `keras_dp.DPKerasSGD`.
        batch_size: expected (Poisson) batch size.
        epochs: passes over the data.
        delta: delta of the claim and audit; default
            `keras_dp.default_delta(num_examples)`.
        significance: 0.05 for a bound at 95% confidence.
        holdout: optional `(x, y)` never trained on; adds a loss-threshold
            membership inference (AUC, TPR at low FPR) against as many
            random training examples.
        verbose: Keras `fit` verbosity (1 shows a progress bar).

    Returns:
        An `AuditResult`.

    Example:
    ```python
    result = keras_dp.audit.audit_training(
        model, x_train, y_train, keras_dp.audit.GradientCanaries(1000, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                      learning_rate=0.5),
        batch_size=250, epochs=3)
    print(result.claimed_epsilon, result.epsilon_lower_bound)
    ```
    """
    if not optimizers.is_dp_optimizer(optimizer):
        raise ValueError(f"optimizer must be a keras-dp DP optimizer such as "
                         f"keras_dp.DPKerasSGD(...); received {type(optimizer).__name__}.")
    optimizer, clip = _audit_optimizer(optimizer, canaries)
    training_model, training_loss, x_train, y_train = canaries.prepare(
        model, loss, x, y, clip)
    num_examples = len(y_train)
    delta = accounting.default_delta(num_examples) if delta is None else delta
    accounting.check_delta(delta, num_examples)
    private = models.make_private(training_model)
    # One forward pass builds every layer now, not symbolically inside the
    # private step (whose ghost clipping records the layers' calls).
    private(_first_rows(x_train))
    private.compile(optimizer=optimizer, loss=training_loss)
    privacy = callbacks.PrivacyCallback(delta=delta)
    private.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
                callbacks=[privacy], verbose=verbose)
    scores = canaries.scores(training_model, loss)
    membership = None if holdout is None else _membership(model, loss, x, y, holdout)
    one_run = one_run_audit(scores, canaries.included, delta, significance)
    return AuditResult(privacy.epsilon, delta, one_run.epsilon_lower_bound, one_run,
                       num_examples, scores, canaries.included, membership)


def _audit_optimizer(optimizer, canaries):
    """The optimizer that trains with the canaries, and the norm C they are
    scaled to.

    Under per-layer clipping (`l2_norm_clip={layer: C_l}`) C is the step's
    total sqrt(sum_l C_l^2), and a canary layer of the canaries
    (`GradientCanaries.layer_name`) gets that norm as its own: the step's
    sensitivity becomes sqrt(2) C and its noise grows with it (same noise
    multiplier, same claimed epsilon), while a canary moves its coordinate
    by C: a sound audit, less powerful than under one flat C.
    """
    clip = optimizer.l2_norm_clip
    if not isinstance(clip, dict):
        return optimizer, clip
    total = math.sqrt(sum(value ** 2 for value in clip.values()))
    layer = getattr(canaries, "layer_name", None)
    if layer is None:
        return optimizer, total
    config = dict(optimizer.get_config(), l2_norm_clip={**clip, layer: total})
    return type(optimizer).from_config(config), total


def _first_rows(x):
    if isinstance(x, dict):
        return {key: value[:1] for key, value in x.items()}
    return x[:1]


def _membership(model, loss, x, y, holdout, seed=0):
    """Loss-threshold attack: random training examples vs the held-out ones."""
    x_out, y_out = holdout
    count = min(len(x), len(x_out))
    chosen = np.random.default_rng(seed).choice(len(x), count, replace=False)
    return loss_threshold_attack(model_losses(model, loss, np.asarray(x)[chosen],
                                         np.asarray(y)[chosen]),
                                 model_losses(model, loss, x_out, y_out))
