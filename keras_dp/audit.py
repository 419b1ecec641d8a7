"""Privacy auditing: empirical lower bounds on the epsilon of one training run.

An audit attacks a private training run and turns the attack's success into
a statistically valid LOWER bound on epsilon: if the run were
(epsilon, delta)-DP for a smaller epsilon, an attack this successful would
happen with probability below the significance level. A lower bound far
below the claimed epsilon is normal (the attack, not the mechanism, is weak);
a lower bound ABOVE the claimed epsilon means the implementation or its
accounting is broken. It is never an upper bound: it cannot show that a run
is private.

The one-run audit (Steinke, Nasr & Jagielski, NeurIPS 2023) needs a single
training run: m canaries are each included in the private training set with
probability 1/2, every canary gets a score after training, and the auditor
guesses "included" for the highest scores and "excluded" for the lowest.
Canaries are ordinary members of the private training set: they are clipped,
noised and accounted like every other example, and nothing trains on them
outside the private step.

* `GradientCanaries` (white-box): canary example j has the gradient
  `-s * e_j` (s >= the clipping norm) on coordinate j of an extra canary
  weight that no other example touches; its score is that coordinate's total
  update. This is the strongest attack on DP-SGD.
* `ExampleCanaries` (black-box): given examples (mislabeled, or
  out-of-distribution inputs), scored by minus their loss after training.

`audit_training` runs the whole audit on a model; `one_run_audit` and
`loss_threshold_attack` are the statistics alone, for scores of your own.
"""

import dataclasses
import gzip
import math
import os

import keras
import numpy as np
from keras import ops
from scipy import special
from scipy import stats

from keras_dp import accounting
from keras_dp import callbacks
from keras_dp import models
from keras_dp import optimizers

# Fractions f of the m canaries guessed on. Each f gives two candidates: "in"
# for the f * m / 2 highest scores and "out" for as many lowest, or "in" for
# the f * m highest only. The reported bound is the best over the candidates,
# each tested at significance / (number of candidates) (Bonferroni), so
# choosing the best one keeps the overall confidence.
DEFAULT_GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.6, 1.0)
# Beyond this the binomial tail at q = e^eps / (1 + e^eps) is 1 in float64.
_MAX_EPSILON = 50.0
_BISECTION_TOLERANCE = 1e-6


# ------------------------------------------------------------- statistics


def one_run_p_value(epsilon, num_correct, num_guesses, num_canaries, delta=0.0):
    """P-value of "the run is (epsilon, delta)-DP" given a one-run audit's guesses.

    Steinke, Nasr & Jagielski (2023), Theorem 5.2: with r guesses of which v
    are correct and q = e^epsilon / (1 + e^epsilon), the p-value is
    `beta + alpha * 2 * m * delta`, where `beta = P[Binomial(r, q) >= v]` and
    `alpha = max over i = 1..v of P[v > Binomial(r, q) >= v - i] / i`.

    Args:
        epsilon: the epsilon under test, >= 0.
        num_correct: v, correct guesses, 0 <= v <= r.
        num_guesses: r, guesses made (canaries not abstained on).
        num_canaries: m, all canaries, >= r.
        delta: the delta of the guarantee under test, in [0, 1).

    Returns:
        The p-value, a float in [0, 1]: small values refute epsilon.

    Example:
    ```python
    keras_dp.audit.one_run_p_value(1.0, num_correct=90, num_guesses=100,
                                   num_canaries=1000, delta=1e-5)
    ```
    """
    _check_guesses(num_correct, num_guesses, num_canaries)
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1); received delta={delta!r}.")
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0; received epsilon={epsilon!r}.")
    q = special.expit(epsilon)
    beta = stats.binom.sf(num_correct - 1, num_guesses, q)
    if delta == 0 or num_correct == 0:
        return float(min(1.0, beta))
    # P[v - i <= B <= v - 1] for i = 1..v: cumulative sums of the pmf from v - 1 down.
    below = stats.binom.pmf(np.arange(num_correct - 1, -1, -1), num_guesses, q)
    alpha = np.max(np.cumsum(below) / np.arange(1, num_correct + 1))
    return float(min(1.0, beta + alpha * 2 * num_canaries * delta))


