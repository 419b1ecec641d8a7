"""The audit statistics: one-run audit bounds, Clopper-Pearson, loss thresholds.

Pure numpy and scipy: no Keras, no training. For scores of your own, or
the canaries' scores of `keras_dp.audit.audit_training`.
"""

import dataclasses
import math

import numpy as np
from scipy import special
from scipy import stats

# Fractions f of the m canaries guessed on. Each f gives two candidates: "in"
# for the f * m / 2 highest scores and "out" for as many lowest, or "in" for
# the f * m highest only. The reported bound is the best over the candidates,
# each tested at significance / (number of candidates) (Bonferroni), so
# choosing the best one keeps the overall confidence.
DEFAULT_GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.6, 1.0)
# Beyond this the binomial tail at q = e^eps / (1 + e^eps) is 1 in float64.
_MAX_EPSILON = 50.0
_BISECTION_TOLERANCE = 1e-6


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
