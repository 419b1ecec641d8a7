"""Privacy accounting for DP-SGD: a thin layer over `dp_accounting`.

All privacy arithmetic (RDP and PLD) is done by Google's `dp_accounting`
library. This module only describes the training run as a `dp_accounting`
event, validates the inputs, searches for a noise multiplier, and words the
guarantee. It imports neither Keras nor TensorFlow, so it is cheap to load.

Two batch-sampling schemes are accounted for:

* `"poisson"`: every step includes each example independently with
  probability `q = batch_size / num_examples` (the sampling DP-SGD's
  amplification-by-sampling analysis assumes). One step is a Poisson-subsampled
  Gaussian mechanism; training is `steps` of them.
* `"shuffle"`: each pass over the data is shuffled and cut into batches, so
  every example sits in at most one batch per pass. Amplification by Poisson
  sampling does not hold for this scheme (Chua et al., ICML 2024), and no tight
  bound is known, so we report a sound, unamplified one: each pass releases
  each example through one Gaussian mechanism of noise multiplier `sigma`, and
  the passes compose. This treats neighbouring datasets as differing in one
  example's contribution being present or zeroed out, with batch sizes fixed.
"""

import contextlib
import copy
import functools
import logging
import math
import numbers

import dp_accounting
import numpy as np
from absl import logging as absl_logging
from dp_accounting import pld
from dp_accounting import rdp

from keras_dp import sampling_schemes

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "shuffle")

# RDP orders: every 0.1 from 1.1 to 10.9, every integer from 11 to 63, then
# powers of two to 1024: the grid on which DP-SGD's usual settings reach their
# optimum. Larger orders would only tighten epsilons below about 0.02, and an
# integer order costs time linear in its size, which calibration pays often.
RDP_ORDERS = tuple(
    [1 + x / 10 for x in range(1, 100)]
    + list(range(11, 64))
    + [128, 256, 512, 1024]
)

# Calibration: the returned noise gives an epsilon in
# [(1 - _CALIBRATION_RTOL) * target, target], searched within these bounds.
_CALIBRATION_RTOL = 0.005
_MIN_NOISE = 0.01
_MAX_NOISE = 1000.0


def compute_epsilon(num_examples: int, batch_size: int, noise_multiplier: float,
                    delta: float, epochs: float | None = None, steps: int | None = None,
                    accountant: str = "rdp", sampling: str = "poisson",
                    bands: int = 1) -> float:
    """Computes the epsilon of DP-SGD training at a given delta.

    Give exactly one of `epochs` and `steps`. With `epochs`, the number of
    steps is what `fit(epochs=...)` runs: `ceil(num_examples / batch_size)`
    per epoch (`ceil(epochs * ceil(num_examples / batch_size))` in all).

    With `sampling="shuffle"` the bound is unamplified (see the module
    docstring): `ceil(epochs)` passes when `epochs` is given, otherwise
    `ceil(steps / floor(num_examples / batch_size))` passes, since a pass has
    at least `floor(num_examples / batch_size)` full batches.

    Args:
        num_examples: number of training examples N (an integer > 0).
        batch_size: (expected) batch size B, with `0 < B <= N`.
        noise_multiplier: sigma, the ratio of the Gaussian noise's standard
            deviation to the clipping norm. 0 means no noise: the result is
            `float("inf")` (no privacy), not an error.
        delta: the delta of the (epsilon, delta) guarantee, in (0, 1).
        epochs: number of epochs of `fit` (a number >= 0).
        steps: number of private steps (an integer >= 0).
        accountant: `"rdp"` (Renyi DP, the moments accountant) or `"pld"`
            (privacy loss distributions, usually tighter but slower).
        sampling: `"poisson"` or `"shuffle"`, how batches are drawn.
        bands: b of the optimizer's `keras_dp.BandedMF(bands=b)` noise
            correlation (1: independent noise). With b > 1 (Poisson only),
            fit samples b cyclic groups with q = b * B / N and
            `ceil(ceil(N / B) / b) * b` steps per epoch, and epsilon is
            DP-SGD's for `ceil(steps / b)` steps at that rate.

    Returns:
        Epsilon as a Python float: 0.0 for zero steps, inf for zero noise.

    Example:

    ```python
    compute_epsilon(60000, 256, 1.1, 1e-5, epochs=60)  # about 2.60
    compute_epsilon(60000, 256, 1.1, 1e-5, epochs=60, accountant="pld")  # 2.39
    ```
    """
    _check_run(num_examples, batch_size, delta, accountant, sampling)
    _check_noise_multiplier(noise_multiplier)
    _check_bands(bands, num_examples, batch_size, sampling)
    steps = _resolve_steps(num_examples, batch_size, epochs, steps, bands)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    scheme = _scheme_of_run(sampling, num_examples, batch_size, epochs is not None, bands)
    event = scheme.dp_event(noise_multiplier, scheme.releases(steps))
    return epsilon_of_event(event, float(delta), accountant)