def one_run_epsilon_lower_bound(num_correct, num_guesses, num_canaries, delta=0.0,
                                significance=0.05):
    """The largest epsilon refuted by a one-run audit, found by bisection.

    Args:
        num_correct: v, correct guesses.
        num_guesses: r, guesses made.
        num_canaries: m, all canaries.
        delta: the delta of the guarantee under test.
        significance: the test level (0.05 for 95% confidence).

    Returns:
        The largest epsilon whose `one_run_p_value` is <= `significance`
        (to 1e-6, rounded down), or 0.0 when even epsilon = 0 is not refuted.

    Example:
    ```python
    keras_dp.audit.one_run_epsilon_lower_bound(95, 100, 1000, delta=1e-5)
    ```
    """
    _check_significance(significance)

    def refuted(epsilon):
        return one_run_p_value(epsilon, num_correct, num_guesses, num_canaries,
                               delta) <= significance

    if not refuted(0.0):
        return 0.0
    low, high = 0.0, _MAX_EPSILON
    if refuted(high):
        return high
    while high - low > _BISECTION_TOLERANCE:  # refuted(low), not refuted(high).
        middle = (low + high) / 2
        low, high = (middle, high) if refuted(middle) else (low, middle)
    return low


@dataclasses.dataclass(frozen=True)
class OneRunResult:
    """The outcome of a one-run audit.

    Attributes:
        epsilon_lower_bound: the empirical lower bound on epsilon, valid with
            confidence `1 - significance` over all candidates together.
        num_guessed_in: k+ of the candidate that gave the bound.
        num_guessed_out: its k-.
        num_correct: how many of its k+ + k- guesses were correct.
        num_canaries: m.
        num_candidates: how many (k+, k-) candidates were tried (Bonferroni).
        significance: the overall significance level.
    """

    epsilon_lower_bound: float
    num_guessed_in: int
    num_guessed_out: int
    num_correct: int
    num_canaries: int
    num_candidates: int
    significance: float


