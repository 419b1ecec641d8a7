"""Will a private model learn? Noise-to-signal, a warning before fit, and a plan.

A DP-SGD step clips each unit's gradient (an example's, a user's or a
microbatch's) to norm C, adds N(0, sigma^2 C^2) to every one of the d
trainable weights' coordinates of the clipped sum, and divides by B, the
expected number of units in a logical step. The noise on the averaged
gradient then has norm about sigma * C * sqrt(d) / B, while the averaged
clipped gradient has norm at most C. Their ratio,

    noise-to-signal = sigma * sqrt(d) / B,

says how far the noise hides the direction training needs. Under per-layer
clipping every coordinate gets noise of std sigma * sqrt(sum_l C_l^2) (the
sensitivity) while group l's signal is at most C_l, so the ratio is the
worst group's, sigma * sqrt(sum_k C_k^2) * sqrt(d_l) / (C_l * B): never
below the flat ratio, and equal to it when C_l is proportional to
sqrt(d_l).

The threshold, `NOISE_TO_SIGNAL_LIMIT` = 10, comes from keras-io example
programs made private and trained at epsilon 3 as a new user would (keras-dp
issue #46, 2026-12-03): the MNIST convnet, image classification, time series
and FeatureSpace programs learned (test accuracy 0.73-0.91) with ratios of
0.9 to 5.6; the four text models (20,000 x 128 embeddings trained from
scratch on a few thousand examples at batch 32) ended at chance (0.496-0.507,
against 0.80-0.99 without privacy) with ratios of 17 to 43. 10 is the
geometric middle of that gap (sqrt(5.6 x 17) = 9.8), a factor of about 1.8
from the nearest run on either side. It is a warning sign, not a law: the
ratio leaves out the learning rate, the loss landscape and how many steps
the signal adds up over.

`plan` picks the batch size and epochs that lower the ratio at a target
epsilon, following published evidence on DP-SGD hyperparameters: at a fixed
number of steps, accuracy follows the noise-to-batch ratio sigma / B, and
larger batches lower it (Sander, Stock & Sablayrolles, "TAN without a
burn", ICML 2023; De et al. 2022; Ponomareva et al., "How to DP-fy ML",
JAIR 2023: use the largest batch the compute allows). It keeps the number
of steps and searches larger batches within the compute allowed, and
scales the learning rate with the batch: linearly for SGD (Goyal et al.
2017), by the square root for adaptive optimizers such as Adam (Malladi et
al., NeurIPS 2022). Every noise multiplier comes from
`keras_dp.accounting.calibrate_noise_multiplier` (dp_accounting).
"""

import dataclasses
import math
import warnings
from typing import NamedTuple

import keras
import numpy as np

from keras_dp import accounting
from keras_dp import mechanism

# Above this noise-to-signal ratio a private fit is expected not to learn
# (see the module docstring for the evidence).
NOISE_TO_SIGNAL_LIMIT = 10.0
# The plan's smallest batch when no batch size of yours is given.
_SMALLEST_BATCH = 16
# A plan within this fraction of the lowest ratio found takes the least
# compute: a tenth less noise is not worth twice the epochs.
_TOLERANCE = 0.1
# The compute a plan may use when none is given: this many times your
# epochs.
_DEFAULT_COMPUTE_FACTOR = 10
_UNIT_NAMES = {"example": "examples", "user": "users"}


class PrivacyUtilityWarning(UserWarning):
    """A private fit whose noise is expected to drown the gradient's signal.

    Issued once at the start of a private `fit()` whose noise-to-signal
    ratio, sigma * sqrt(trainable weights) / expected batch, is above
    `keras_dp.planning.NOISE_TO_SIGNAL_LIMIT` (docs/getting_started.md,
    "When the private model does not learn"). Training goes on; the
    guarantee is unchanged. Silence it with
    `warnings.simplefilter("ignore", keras_dp.PrivacyUtilityWarning)`.
    """


