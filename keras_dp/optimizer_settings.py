"""The settings of a DP optimizer that its traced step bakes in (`DPSettings`),
and their checks: one frozen value, replaced only before a step is traced."""

import dataclasses
import enum
import numbers

from keras_dp import correlated_noise


class ClippingRule(str, enum.Enum):
    """How a step bounds each example's gradient g by C (the `clipping` argument)."""

    FLAT = "flat"  # g * min(1, C / ||g||)
    NORMALIZE = "normalize"  # g * C / (||g|| + gamma)


@dataclasses.dataclass(frozen=True)
class DPSettings:
    """The settings of a DP optimizer that its traced step bakes in.

    Read as `optimizer.dp_settings` by the step, fit()'s sampling, the
    clipping engines and the callbacks. Not among them: C and sigma, variables
    the step reads once per logical step (`optimizer.privacy_settings()`),
    and the noise's state (`optimizer.privatizer`).

    Example:
    ```python
    optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                    gradient_accumulation_steps=4)
    optimizer.dp_settings.accumulation_steps  # 4
    ```
    """

    num_microbatches: int | None  # None: one microbatch per example.
    accumulation_steps: int  # Physical batches per logical step (1: none).
    clipping: ClippingRule
    normalize_gamma: float  # Gamma of ClippingRule.NORMALIZE.
    noise_correlation: correlated_noise.BandedMF | None  # None: independent noise.
    seed: int | None  # Of the noise stream and fit()'s batches; None: OS entropy.
    secure_mode: bool  # Seeds refused: noise and batches from OS entropy.
    save_seed: bool  # get_config writes the seed.


class Setting:
    """A field of a DP optimizer's `dp_settings`, assignable (and checked)
    only before the optimizer is built: a traced step keeps what it read."""

    def __init__(self, convert=None):
        self._convert = convert

    def __set_name__(self, owner, name):
        self._name = name

    def __get__(self, optimizer, owner=None):
        return self if optimizer is None else getattr(optimizer.dp_settings, self._name)

    def __set__(self, optimizer, value):
        if optimizer.built:
            raise ValueError(
                f"{self._name} of a DP optimizer cannot change once a private step has "
                "been traced with it (the step keeps what it read, the ledger and the "
                "sampler would read the new value). Compile the model with a new DP "
                f"optimizer built with {self._name}={value!r}.")
        value = self._convert(value) if self._convert else value
        # Checked as the constructor checks them (review round 90: a negative
        # normalize_gamma, refused there, was accepted here: 100 C moved).
        optimizer.replace_dp_settings(
            dataclasses.replace(optimizer.dp_settings, **{self._name: value}))


def check_settings(num_microbatches, gradient_accumulation_steps, seed, secure_mode):
    for name, value in (("num_microbatches", num_microbatches),
                        ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(
                f"{name} must be None or an integer >= 1; received {name}={value!r}.")
    if secure_mode and seed is not None:
        raise ValueError(
            "secure_mode=True draws noise from OS entropy and refuses a user "
            f"seed; received seed={seed!r}. Drop the seed or set secure_mode=False.")
    if seed is not None and not _is_int(seed):
        raise ValueError(f"seed must be None or an integer; received seed={seed!r}.")


def clipping_rule(clipping):
    try:
        return ClippingRule(clipping)
    except ValueError:
        raise ValueError(f'clipping must be "flat" or "normalize"; received '
                         f"clipping={clipping!r}.") from None


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