def one_run_audit(scores, included, delta=0.0, significance=0.05,
                  guess_fractions=DEFAULT_GUESS_FRACTIONS, seed=0):
    """Lower-bounds epsilon from canary scores of ONE training run.

    Each fraction f of `guess_fractions` gives two candidates (k+, k-): "in"
    for the k = round(f * m / 2) highest scores and "out" for the k lowest,
    or "in" for the 2k highest alone (k is at most m / 2). Ties are broken at
    random, independently of membership. Each candidate bounds epsilon with
    `one_run_epsilon_lower_bound` at `significance / (number of candidates)`
    and the largest bound is reported: by the Bonferroni inequality it holds
    with confidence `1 - significance`.

    Args:
        scores: [m] floats, higher meaning "more likely included".
        included: [m] bools, whether each canary was in the training set. It
            must have been drawn independently with probability 1/2 per canary.
        delta: the delta of the claimed guarantee.
        significance: overall test level (0.05 for 95% confidence).
        guess_fractions: fractions of the m canaries to guess on, in (0, 1].
        seed: seed of the random tie breaking.

    Returns:
        A `OneRunResult`.

    Example:
    ```python
    result = keras_dp.audit.one_run_audit(scores, included, delta=1e-5)
    result.epsilon_lower_bound
    ```
    """
    scores = np.asarray(scores, np.float64)
    included = np.asarray(included)
    if scores.ndim != 1 or included.shape != scores.shape or scores.size < 2:
        raise ValueError(
            "scores and included must be 1-D arrays of the same length, one entry per "
            "canary, with at least 2 canaries (1000 is a good start); received "
            f"shapes {scores.shape} and {included.shape}.")
    if included.dtype != bool or not np.all(np.isfinite(scores)):
        raise ValueError("included must be a bool array and scores finite; replace "
                         "non-finite scores (e.g. infinite losses) by large finite ones.")
    _check_significance(significance)
    m = scores.size
    counts = {min(m // 2, max(1, round(f * m / 2))) for f in _check_fractions(guess_fractions)}
    candidates = sorted({(k, k) for k in counts} | {(2 * k, 0) for k in counts})
    # Descending scores, ties in random order.
    order = np.lexsort((np.random.default_rng(seed).random(m), -scores))
    level = significance / len(candidates)
    best = None
    for k_in, k_out in candidates:
        correct = int(np.sum(included[order[:k_in]]) + np.sum(~included[order[m - k_out:]]))
        bound = one_run_epsilon_lower_bound(correct, k_in + k_out, m, delta, level)
        if best is None or bound > best[0]:
            best = (bound, k_in, k_out, correct)
    return OneRunResult(*best, m, len(candidates), significance)


def clopper_pearson(successes, trials, confidence=0.95):
    """The Clopper-Pearson (exact binomial) confidence interval of a proportion.

    Args:
        successes: k, an integer (or array of them) in [0, n].
        trials: n > 0.
        confidence: the two-sided confidence level; each side fails with
            probability at most (1 - confidence) / 2.

    Returns:
        `(low, high)`, floats (or arrays like `successes`).

    Example:
    ```python
    low, high = keras_dp.audit.clopper_pearson(5, 100)  # about (0.016, 0.113)
    ```
    """
    k = np.asarray(successes, np.float64)
    if not 0 < confidence < 1 or trials < 1 or np.any((k < 0) | (k > trials)):
        raise ValueError(
            f"need 0 <= successes <= trials, trials >= 1 and 0 < confidence < 1; "
            f"received successes={successes!r}, trials={trials!r}, "
            f"confidence={confidence!r}.")
    tail = (1 - confidence) / 2
    with np.errstate(invalid="ignore"):  # The k = 0 and k = n ends are set below.
        low = np.where(k == 0, 0.0, stats.beta.ppf(tail, k, trials - k + 1))
        high = np.where(k == trials, 1.0, stats.beta.ppf(1 - tail, k + 1, trials - k))
    if low.ndim == 0:
        return float(low), float(high)
    return low, high


@dataclasses.dataclass(frozen=True)
class MembershipInferenceResult:
    """The outcome of `loss_threshold_attack`.

    Attributes:
        auc: ROC AUC of "lower loss means member" (0.5 is chance).
        tpr_at_fpr: dict mapping each false positive rate to the true positive
            rate at the largest threshold whose FPR does not exceed it.
        epsilon_lower_bound: the Clopper-Pearson lower bound on epsilon (see
            `loss_threshold_attack` for when it is valid).
    """

    auc: float
    tpr_at_fpr: dict
    epsilon_lower_bound: float


def loss_threshold_attack(member_losses, nonmember_losses, delta=0.0,
                          significance=0.05, fprs=(0.001, 0.01, 0.1), seed=0):
    """Loss-threshold membership inference: guess "member" when the loss is low.

    An (epsilon, delta)-DP training satisfies TPR <= e^epsilon * FPR + delta
    for every threshold (and the same with members and non-members swapped).
    The epsilon bound takes a one-sided Clopper-Pearson lower bound of the
    TPR and upper bound of the FPR, each at level significance / 2. To keep
    the threshold's choice from biasing the bound, each set is split in two
    at random: the threshold (and direction) is chosen on one half, the bound
    computed on the other.

    The bound is valid when each (loss, membership) pair is an independent
    trial, e.g. one target example per training run (Jagielski et al. 2020).
    The examples of ONE run are not independent trials: there, report the AUC
    and TPR and bound epsilon with `one_run_audit` instead.

    Args:
        member_losses: [n1] losses of training examples (at least 2).
        nonmember_losses: [n0] losses of held-out examples (at least 2).
        delta: the delta of the guarantee under test.
        significance: test level of the epsilon bound.
        fprs: false positive rates at which to report the TPR.
        seed: seed of the random split.

    Returns:
        A `MembershipInferenceResult`.

    Example:
    ```python
    result = keras_dp.audit.loss_threshold_attack(train_losses, test_losses)
    result.auc, result.tpr_at_fpr[0.01]
    ```
    """
    members = np.asarray(member_losses, np.float64)
    nonmembers = np.asarray(nonmember_losses, np.float64)
    for name, losses in (("member_losses", members), ("nonmember_losses", nonmembers)):
        if losses.ndim != 1 or losses.size < 2 or not np.all(np.isfinite(losses)):
            raise ValueError(f"{name} must be a 1-D array of at least 2 finite losses; "
                             f"received shape {losses.shape}.")
    _check_significance(significance)
    auc = stats.mannwhitneyu(nonmembers, members).statistic / (members.size * nonmembers.size)
    tpr_at_fpr = {fpr: _tpr_at_fpr(members, nonmembers, fpr) for fpr in fprs}
    rng = np.random.default_rng(seed)
    members, nonmembers = rng.permutation(members), rng.permutation(nonmembers)
    # "Member" when members score -loss >= t, or "non-member" when loss >= t.
    choices = []
    for positives, negatives in ((-members, -nonmembers), (nonmembers, members)):
        tune_p, test_p = np.array_split(positives, 2)
        tune_n, test_n = np.array_split(negatives, 2)
        estimate, threshold = _best_threshold(tune_p, tune_n, delta, significance)
        choices.append((estimate, threshold, test_p, test_n))
    _, threshold, positives, negatives = max(choices, key=lambda choice: choice[0])
    epsilon = _threshold_epsilon(np.sum(positives >= threshold), positives.size,
                                 np.sum(negatives >= threshold), negatives.size,
                                 delta, significance)
    return MembershipInferenceResult(float(auc), tpr_at_fpr, float(max(0.0, epsilon)))


def _tpr_at_fpr(members, nonmembers, fpr):
    """TPR of "member when loss < t" at the largest t with FPR <= fpr."""
    allowed = math.floor(fpr * nonmembers.size)  # False positives allowed.
    if allowed >= nonmembers.size:
        return 1.0
    threshold = np.sort(nonmembers)[allowed]
    return float(np.mean(members < threshold))


def _threshold_epsilon(true_positives, num_positives, false_positives, num_negatives,
                       delta, significance):
    """log((TPR_low - delta) / FPR_high), -inf when TPR_low <= delta (arrays allowed)."""
    tpr_low, _ = clopper_pearson(true_positives, num_positives, 1 - significance)
    _, fpr_high = clopper_pearson(false_positives, num_negatives, 1 - significance)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tpr_low > delta, np.log((tpr_low - delta) / fpr_high), -np.inf)


def _best_threshold(positives, negatives, delta, significance):
    """(bound, threshold) maximizing the bound of "positive when score >= t"."""
    thresholds = np.unique(np.concatenate([positives, negatives]))
    true_positives = positives.size - np.searchsorted(np.sort(positives), thresholds)
    false_positives = negatives.size - np.searchsorted(np.sort(negatives), thresholds)
    bounds = _threshold_epsilon(true_positives, positives.size, false_positives,
                                negatives.size, delta, significance)
    best = int(np.argmax(bounds))
    return float(bounds[best]), float(thresholds[best])


def _check_guesses(num_correct, num_guesses, num_canaries):
    values = (num_correct, num_guesses, num_canaries)
    if (not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)
            or not 0 <= num_correct <= num_guesses <= num_canaries or num_canaries < 1):
        raise ValueError(
            "need integers 0 <= num_correct <= num_guesses <= num_canaries, "
            f"num_canaries >= 1; received num_correct={num_correct!r}, "
            f"num_guesses={num_guesses!r}, num_canaries={num_canaries!r}.")