def noise_to_signal(noise_multiplier, num_weights, units_per_step, clip_norms=1.0,
                    group_sizes=None):
    """The noise on the averaged gradient relative to its largest signal.

    Args:
        noise_multiplier: sigma: the noise std on the clipped sum over the
            norm that bounds one unit's whole contribution (C, or
            sqrt(sum_l C_l^2) per layer), as the DP optimizer takes it.
        num_weights: d, the trainable weights the noise covers.
        units_per_step: B, what the noisy sum is divided by: the expected
            examples (users, microbatches) of one logical step.
        clip_norms: C, or the norms C_l of the clipping groups.
        group_sizes: the trainable weights d_l of each group, for
            per-layer clipping; None for one group.

    Returns:
        sigma * sqrt(d) / B for one group; for several, the largest
        sigma * sqrt(sum_k C_k^2) * sqrt(d_l) / (C_l * B).

    Example:
    ```python
    noise_to_signal(1.1, 101_770, 256)   # 1.37: a 784-128-10 MLP at batch 256
    ```
    """
    if group_sizes is None:
        return noise_multiplier * math.sqrt(num_weights) / units_per_step
    clips = np.asarray(clip_norms, np.float64).reshape(-1)
    sizes = np.asarray(group_sizes, np.float64)
    worst = np.max(np.sqrt(sizes) / clips) * math.sqrt(np.sum(clips ** 2))
    return noise_multiplier * float(worst) / units_per_step


def model_noise_to_signal(model, units_per_step):
    """`noise_to_signal` of a private model compiled with a DP optimizer.

    Reads sigma, the clipping norms and their groups from the optimizer and
    d from the model's trainable weights.

    Args:
        model: a built private model, compiled with a DP optimizer.
        units_per_step: the expected units (examples, users or
            microbatches) of one logical step: `units_per_step(model)`
            during a fit.

    Returns:
        The ratio, a float.
    """
    optimizer, variables = model.optimizer, model.trainable_variables
    clips = optimizer.privacy_settings()[0]
    groups = optimizer.clipping_bound(clips, variables).groups
    sizes = [math.prod(v.shape) for v in variables]
    group_sizes = (None if groups is None
                   else np.bincount(groups, weights=sizes, minlength=int(clips.shape[0])))
    return noise_to_signal(optimizer.noise_multiplier, sum(sizes), units_per_step,
                           clips.numpy(), group_sizes)


def units_per_step(model):
    """The expected units the noisy sum of one logical step of the fit
    under way is divided by, as the model's step mechanism sets it.

    Poisson batches: the expected examples (users, for user-level
    sampling) of the physical batch, times the gradient accumulation
    steps; fixed-size batches: their size, times those steps. With
    microbatches, their number over the replicas instead, at most.

    Args:
        model: a private model inside `fit()`.

    Returns:
        A float, or 0.0 when the batch size is unknown.
    """
    sampling, optimizer = model.step_mechanism.sampling, model.optimizer
    physical = sampling.expected_batch_size or (
        sampling.info.batch_size if sampling.info and sampling.info.batch_size else 0.0)
    if optimizer.num_microbatches and physical:
        replicas = sampling.info.num_replicas if sampling.info else 1
        physical = min(physical, optimizer.num_microbatches * replicas)
    return float(physical) * optimizer.accumulation_steps


def check_noise_to_signal(model, units):
    """Warns when a private model's noise is expected to drown its signal.

    Args:
        model: a built private model, compiled with a DP optimizer.
        units: the expected units of one logical step (see
            `units_per_step`).

    Returns:
        The noise-to-signal ratio, or None when it does not apply (no
        noise, no trainable weight or an unknown batch size).

    Warns:
        PrivacyUtilityWarning: above `NOISE_TO_SIGNAL_LIMIT`.
    """
    num_weights = sum(math.prod(v.shape) for v in model.trainable_variables)
    sigma = model.optimizer.noise_multiplier
    if not units or not num_weights or not sigma:
        return None
    ratio = model_noise_to_signal(model, units)
    if ratio > NOISE_TO_SIGNAL_LIMIT:
        warnings.warn(
            f"The noise will likely drown the signal in this private fit: noise-to-signal "
            f"sigma * sqrt(d) / B = {ratio:.1f} (sigma {sigma:.3g}, d = {num_weights:,} "
            f"trainable weights, B = {units:g} expected per step; per-layer clipping "
            f"counts its worst layer), above {NOISE_TO_SIGNAL_LIMIT:g}. keras-io programs "
            "made private at epsilon 3 learned at 0.9-5.6 and stayed at chance at 17-43. "
            "Lower it with a larger expected batch (keras_dp.plan picks batch size and "
            "epochs for your epsilon), fewer trainable weights (frozen or pretrained "
            "embeddings, LoRA, a smaller vocabulary) or more data.",
            PrivacyUtilityWarning, stacklevel=2)
    return ratio