def calibrate_noise_multiplier(target_epsilon: float, num_examples: int,
                               batch_size: int, epochs: float | None, delta: float,
                               accountant: str = "rdp", sampling: str = "poisson", *,
                               steps: int | None = None, bands: int = 1) -> float:
    """Finds the smallest noise multiplier whose epsilon meets a target.

    The result's epsilon (by `compute_epsilon` with the same arguments) is at
    most `target_epsilon` and within 0.5% of it.

    Args:
        target_epsilon: the privacy budget, a finite number > 0.
        num_examples: number of training examples N.
        batch_size: (expected) batch size B.
        epochs: number of epochs of `fit`, > 0, each of
            `ceil(num_examples / batch_size)` steps as `fit` runs them; None
            when `steps` is given.
        delta: the delta of the guarantee, in (0, 1).
        accountant: `"rdp"` or `"pld"`.
        sampling: `"poisson"` or `"shuffle"`.
        steps: the exact number of private steps instead of `epochs`, e.g.
            for a loop of your own or `fit(steps_per_epoch=...)`.
        bands: b of a `keras_dp.BandedMF(bands=b)` noise correlation (see
            `compute_epsilon`).

    Returns:
        The noise multiplier, a Python float.

    Raises:
        ValueError: on invalid arguments, or when no noise multiplier in
            [0.01, 1000] meets `target_epsilon` (too small for the accountant
            to reach, or so large that almost no noise would do).

    Example:

    ```python
    sigma = calibrate_noise_multiplier(3.0, 60000, 256, epochs=60, delta=1e-5)
    ```
    """
    _check_run(num_examples, batch_size, delta, accountant, sampling)
    check_target_epsilon(target_epsilon)
    if steps is None and (not _is_finite_real(epochs) or epochs <= 0):
        raise ValueError(
            f"epochs must be a finite number > 0 for calibration, got "
            f"epochs={epochs!r}.")
    if steps is not None and (epochs is not None or not isinstance(steps, int) or steps <= 0):
        raise ValueError(
            f"Give steps (an integer > 0) or epochs, not both; got epochs={epochs!r}, "
            f"steps={steps!r}.")

    def search(accountant, guess, factor):
        def epsilon_at(noise_multiplier):
            return compute_epsilon(num_examples, batch_size, noise_multiplier,
                                   delta, epochs=epochs, steps=steps,
                                   accountant=accountant, sampling=sampling, bands=bands)

        low, high = _bracket(epsilon_at, target_epsilon, guess, factor)
        return _refine(epsilon_at, target_epsilon, low, high)

    with _rdp_non_convergence_unlogged():
        guess, factor = 1.0, 2.0
        if accountant == "pld":
            # PLD evaluations are slow; RDP's answer is a close (usually slightly
            # larger) starting point, which saves most of PLD's bracketing.
            try:
                guess, factor = search("rdp", guess, factor), 1.1
            except ValueError:  # Beyond RDP's reach; PLD may still reach it.
                pass
        return search(accountant, guess, factor)