def _check_significance(significance):
    if not 0 < significance < 1:
        raise ValueError(f"significance must be in (0, 1), e.g. 0.05 for 95% "
                         f"confidence; received significance={significance!r}.")


def _check_fractions(fractions):
    fractions = tuple(fractions)
    if not fractions or not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"guess_fractions must be fractions in (0, 1]; received "
                         f"{fractions!r}.")
    return fractions


# --------------------------------------------------------------- canaries


def _draw_inclusion(num_canaries, rng):
    """Each canary in the training set independently with probability 1/2."""
    if not isinstance(num_canaries, (int, np.integer)) or num_canaries < 1:
        raise ValueError(f"num_canaries must be an integer >= 1 (1000 is a good "
                         f"start); received num_canaries={num_canaries!r}.")
    return rng.random(num_canaries) < 0.5


def _per_example_loss(loss):
    """`(y_true, y_pred) -> [B]` losses of a Keras loss (name, function or object)."""
    loss = keras.losses.get(loss)
    fn = loss.call if isinstance(loss, keras.losses.Loss) else loss

    def per_example(y_true, y_pred):
        values = fn(y_true, y_pred)
        if len(values.shape) > 1:  # e.g. per time step: average like Keras does.
            values = ops.mean(values, axis=list(range(1, len(values.shape))))
        return values

    return per_example