class NoiseCheck(keras.callbacks.Callback):
    """Among a private fit's callbacks: `check_noise_to_signal` once, when
    training begins (the model is built and fit's sampling is known)."""

    def on_train_begin(self, logs=None):
        check_noise_to_signal(self.model, units_per_step(self.model))


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What a plan keeps of a model and its optimizer.

    Args:
        num_weights: d, trainable weights.
        clip_norms: C or the per-layer C_l (only their ratios matter).
        group_sizes: d_l per clipping group, or None.
        num_microbatches: the optimizer's, or None.
        accumulation_steps: physical batches per logical step.
        adaptive_optimizer: whether the learning rate scales by the
            square root of the batch (Adam, Adagrad, ...) rather than
            linearly (SGD).
        learning_rate: the optimizer's learning rate, if a number.
    """

    num_weights: int
    clip_norms: tuple = (1.0,)
    group_sizes: tuple | None = None
    num_microbatches: int | None = None
    accumulation_steps: int = 1
    adaptive_optimizer: bool = False
    learning_rate: float | None = None

    @classmethod
    def of(cls, model, num_weights):
        """The setup of `model` (its DP optimizer, if compiled with one), or
        of `num_weights` flat-clipped weights trained with SGD."""
        if model is None:
            if not num_weights:
                raise ValueError("plan needs the model, or num_weights (its trainable "
                                 "weights): pass plan(model=...) or plan(num_weights=...).")
            return cls(int(num_weights))
        variables = model.trainable_variables
        if not variables:
            raise ValueError(
                "plan needs a built model with trainable weights to count them: build it "
                "(model(x[:1]) or keras.Input) first, or pass plan(num_weights=...).")
        sizes = [math.prod(v.shape) for v in variables]
        optimizer = getattr(model, "optimizer", None)
        learning_rate = getattr(optimizer, "learning_rate", None)
        rate = (float(keras.ops.convert_to_numpy(learning_rate))
                if learning_rate is not None and not callable(learning_rate) else None)
        setup = cls(sum(sizes),
                    adaptive_optimizer=(optimizer is not None and not isinstance(
                        optimizer, keras.optimizers.SGD)),
                    learning_rate=rate)
        if not hasattr(optimizer, "privacy_settings"):  # Not compiled with a DP optimizer.
            return setup
        clips = optimizer.privacy_settings()[0]
        groups = optimizer.clipping_bound(clips, variables).groups
        return dataclasses.replace(
            setup, clip_norms=tuple(clips.numpy().tolist()),
            group_sizes=None if groups is None else tuple(np.bincount(
                groups, weights=sizes, minlength=int(clips.shape[0])).tolist()),
            num_microbatches=optimizer.num_microbatches,
            accumulation_steps=optimizer.accumulation_steps)

    def ratio(self, noise_multiplier, logical_batch):
        """The noise-to-signal of a logical batch at this noise multiplier."""
        units = logical_batch
        if self.num_microbatches:
            units = min(logical_batch, self.num_microbatches * self.accumulation_steps)
        return noise_to_signal(noise_multiplier, self.num_weights, units, self.clip_norms,
                               self.group_sizes)

    def sensitivity(self):
        """How many multiples of C one unit moves a step's sum, by the ledger's
        rule for Poisson batches, whose size is not known in advance."""
        return mechanism.sensitivity(self.num_microbatches, None, self.accumulation_steps)

    def learning_rate_scale(self, plan_batch, your_batch):
        """The factor on your learning rate for the plan's batch."""
        factor = plan_batch / your_batch
        return math.sqrt(factor) if self.adaptive_optimizer else factor


