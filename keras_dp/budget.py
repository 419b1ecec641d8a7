"""The privacy budget: the epsilon a privacy ledger has spent, at which delta.

Every reader of the privacy spent (`privacy_spent`, `PrivacyCallback`, the
command line) composes a ledger's segments here, with `dp_accounting`.
"""

import math

import dp_accounting

from keras_dp import accounting
from keras_dp import ledger


def epsilon_key(unit):
    """The name epsilon is reported under for a ledger of `unit`: `"epsilon"`
    for examples, `"user_epsilon"` for users (History, progress bar,
    TensorBoard), so a user-level guarantee is never read as another."""
    return "user_epsilon" if unit == "user" else "epsilon"


def epsilon(segments, delta, accountant="rdp"):
    """Epsilon of a sequence of segments, composed with `dp_accounting`.

    Args:
        segments: list of `keras_dp.ledger.Segment`.
        delta: the total delta; the segments' per-step deltas
            (`step_delta() * steps`) are taken from it first.
        accountant: `"rdp"` or `"pld"`.

    Returns:
        `(epsilon, event)`: a float (0.0 without steps, inf when a step had
        no noise, or so little that the noise sampler's tail cap uses up
        delta) and the `dp_accounting.ComposedDpEvent`.

    Raises:
        ValueError: when the truncation deltas use up `delta`, or the
            segments mix example-level and user-level steps (`keras_dp.ledger.unit_of`).
    """
    accounting.check_choice("accountant", accountant, accounting.ACCOUNTANTS)
    segments = [s for s in segments if s.steps]
    ledger.unit_of(segments)
    event = dp_accounting.ComposedDpEvent(tuple(s.dp_event() for s in segments))
    delta_left(segments, delta)
    if not segments:
        return 0.0, event
    left = delta - sum(s.step_delta() * s.steps for s in segments)
    if any(s.noise_multiplier == 0 for s in segments) or left <= 0:
        return math.inf, event
    return accounting.epsilon_of_event(event, left, accountant), event


def delta_left(segments, delta):
    """The delta left once the truncation deltas of padded batches are paid.

    Raises:
        ValueError: when they use up `delta` (fix: a larger delta or
            max_batch_size).
    """
    truncation = sum(s.extra_delta * s.steps for s in segments)
    if truncation >= delta:
        raise ValueError(
            f"delta={delta:.3g} is used up by the truncation probability of padded "
            f"Poisson batches ({truncation:.3g} over the steps, from extra_delta per "
            f"step). Use a larger delta, or a larger max_batch_size for the batches.")
    return float(delta - truncation)