class GradientCanaries:
    """White-box canaries: each one's gradient is a fixed direction e_j.

    The model is trained with an extra weight w of m coordinates (a
    `keras.layers.Embedding(m + 1, 1)` that no ordinary example touches).
    Canary j is an example with an all-zero input whose loss is
    `-s * w[j]`, s = 2 * l2_norm_clip: its gradient is `-s * e_j` on w and
    exactly zero on the model's own weights, so the private step clips it to
    norm C like any example: the worst-case canary of DP-SGD. Its score is
    the total update `w[j]` (w starts at zero): about C / B per time it was
    sampled, plus the noise.

    Args:
        num_canaries: m.
        seed: seed (or numpy Generator) of which canaries are included.

    Example:
    ```python
    canaries = keras_dp.audit.GradientCanaries(1000, seed=0)
    result = keras_dp.audit.audit_training(model, x, y, canaries, loss=..., ...)
    ```
    """

    def __init__(self, num_canaries=1000, seed=None):
        self.included = _draw_inclusion(num_canaries, np.random.default_rng(seed))

    def prepare(self, model, loss, x, y, l2_norm_clip):
        """What to train privately: the data plus the included canaries.

        Args:
            model: the Keras model, taking one array `x` and returning [B, K].
            loss: its loss, per example (a name, function or `keras.losses.Loss`).
            x, y: the training data, numpy arrays.
            l2_norm_clip: the optimizer's clipping norm C.

        Returns:
            `(training_model, training_loss, x, y)`: the model with the canary
            weight, its loss, inputs `{"x": ..., "canary": ...}` (canary index
            j + 1, or 0 for ordinary examples) and labels.
        """
        ids = np.flatnonzero(self.included) + 1
        x, y = np.asarray(x), np.asarray(y)
        inputs = {"x": np.concatenate([x, np.zeros((ids.size,) + x.shape[1:], x.dtype)]),
                  "canary": np.concatenate([np.zeros(len(x), np.int32), ids.astype(np.int32)])}
        labels = np.concatenate([y, np.zeros((ids.size,) + y.shape[1:], y.dtype)])
        return (_CanaryModel(model, self.included.size),
                _CanaryLoss(loss, 2.0 * l2_norm_clip), inputs, labels)

    def scores(self, training_model, loss=None):
        """[m] scores: the total update of each canary's coordinate."""
        return np.asarray(training_model.canary_weights.embeddings)[1:, 0].astype(np.float64)


class _CanaryModel(keras.Model):
    """The model plus the canary weight; outputs [logits, w[canary], is_canary]."""

    def __init__(self, model, num_canaries):
        super().__init__(name=f"{model.name}_with_canaries")
        self.model = model
        self.canary_weights = keras.layers.Embedding(
            num_canaries + 1, 1, embeddings_initializer="zeros", name="canary_weights")

    def call(self, inputs, training=None):
        logits = self.model(inputs["x"], training=training)
        index = inputs["canary"]
        value = ops.cast(self.canary_weights(index), logits.dtype)
        is_canary = ops.cast(ops.expand_dims(index > 0, -1), logits.dtype)
        return ops.concatenate([logits, value, is_canary], axis=-1)


class _CanaryLoss(keras.losses.Loss):
    """The model's loss for ordinary rows, `-strength * w[j]` for canary j."""

    def __init__(self, loss, strength):
        super().__init__(name="canary_loss")
        self._loss = _per_example_loss(loss)
        self._strength = strength

    def call(self, y_true, y_pred):
        ordinary = self._loss(y_true, y_pred[:, :-2])
        canary = -self._strength * y_pred[:, -2]
        # where() sends a zero gradient to the branch it does not pick.
        return ops.where(y_pred[:, -1] > 0, canary, ordinary)