@dataclasses.dataclass(frozen=True)
class Plan:
    """A private training run planned for a target epsilon (see `plan`).

    Attributes:
        batch_size: what to pass to `fit(batch_size=...)`: expected
            examples (users) of a physical batch; with gradient
            accumulation over k batches, a logical step has k times as many.
        epochs: what to pass to `fit(epochs=...)`.
        steps: the private (logical) steps those epochs run.
        noise_multiplier: sigma for the DP optimizer, calibrated with
            dp_accounting (with microbatches, times their sensitivity 2).
        noise_to_signal: the run's sigma * sqrt(d) / B (see
            `noise_to_signal`).
        epsilon: the run's epsilon at `delta` (at most `target_epsilon`).
        delta: the delta of the guarantee.
        target_epsilon: the budget planned for.
        num_examples: N, the training examples (users, for `unit="user"`).
        unit: what the guarantee protects: `"example"` or `"user"`.
        accountant: `"rdp"` or `"pld"`.
        learning_rate_scale: the factor on the learning rate of your
            batch size for the plan's (linear for SGD, square root for
            adaptive optimizers), 1.0 without a batch size of yours.
        learning_rate: your optimizer's learning rate times that factor,
            or None when unknown: a start for tuning on validation data.
        your_noise_to_signal: the ratio of your batch size and epochs at
            the same epsilon, or None.
    """

    batch_size: int
    epochs: int
    steps: int
    noise_multiplier: float
    noise_to_signal: float
    epsilon: float
    delta: float
    target_epsilon: float
    num_examples: int
    unit: str = "example"
    accountant: str = "rdp"
    learning_rate_scale: float = 1.0
    learning_rate: float | None = None
    your_noise_to_signal: float | None = None

    @property
    def drowned(self):
        """Whether even this plan's noise-to-signal is above `NOISE_TO_SIGNAL_LIMIT`."""
        return self.noise_to_signal > NOISE_TO_SIGNAL_LIMIT

    def __str__(self):
        lines = [
            f"plan for epsilon {self.target_epsilon:g} (delta "
            f"{accounting.format_upper(self.delta, 3, 'g')}, {self.accountant.upper()}) "
            f"on {self.num_examples:,} {_UNIT_NAMES[self.unit]}",
            f"batch_size: {self.batch_size}",
            f"epochs: {self.epochs} ({self.steps} private steps)",
            f"noise_multiplier: {accounting.format_upper(self.noise_multiplier, 4)} "
            f"(epsilon {accounting.format_upper(self.epsilon, 4)})",
            f"noise-to-signal: {self.noise_to_signal:.2f}" + (
                "" if self.your_noise_to_signal is None
                else f" (yours: {self.your_noise_to_signal:.2f})")
            + f"; models learned below {NOISE_TO_SIGNAL_LIMIT:g}",
            f"learning rate: {self.learning_rate_scale:.3g} x yours" + (
                "" if self.learning_rate is None else f" = {self.learning_rate:.3g}")
            + " (a start for tuning on validation data)",
        ]
        if self.drowned:
            lines.append(
                f"No batch size within the compute allowed brings noise-to-signal below "
                f"{NOISE_TO_SIGNAL_LIMIT:g}: train fewer weights (frozen or pretrained "
                "embeddings, LoRA, a smaller vocabulary), use more data, allow more epochs "
                "(max_epochs) or fewer steps (steps).")
        return "\n".join(lines)


