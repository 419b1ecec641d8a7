"""One readable account of the privacy a private model has spent.

`privacy_report` reads the model's privacy ledger through its public
functions (`privacy_ledger.segments()`, `privacy_spent`, `privacy_unit`):
epsilon and delta, the accountant, the unit of privacy, each run of steps
with its sampling, noise multiplier and sensitivity, the clipping norm, N,
what the guarantee does not cover, and the statement of the guarantee.
`model.privacy_report()` and `keras-dp spent --model FILE` print it.
"""

import math
import warnings

from keras_dp import accounting
from keras_dp import budget
from keras_dp import sampling_schemes

# What no ledger can see, and so no epsilon covers.
_NOT_COVERED = (
    "not covered: the validation data (evaluated without noise), hyperparameter "
    "search (each run on the private data spends privacy of its own), preprocessing "
    "fitted on the private data outside keras-dp (adapt(), a vocabulary, "
    "normalization statistics), decisions made from the training loss and metrics in "
    "the logs (a callback monitoring them), the data of pretraining, and any training of these "
    "weights with a non-private optimizer (e.g. the base model compiled and fit on "
    "its own), which on the private data voids this guarantee.")
_UNIT_NAMES = {"example": "examples", "user": "users"}


def privacy_report(model, delta=None, accountant="rdp"):
    """The privacy spent on a private model's variables, as readable text.

    Args:
        model: a keras-dp private model (trained, or loaded from a file).
        delta: the total delta; default that of `model.privacy_spent`,
            `keras_dp.default_delta(N)` for the ledger's N.
        accountant: `"rdp"` or `"pld"`.

    Returns:
        The report, a string of lines.

    Raises:
        ValueError: as `privacy_spent` does (no default delta without N, a
            delta not below 1 / N, a ledger of mixed units).

    Example:
    ```python
    print(keras_dp.report.privacy_report(private, delta=1e-5))
    ```
    """
    segments = [s for s in model.privacy_ledger.segments() if s.steps]
    num_units = max([s.num_examples for s in segments], default=0)
    if delta is None and num_units:
        delta = accounting.default_delta(num_units)
    with warnings.catch_warnings():  # Why epsilon is infinite is a line of the report.
        warnings.simplefilter("ignore")
        epsilon, _ = model.privacy_spent(delta, accountant)
    unit = model.privacy_unit
    lines = [f"privacy report of {model.name}",
             f"epsilon: {accounting.format_upper(epsilon, 4)} (delta "
             f"{accounting.format_upper(delta, 4, 'g')}), {accountant.upper()} accountant "
             "of dp_accounting",
             f"privacy unit: one {unit}; N = "
             + (f"{num_units:,} {_UNIT_NAMES[unit]}" if num_units else "not recorded"),
             *([f"epsilon is infinite: {budget.infinite_because(segments, delta)}"]
               if math.isinf(epsilon) else []),
             f"private steps: {model.privacy_steps}",
             *_segment_lines(segments),
             _clipping_line(getattr(model, "optimizer", None)),
             _NOT_COVERED]
    if segments:
        lines += ["", accounting.privacy_statement(epsilon, delta, accountant,
                                                   _sampling_of(segments), unit)]
    return "\n".join(lines)


def _segment_lines(segments):
    """One line per run of steps with one mechanism."""
    if not segments:
        return ["no private step yet"]
    return ["runs of steps, each with one mechanism:"] + [
        f"  {number}. {_sampling_words(s)}: {s.steps} steps, noise multiplier "
        f"{s.noise_multiplier:.4g}, sensitivity {s.sensitivity:g} C"
        for number, s in enumerate(segments, 1)]


def _sampling_words(segment):
    batch = f", expected batch {segment.batch_size}" if segment.batch_size else ""
    releases = ("" if segment.releases == segment.steps
                else f", {segment.releases} Gaussian releases")
    return f"{segment.summary()}{batch}{releases}"


def _clipping_line(optimizer):
    clip = getattr(optimizer, "l2_norm_clip", None)
    if clip is None:
        return "clipping norm: unknown (no DP optimizer loaded); sigma is relative to it"
    if isinstance(clip, dict):
        clip = ", ".join(f"{name} {value:g}" for name, value in clip.items())
        return f"clipping norms (per layer, now): {clip}"
    return f"clipping norm C (now): {clip:g}; sigma is relative to it"


def _sampling_of(segments):
    """The sampling the statement words: Poisson unless a training step was
    not (releases of `keras_dp.adapt` sample nothing and need no
    amplification: review round 136, a Poisson run worded as shuffled)."""
    amplified = all(s.sampling_rate for s in segments
                    if getattr(s, "sampling", None) != sampling_schemes.StatisticsRelease.name)
    return (sampling_schemes.PoissonSampling if amplified
            else sampling_schemes.ShuffledPasses).name