class ExampleCanaries:
    """Black-box canaries: given examples, scored by minus their loss.

    Build them with `mislabeled` (real inputs with a wrong label) or
    `random_inputs` (out-of-distribution inputs), or from examples of your own.

    Args:
        x: [m, ...] canary inputs.
        y: [m, ...] their labels.
        seed: seed (or numpy Generator) of which canaries are included.

    Example:
    ```python
    canaries = keras_dp.audit.ExampleCanaries.mislabeled(x_extra, y_extra, 10)
    ```
    """

    def __init__(self, x, y, seed=None):
        self.x, self.y = np.asarray(x), np.asarray(y)
        if len(self.x) != len(self.y):
            raise ValueError(f"x and y must hold the same number of canaries; received "
                             f"{len(self.x)} inputs and {len(self.y)} labels.")
        self.included = _draw_inclusion(len(self.x), np.random.default_rng(seed))

    @classmethod
    def mislabeled(cls, x, y, num_classes, seed=None):
        """Canaries from examples NOT otherwise trained on, each given a random wrong label.

        Args:
            x, y: the examples (integer labels in [0, num_classes)).
            num_classes: number of classes, >= 2.
            seed: seed of the labels and of the inclusion.

        Returns:
            An `ExampleCanaries`.
        """
        rng = np.random.default_rng(seed)
        y = np.asarray(y)
        shift = rng.integers(1, num_classes, size=y.shape)
        return cls(x, ((y + shift) % num_classes).astype(y.dtype), seed=rng)

    @classmethod
    def random_inputs(cls, num_canaries, input_shape, num_classes, low=0.0, high=1.0,
                      seed=None):
        """Out-of-distribution canaries: uniform random inputs with random labels.

        Args:
            num_canaries: m.
            input_shape: shape of one input, e.g. (784,).
            num_classes: number of classes.
            low, high: range of the uniform input values.
            seed: seed of the inputs, labels and inclusion.

        Returns:
            An `ExampleCanaries`.
        """
        rng = np.random.default_rng(seed)
        x = rng.uniform(low, high, (num_canaries, *input_shape)).astype(np.float32)
        return cls(x, rng.integers(0, num_classes, num_canaries), seed=rng)

    def prepare(self, model, loss, x, y, l2_norm_clip):
        """Returns `(model, loss, x, y)` with the included canaries appended."""
        del l2_norm_clip  # Canaries are clipped like any example.
        chosen = self.included
        return (model, loss, np.concatenate([np.asarray(x), self.x[chosen]]),
                np.concatenate([np.asarray(y), self.y[chosen]]))

    def scores(self, training_model, loss):
        """[m] scores: minus each canary's loss under the trained model."""
        return -_losses(training_model, loss, self.x, self.y)


def _losses(model, loss, x, y):
    """Per-example losses of (x, y) under `model`, as float64 numpy."""
    predictions = model.predict(x, batch_size=1024, verbose=0)
    return np.asarray(_per_example_loss(loss)(y, predictions), np.float64)


# ----------------------------------------------------------- whole audits


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
    training_model, training_loss, x_train, y_train = canaries.prepare(
        model, loss, x, y, optimizer.l2_norm_clip)
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


def _first_rows(x):
    if isinstance(x, dict):
        return {key: value[:1] for key, value in x.items()}
    return x[:1]


def _membership(model, loss, x, y, holdout, seed=0):
    """Loss-threshold attack: random training examples vs the held-out ones."""
    x_out, y_out = holdout
    count = min(len(x), len(x_out))
    chosen = np.random.default_rng(seed).choice(len(x), count, replace=False)
    return loss_threshold_attack(_losses(model, loss, np.asarray(x)[chosen],
                                         np.asarray(y)[chosen]),
                                 _losses(model, loss, x_out, y_out))


# ------------------------------------------------------ the built-in task

# Where the Debian package dataset-fashion-mnist installs the IDX files.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
CANARY_KINDS = ("gradient", "mislabeled", "input")