def plan(model=None, *, num_examples, target_epsilon, delta=None, batch_size=None,
         epochs=None, steps=None, max_epochs=None, num_weights=None, unit="example",
         accountant="rdp"):
    """Plans batch size, epochs and noise for a private model to learn at a target epsilon.

    Keeps the number of private steps (yours, or `steps`) and searches the
    batch sizes from yours upward (doubling) with the fewest whole epochs
    that run those steps, within `max_epochs`; each is calibrated to the
    target epsilon with `keras_dp.calibrate_noise_multiplier`. It returns
    the one with the lowest noise-to-signal ratio, or, among those within a
    tenth of it, the one with the fewest epochs. At a fixed number of
    steps, a larger batch lowers the noise on the averaged gradient
    (Sander et al., ICML 2023; Ponomareva et al., JAIR 2023); the learning
    rate hint scales yours with the batch, linearly for SGD (Goyal et al.
    2017) and by the square root for adaptive optimizers (Malladi et al.,
    NeurIPS 2022). Per-layer clipping, microbatches and gradient
    accumulation of the model's DP optimizer count as in training.

    Args:
        model: the model to train (built; private or not). Its DP
            optimizer, if compiled with one, gives the clipping, the
            microbatches and the accumulation; its learning rate, the hint.
        num_examples: N, the training examples (users, for `unit="user"`).
        target_epsilon: the privacy budget.
        delta: the delta; default `keras_dp.default_delta(num_examples)`.
        batch_size: your `fit(batch_size=...)` (examples, or users, per
            physical batch), if you have one: the smallest batch tried.
        epochs: your `fit(epochs=...)`; with `batch_size`, it gives the
            steps to keep and, by default, the compute allowed.
        steps: the private steps to keep, instead of your batch size and
            epochs' (needed without them).
        max_epochs: the compute allowed, in passes over the data; default
            10 times your epochs (100 without them).
        num_weights: d, instead of `model`.
        unit: `"example"` or `"user"` (user-level privacy: N and the
            batch count users).
        accountant: `"rdp"` or `"pld"`.

    Returns:
        A frozen `Plan`; `print(plan)` shows it, and says when even the
        best plan stays above `NOISE_TO_SIGNAL_LIMIT`.

    Raises:
        ValueError: without steps to keep, or when no batch size fits the
            compute allowed, or on arguments the accountant refuses.

    Example:
    ```python
    p = keras_dp.plan(model, num_examples=2000, target_epsilon=3.0,
                      batch_size=32, epochs=2)
    print(p)
    optimizer = keras_dp.DPKerasAdam(l2_norm_clip=1.0,
                                     noise_multiplier=p.noise_multiplier,
                                     learning_rate=p.learning_rate)
    ```
    """
    if unit not in _UNIT_NAMES:
        raise ValueError(f'plan(unit=...) must be "example" or "user"; received {unit!r}.')
    setup = _Setup.of(model, num_weights)
    delta = accounting.default_delta(num_examples) if delta is None else delta
    accounting.check_delta(delta, num_examples)
    accumulation = setup.accumulation_steps
    your_batch = batch_size and batch_size * accumulation
    if your_batch and your_batch > num_examples:
        raise ValueError(
            f"plan's batch_size={batch_size} (times gradient_accumulation_steps="
            f"{accumulation} of the model's optimizer) exceeds the {num_examples} "
            "examples: pass the batch size you give fit, at most num_examples.")
    steps = _steps_to_keep(num_examples, your_batch, epochs, steps)
    if max_epochs is None:
        max_epochs = _DEFAULT_COMPUTE_FACTOR * epochs if epochs else 100
    search = _Search(setup, num_examples, target_epsilon, delta, accountant)
    runs = [(batch, math.ceil(steps / math.ceil(num_examples / batch)))
            for batch in _batches(your_batch or _SMALLEST_BATCH * accumulation, num_examples)]
    candidates = [search.run(batch, run_epochs) for batch, run_epochs in runs
                  if run_epochs <= max_epochs]
    if not candidates:
        raise ValueError(
            f"No batch size runs {steps} private steps within max_epochs={max_epochs:g} "
            f"on {num_examples} examples: allow more epochs (max_epochs) or fewer steps.")
    lowest = min(c.noise_to_signal for c in candidates)
    chosen = min((c for c in candidates if c.noise_to_signal <= (1 + _TOLERANCE) * lowest),
                 key=lambda c: (c.epochs, c.noise_to_signal))
    scale = setup.learning_rate_scale(chosen.batch, your_batch) if your_batch else 1.0
    epsilon = accounting.compute_epsilon(
        num_examples, chosen.batch, chosen.noise_multiplier / setup.sensitivity(), delta,
        epochs=chosen.epochs, accountant=accountant)
    return Plan(chosen.batch // accumulation, chosen.epochs,
                chosen.epochs * math.ceil(num_examples / chosen.batch),
                chosen.noise_multiplier, chosen.noise_to_signal, epsilon, delta,
                target_epsilon, num_examples, unit, accountant, scale,
                setup.learning_rate and setup.learning_rate * scale,
                search.run(your_batch, epochs).noise_to_signal if your_batch and epochs
                else None)


class _Candidate(NamedTuple):
    """A run the plan considers: logical batch, epochs, sigma and its ratio."""

    batch: int
    epochs: float
    noise_multiplier: float
    noise_to_signal: float


@dataclasses.dataclass(frozen=True)
class _Search:
    """Calibrates candidate runs of one setup to the target epsilon."""

    setup: _Setup
    num_examples: int
    target_epsilon: float
    delta: float
    accountant: str

    def run(self, logical_batch, epochs):
        """The `_Candidate` of `epochs` at `logical_batch`, its noise
        multiplier calibrated by dp_accounting (times the sensitivity)."""
        sigma = self.setup.sensitivity() * accounting.calibrate_noise_multiplier(
            self.target_epsilon, self.num_examples, logical_batch, epochs, self.delta,
            self.accountant)
        return _Candidate(logical_batch, epochs, sigma, self.setup.ratio(sigma, logical_batch))


def _steps_to_keep(num_examples, your_batch, epochs, steps):
    """The private steps a plan keeps: `steps`, or those of your batch and epochs."""
    if steps is not None:
        return steps
    if not (your_batch and epochs):
        raise ValueError(
            "plan keeps the number of private steps of your run: pass batch_size and "
            "epochs (your fit's), or steps.")
    return math.ceil(epochs) * math.ceil(num_examples / your_batch)


def _batches(smallest, num_examples):
    """The logical batch sizes tried: `smallest`, doubled while at most N."""
    batch = smallest
    while batch <= num_examples:
        yield batch
        batch *= 2