def default_delta(num_examples: int) -> float:
    """The default delta: `1 / num_examples ** 1.1`.

    Delta bounds the probability that the epsilon guarantee fails, so it must
    be well below `1 / num_examples` (otherwise releasing one random example
    verbatim would satisfy it). The extra power 0.1 keeps it a safe margin
    below that for any dataset size: about 5.5e-6 for 60,000 examples.

    Args:
        num_examples: number of training examples N (an integer > 0).

    Returns:
        The delta, a Python float.

    Example:

    ```python
    default_delta(60000)  # 5.55e-06
    ```
    """
    check_positive_int("num_examples", num_examples)
    return 1.0 / num_examples ** 1.1


def check_delta(delta: float, num_examples: int) -> None:
    """Raises a ValueError unless `0 < delta < 1 / num_examples`.

    Args:
        delta: the delta to check.
        num_examples: number of training examples N.

    Example:

    ```python
    check_delta(1e-5, 60000)  # passes
    check_delta(1e-3, 60000)  # raises ValueError
    ```
    """
    check_positive_int("num_examples", num_examples)
    if not _is_finite_real(delta) or not 0 < delta < 1 / num_examples:
        raise ValueError(
            f"delta must be a number in (0, 1/num_examples) = (0, "
            f"{1 / num_examples:.3g}), got delta={delta!r}. A larger delta "
            f"allows leaking whole examples; use "
            f"default_delta({num_examples}) = {default_delta(num_examples):.3g}.")


def privacy_statement(epsilon: float, delta: float, accountant: str = "rdp",
                      sampling: str = "poisson", unit: str = "example") -> str:
    """Words an (epsilon, delta) guarantee as one plain-language paragraph.

    Args:
        epsilon: the epsilon, e.g. from `compute_epsilon` (may be inf).
        delta: the delta it was computed at.
        accountant: the accountant used, `"rdp"` or `"pld"`.
        sampling: the batch sampling assumed, `"poisson"` or `"shuffle"`.
        unit: what the guarantee protects: `"example"`, or `"user"` (all
            examples of one user, sampled as a whole: Poisson only).

    Returns:
        The paragraph, a string.

    Example:

    ```python
    print(privacy_statement(2.6, 1e-5))
    ```
    """
    check_choice("accountant", accountant, ACCOUNTANTS)
    check_choice("sampling", sampling, SAMPLINGS)
    check_choice("unit", unit, tuple(_UNIT_WORDS))
    scheme = sampling_schemes.scheme_type(sampling)
    if unit == "user" and scheme is not sampling_schemes.PoissonSampling:
        raise ValueError('User-level privacy is accounted for Poisson sampling over '
                         f'users only; received sampling={sampling!r}. Use "poisson".')
    if math.isinf(epsilon):
        return ("No differential privacy guarantee: training added no noise "
                "(or the accountant found no finite bound), so epsilon is "
                "infinite and the model may reveal its training examples.")
    # Bounds, so rounded up: the statement never claims more privacy than computed.
    epsilon_text, delta_text = format_upper(epsilon, 4, "g"), format_upper(delta, 3, "g")
    factor = format_upper(math.exp(float(epsilon_text)), 3, "g")
    return (
        f"This training run is ({epsilon_text}, {delta_text})-differentially "
        f"private, with {_UNIT_WORDS[unit][0]} as the unit of privacy: "
        f"{scheme.neighbours.replace('example', _UNIT_WORDS[unit][1])} changes the "
        f"probability of any outcome of training by at most a factor of "
        f"e^{epsilon_text} = {factor}, except with probability at most {delta_text}. "
        f"{scheme.assumption.replace('example', _UNIT_WORDS[unit][2])} "
        f"The guarantee covers the training data only, not data used to choose "
        f"hyperparameters, validate or pre-train{_UNIT_WORDS[unit][3]}. Computed with "
        f"{_ACCOUNTANT_NAMES[accountant]} of the dp_accounting library.")


def format_upper(value: float, digits: int, notation: str = "f") -> str:
    """Formats an upper bound (epsilon, delta, a noise multiplier to use) rounded up.

    Rounding to nearest can print less than the bound (2.6003 for 2.600339),
    which would claim more privacy than was computed.

    Args:
        value: the bound; inf prints as "inf".
        digits: decimals (notation "f") or significant digits ("g").
        notation: "f" or "g", as in Python's format specifications.

    Returns:
        The text: the number it shows is at least `value`.

    Example:

    ```python
    format_upper(2.600339, 4)  # "2.6004"
    ```
    """
    return _format_outwards(value, digits, notation, 1)