def audit_builtin_task(noise_multiplier=1.0, l2_norm_clip=1.0, epochs=5,
                       num_canaries=1000, canary_kind="gradient", num_examples=10000,
                       batch_size=500, learning_rate=0.5, seed=0,
                       data_dir=FASHION_MNIST_DIR, verbose=1):
    """Audits keras-dp's own training of a small MLP on Fashion-MNIST.

    Uses `num_examples` Fashion-MNIST training images (784 pixels in [0, 1])
    when the IDX files are in `data_dir`, else generated data of the same
    shape; a 784-64-10 ReLU network, DP-SGD with momentum 0.9, Poisson
    batches, delta = `keras_dp.default_delta` of the training set. 1,000
    test images are held out for the membership inference.

    Args:
        noise_multiplier, l2_norm_clip, epochs, batch_size, learning_rate:
            the DP-SGD training run.
        num_canaries: m.
        canary_kind: "gradient" (`GradientCanaries`), "mislabeled" (training
            images not otherwise used, with a wrong label) or "input"
            (uniform random images with random labels).
        num_examples: training images, canaries not included.
        seed: seed of the data subset, canaries, weights and noise.
        data_dir: directory of the Fashion-MNIST IDX `.gz` files.
        verbose: Keras `fit` verbosity (1: progress bar).

    Returns:
        An `AuditResult` (`membership` on training vs held-out images).

    Example:
    ```python
    result = keras_dp.audit.audit_builtin_task(noise_multiplier=1.0)
    ```
    """
    if canary_kind not in CANARY_KINDS:
        raise ValueError(f"canary_kind must be one of {CANARY_KINDS}; received "
                         f"{canary_kind!r}.")
    (x, y), (x_spare, y_spare), holdout = _builtin_data(
        num_examples, num_canaries, data_dir, np.random.default_rng(seed))
    canaries = {
        "gradient": lambda: GradientCanaries(num_canaries, seed=seed),
        "mislabeled": lambda: ExampleCanaries.mislabeled(x_spare, y_spare, 10, seed=seed),
        "input": lambda: ExampleCanaries.random_inputs(num_canaries, (784,), 10, seed=seed),
    }[canary_kind]()
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)], name="audit_mlp")
    optimizer = optimizers.DPKerasSGD(
        l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
        learning_rate=learning_rate, momentum=0.9)
    return audit_training(
        model, x, y, canaries,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=optimizer, batch_size=batch_size, epochs=epochs, holdout=holdout,
        verbose=verbose)


def _builtin_data(num_examples, num_spare, data_dir, rng):
    """(train, spare, held-out) (x, y) pairs: Fashion-MNIST or generated."""
    if all(os.path.exists(os.path.join(data_dir, name)) for name in _IDX_FILES.values()):
        arrays = {key: _read_idx(os.path.join(data_dir, name))
                  for key, name in _IDX_FILES.items()}
        x_pool, y_pool = arrays["train_images"], arrays["train_labels"]
        x_test, y_test = arrays["test_images"][:1000], arrays["test_labels"][:1000]
    else:  # Ten noisy prototypes, one per class.
        prototypes = rng.random((10, 784))
        y_all = rng.integers(0, 10, num_examples + num_spare + 1000)
        x_all = np.clip(prototypes[y_all] + rng.normal(0, 0.5, (len(y_all), 784)), 0, 1)
        x_pool, y_pool = x_all[:-1000], y_all[:-1000]
        x_test, y_test = x_all[-1000:], y_all[-1000:]
    if not 0 < num_examples <= len(x_pool) - num_spare:
        raise ValueError(f"num_examples must be in [1, {len(x_pool) - num_spare}] "
                         f"(the pool minus the canaries); received {num_examples!r}.")
    order = rng.permutation(len(x_pool))
    train, spare = order[:num_examples], order[num_examples:num_examples + num_spare]

    def prepare(images, labels):
        return (images.reshape(len(images), -1) / 255.0 if images.dtype == np.uint8
                else images).astype(np.float32), labels.astype(np.int32)

    return (prepare(x_pool[train], y_pool[train]), prepare(x_pool[spare], y_pool[spare]),
            prepare(x_test, y_test))


_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


def _read_idx(path):
    """A gzipped IDX file of unsigned bytes (magic 0x00 0x00 0x08 ndim)."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    if data[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path} is not an IDX file of unsigned bytes.")
    ndim = data[3]
    shape = np.frombuffer(data, ">u4", count=ndim, offset=4)
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)