def format_lower(value: float, digits: int, notation: str = "f") -> str:
    """Formats a lower bound (an audit's empirical epsilon) rounded down.

    Args:
        value: the bound.
        digits: decimals (notation "f") or significant digits ("g").
        notation: "f" or "g".

    Returns:
        The text: the number it shows is at most `value`.
    """
    return _format_outwards(value, digits, notation, -1)


def _format_outwards(value, digits, notation, direction):
    """`value` rounded to nearest, then one last-digit unit up (direction 1) or down
    (-1) if that rounded it the other way."""
    text = f"{value:.{digits}{notation}}"
    printed = float(text)
    if (printed - value) * direction < 0:  # False for inf and nan.
        # The last digit's place, from `value`: 9.9995 to 3 digits rounds to 10.0.
        exponent = (-digits if notation == "f"
                    else math.floor(math.log10(abs(value))) - digits + 1)
        text = f"{printed + direction * 10.0 ** exponent:.{digits}{notation}}"
    return text


# How `privacy_statement` names each unit: as the unit, as the neighbour,
# as what sampling includes, and what the guarantee leaves out.
_UNIT_WORDS = {
    "example": ("one training example", "example", "example",
                "; a person with several examples is protected less"),
    "user": ("one user (all of that user's examples)", "user (all of their examples)",
             "user", ""),
}
_ACCOUNTANT_NAMES = {
    "rdp": "the Renyi DP (moments) accountant",
    "pld": "the privacy loss distribution accountant",
}


def _scheme_of_run(sampling, num_examples, batch_size, by_epochs, bands):
    """The sampling scheme `compute_epsilon` accounts: Poisson at q = B / N
    (cyclic over b groups at b B / N with correlated noise), or shuffled
    passes, each of `ceil(N / B)` steps as fit runs them, or, when counting
    steps, at least the `floor(N / B)` full batches of a pass."""
    if sampling_schemes.scheme_type(sampling) is sampling_schemes.ShuffledPasses:
        return sampling_schemes.ShuffledPasses(
            math.ceil(num_examples / batch_size) if by_epochs else num_examples // batch_size)
    if bands > 1:
        return sampling_schemes.CyclicPoissonSampling(bands * batch_size / num_examples, bands)
    return sampling_schemes.PoissonSampling(batch_size / num_examples)


def epsilon_of_event(event, delta, accountant):
    """The epsilon of a `dp_accounting` event at `delta`, by `accountant`.

    Args:
        event: a `dp_accounting.DpEvent`; a `ComposedDpEvent` is composed
            event by event.
        delta: the delta to report epsilon at, a Python float in (0, 1).
        accountant: `"rdp"` or `"pld"` (not checked here: see `check_choice`).

    Returns:
        Epsilon as a Python float.
    """
    return _epsilon_of_event(event, repr(event), delta, accountant)


# Repeated queries (a callback asking twice, a calibration search) are
# answered once, keyed by the repr too: events equal by value can differ in
# type (noise 2 and 2.0, a float32), which dp_accounting computes differently.
@functools.lru_cache(maxsize=256)
def _epsilon_of_event(event, event_repr, delta, accountant):
    if accountant == "rdp":
        dp_accounting.DpEventBuilder().compose(event)  # dp_accounting's checks of counts.
        total = np.zeros(len(RDP_ORDERS))
        _add_rdp(total, event, 1)
        return float(rdp.rdp_privacy_accountant.compute_epsilon(RDP_ORDERS, total, delta)[0])
    if isinstance(event, dp_accounting.ComposedDpEvent) and event.events:
        *earlier, last = event.events
        composed = copy.deepcopy(_pld_accountant_of(tuple(earlier), repr(tuple(earlier))))
        return float(composed.compose(last).get_epsilon(delta))
    return float(_pld_accountant_of((event,), repr((event,))).get_epsilon(delta))


def _add_rdp(total, event, count):
    """Adds to `total` the RDP of `count` runs of `event` as dp_accounting's
    RdpAccountant does (each event adds `count` times its own RDP, computed
    once here, not per step count asked; counts multiply down the tree and
    events add in order, so the floats are the same)."""
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        _add_rdp(total, event.event, event.count * count)
    elif isinstance(event, dp_accounting.ComposedDpEvent):
        for inner in event.events:
            _add_rdp(total, inner, count)
    elif isinstance(event, (dp_accounting.NoOpDpEvent, dp_accounting.NonPrivateDpEvent)):
        total += _rdp_of_one(event, repr(event))  # 0 or inf whatever the count.
    else:
        total += count * _rdp_of_one(event, repr(event))


@functools.lru_cache(maxsize=256)
def _rdp_of_one(event, event_repr):  # Keyed by the repr too, as `_epsilon_of_event`.
    """The RDP at `RDP_ORDERS` of one run of `event` (read-only)."""
    accountant = rdp.RdpAccountant(RDP_ORDERS)
    accountant.compose(event)
    values = accountant.rdp
    values.setflags(write=False)
    return values


# A budget search grows a ledger's last segment: PLD composes the rest once.
@functools.lru_cache(maxsize=32)
def _pld_accountant_of(events, events_repr):  # Keyed by the repr too, as above.
    composed = pld.PLDAccountant()
    for event in events:
        composed.compose(event)
    return composed


def clear_cache():
    """Forgets every epsilon computed so far (for timing and logging tests)."""
    _epsilon_of_event.cache_clear()
    _rdp_of_one.cache_clear()
    _pld_accountant_of.cache_clear()


class _WithoutRdpNonConvergence(logging.Filter):
    """Drops dp_accounting's "_compute_log_a_frac failed to converge" warnings."""

    def filter(self, record):
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def _rdp_non_convergence_unlogged():
    """Within: dp_accounting's RDP non-convergence warnings are not logged.

    A search tries small noise multipliers, for which the RDP series of some
    small orders fail to converge: dp_accounting then logs a warning, excludes
    that order and returns the minimum over the other orders, still a valid
    epsilon. The warnings say nothing about the search's result (a point
    that is too noisy, or not, either way), yet printed six lines of alarm
    in every calibration.

    Yields:
        None.
    """
    quiet = _WithoutRdpNonConvergence()
    logger = absl_logging.get_absl_logger()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _bracket(epsilon_at, target, guess, factor):
    """Walks from `guess` by `factor` until the target epsilon is bracketed.

    Returns `(low, high)`, each a `(noise, epsilon)` pair, with
    `epsilon(low) > target >= epsilon(high)`.
    """
    point = (guess, epsilon_at(guess))
    # Feasible points walk down towards less noise, infeasible ones up.
    step = 1 / factor if point[1] <= target else factor
    while True:
        noise = min(max(point[0] * step, _MIN_NOISE), _MAX_NOISE)
        if noise == point[0]:
            raise ValueError(_unreachable_message(target, point))
        new = (noise, epsilon_at(noise))
        if (new[1] <= target) != (point[1] <= target):
            low, high = sorted([point, new])
            return low, high
        point = new


def _unreachable_message(target, point):
    noise, epsilon = point
    if epsilon > target:
        return (f"target_epsilon={target!r} cannot be reached: even "
                f"noise_multiplier={noise:g} gives epsilon={epsilon:.4g}. "
                f"Use a larger target_epsilon, fewer epochs or a smaller "
                f"batch_size.")
    return (f"target_epsilon={target!r} is so large that "
            f"noise_multiplier={noise:g} already meets it (epsilon="
            f"{epsilon:.4g}); such a budget gives no meaningful privacy. Use "
            f"a smaller target_epsilon.")


def _refine(epsilon_at, target, low, high):
    """Narrows a bracket until `high`'s epsilon is just below the target."""
    (noise_low, eps_low), (noise_high, eps_high) = low, high
    while (eps_high < target * (1 - _CALIBRATION_RTOL)
           and noise_high / noise_low > 1 + 1e-9):
        noise = _interpolate(noise_low, eps_low, noise_high, eps_high, target)
        eps = epsilon_at(noise)
        if eps <= target:
            noise_high, eps_high = noise, eps
        else:
            noise_low, eps_low = noise, eps
    return noise_high


def _interpolate(noise_low, eps_low, noise_high, eps_high, target):
    """Next noise to try: log-epsilon is close to linear in log-noise."""
    # Aim inside the accepted window, so a good guess ends the search.
    aim = target * (1 - _CALIBRATION_RTOL / 2)
    if math.isfinite(eps_low) and eps_high > 0:
        fraction = math.log(eps_low / aim) / math.log(eps_low / eps_high)
        # Stay off the ends so the bracket always shrinks.
        fraction = min(max(fraction, 0.05), 0.95)
    else:
        fraction = 0.5
    return noise_low * (noise_high / noise_low) ** fraction


def _check_bands(bands, num_examples, batch_size, sampling):
    if not _is_int(bands) or bands < 1:
        raise ValueError(f"bands must be an integer >= 1, got bands={bands!r}.")
    if bands > 1 and sampling_schemes.scheme_type(sampling) is not sampling_schemes.PoissonSampling:
        raise ValueError(
            f"bands={bands} (correlated noise) is accounted with cyclic Poisson "
            'sampling only: use sampling="poisson", or bands=1.')
    if bands * batch_size > num_examples:
        raise ValueError(
            f"bands={bands} times batch_size={batch_size} exceeds num_examples="
            f"{num_examples}: the sampling rate b * B / N would exceed 1. Use fewer "
            "bands or a smaller batch_size.")


def _resolve_steps(num_examples, batch_size, epochs, steps, bands=1):
    if (epochs is None) == (steps is None):
        raise ValueError(
            f"Give exactly one of epochs and steps, got epochs={epochs!r} and "
            f"steps={steps!r}.")
    if steps is not None:
        if not _is_int(steps) or steps < 0:
            raise ValueError(
                f"steps must be an integer >= 0, got steps={steps!r}.")
        return int(steps)
    if not _is_finite_real(epochs) or epochs < 0:
        raise ValueError(
            f"epochs must be a finite number >= 0, got epochs={epochs!r}.")
    # fit's epochs hold whole cycles of the b groups.
    cycles = math.ceil(math.ceil(num_examples / batch_size) / bands)
    return math.ceil(epochs * cycles * bands)


def _check_run(num_examples, batch_size, delta, accountant, sampling):
    """Validates the arguments shared by the accounting functions."""
    check_positive_int("num_examples", num_examples)
    check_positive_int("batch_size", batch_size)
    if batch_size > num_examples:
        raise ValueError(
            f"batch_size must be at most num_examples={num_examples}, got "
            f"batch_size={batch_size!r}. Use a smaller batch_size.")
    check_delta(delta, num_examples)
    check_choice("accountant", accountant, ACCOUNTANTS)
    check_choice("sampling", sampling, SAMPLINGS)


def _check_noise_multiplier(noise_multiplier):
    if not _is_finite_real(noise_multiplier) or noise_multiplier < 0:
        raise ValueError(
            f"noise_multiplier must be a finite number >= 0, got "
            f"noise_multiplier={noise_multiplier!r}. Use "
            f"calibrate_noise_multiplier() to pick one for a target epsilon.")


def check_target_epsilon(target_epsilon):
    """Raises a ValueError unless the budget `target_epsilon` is a finite number > 0."""
    if not _is_finite_real(target_epsilon) or target_epsilon <= 0:
        raise ValueError(
            f"target_epsilon must be a finite number > 0, got "
            f"target_epsilon={target_epsilon!r}. Typical budgets are 1 to 10.")


def check_positive_int(name, value):
    """Raises a ValueError naming the argument `name` unless its `value` is an integer > 0."""
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be an integer > 0, got {name}={value!r}.")


def check_choice(name, value, choices):
    """Raises a ValueError naming the argument `name` unless its `value` is in `choices`."""
    if value not in choices:
        raise ValueError(
            f"Unknown {name}={value!r}; use one of {', '.join(choices)}.")


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite_real(value):
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))
