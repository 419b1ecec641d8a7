"""DP optimizers: any Keras optimizer that applies only privatized gradients.

A DP optimizer holds the privacy parameters (clip, noise, microbatches,
accumulation) and turns a clipped gradient sum into a noisy average. It does
not compute per-example gradients: the private model's train step does, and
hands the clipped sum to `apply_private`. Calling the ordinary `apply` /
`apply_gradients` outside that step is refused, so a DP optimizer can never
train a model whose step did not clip.

`DPOptimizerMixin` is all of this; `make_dp_optimizer_class` composes it with
a Keras optimizer class. The settings its traced step bakes in are one
frozen `DPSettings` (`optimizer.dp_settings`); the noise it adds is its
`privatizer`'s (`keras_dp.noise`).
"""

import contextlib
import dataclasses
import functools
import inspect
import math
import secrets
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_dp import clip_norms
from keras_dp import clipping
from keras_dp import correlated_noise
from keras_dp import distribute
from keras_dp import noise
from keras_dp import optimizer_settings
from keras_dp.optimizer_settings import ClippingRule
from keras_dp.optimizer_settings import DPSettings

_private_apply = threading.local()


@contextlib.contextmanager
def _private_apply_scope():
    """Marks the optimizer calls made by a private train step."""
    previous = getattr(_private_apply, "active", False)
    _private_apply.active = True
    try:
        yield
    finally:
        _private_apply.active = previous


def _check_clipping(clipping_rule, normalize_gamma, norms, num_microbatches):
    clip_norms.check_positive("normalize_gamma", normalize_gamma, "0.01 is the usual choice.")
    if norms.adaptive and clipping_rule == ClippingRule.NORMALIZE:
        raise ValueError(
            'clipping="normalize" scales every gradient to about C, so there is no '
            "clipping norm for AdaptiveClipping to tune: give a number as l2_norm_clip, "
            'or use clipping="flat".')
    if norms.adaptive and num_microbatches is not None:
        raise ValueError(
            "AdaptiveClipping counts the examples within C, one vote each: use "
            "num_microbatches=None (one microbatch per example).")


def _check_noise_multiplier(noise_multiplier):
    if (not _is_real(noise_multiplier) or not math.isfinite(noise_multiplier)
            or noise_multiplier < 0):
        raise ValueError(
            f"noise_multiplier must be a finite number >= 0; received "
            f"noise_multiplier={noise_multiplier!r}. Use "
            "keras_dp.calibrate_noise_multiplier() to pick one for a target epsilon.")
    if noise_multiplier == 0:
        warnings.warn(
            "noise_multiplier=0: this optimizer clips but adds NO noise, so training "
            "is NOT differentially private (epsilon = inf).", stacklevel=3)


def _check_no_loss_scale(loss_scale_factor):
    if loss_scale_factor is not None:
        raise ValueError(
            f"A DP optimizer takes no loss_scale_factor (received {loss_scale_factor!r}): "
            "keras-dp's private step does not scale the loss, so the optimizer would "
            "divide the noised gradients by it (1e-3 made each update 1000 times too "
            "large). Drop it: under mixed precision keras-dp computes the norms and the "
            "clipped sums in float32.")


def _is_real(value):
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def make_dp_optimizer_class(optimizer_class):
    """Returns the DP version of a Keras optimizer class.

    The returned class takes the privacy arguments below, then every argument
    of `optimizer_class` (learning_rate, momentum, ...). It is registered for
    serialization as `keras_dp>DPKeras<Name>`; to load a saved model that uses
    it, call `make_dp_optimizer_class` for the same class before `load_model`.
    An instance's `dp_settings` (a frozen `DPSettings`) holds the privacy
    arguments below that its traced step bakes in.

    Privacy arguments:
        l2_norm_clip: bound C on each example's (microbatch's) gradient norm;
            a dict `{layer_name: C_l}` naming every trainable layer clips per
            layer (sensitivity sqrt(sum_l C_l^2)); `keras_dp.AdaptiveClipping`
            moves C toward a quantile of the norms, privately (see
            `keras_dp.clip_norms`).
        noise_multiplier: sigma; the noise added to the clipped SUM has std
            sigma * C, so the averaged update's noise has std sigma * C / B.
        num_microbatches: None for one microbatch per example; k to split each
            batch into k contiguous microbatches whose mean gradients are
            clipped (the sum is then divided by k).
        gradient_accumulation_steps: k >= 1; clipped sums accumulate over k
            physical batches and noise is added once per logical batch.
        seed: optional int for reproducible noise and Poisson batches. Step t
            of a model draws block t of the model's privacy ledger from the
            stream keyed by the seed, so a model never reuses noise, but two
            models trained with the same seed share theirs: never release
            both. Without a seed the key comes from OS entropy (63 bits).
        clipping: "flat" (default) clips each gradient g to
            g * min(1, C / ||g||); "normalize" scales it to
            g * C / (||g|| + normalize_gamma) (automatic clipping, Bu et al.
            2023): every example moves the sum by about C, so no C to tune
            beyond the learning rate. The sensitivity is C either way.
        normalize_gamma: gamma > 0 of "normalize" (0.01 by default).
        save_seed: write `seed` into `get_config()` (and so into saved
            models), so that a loaded model continues the same noise stream.
            Off by default: anyone who holds the seed can subtract the noise.
        secure_mode: refuse user seeds (noise and batches from OS entropy).
            The noise is still produced by TensorFlow's float32 Gaussian
            sampler, which (like every floating-point sampler) is not a
            perfect Gaussian; see docs/security.md.
        noise_correlation: None (independent noise, DP-SGD) or a
            `keras_dp.BandedMF(bands=b)`: correlated noise of a banded
            matrix factorization, with fit() sampling the examples in b
            cyclic groups (see `keras_dp.correlated_noise`).

    Args:
        optimizer_class: a subclass of `keras.optimizers.Optimizer`.

    Returns:
        The DP optimizer class.

    Example:
    ```python
    DPKerasRMSprop = keras_dp.make_dp_optimizer_class(keras.optimizers.RMSprop)
    opt = DPKerasRMSprop(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=1e-3)
    ```
    """
    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, keras.optimizers.Optimizer)):
        raise TypeError(
            "make_dp_optimizer_class expects a keras.optimizers.Optimizer subclass, "
            f"e.g. keras.optimizers.SGD; received {optimizer_class!r}.")
    if issubclass(optimizer_class, DPOptimizerMixin):
        return optimizer_class
    return _dp_class(optimizer_class)


class DPOptimizerMixin:
    """The privacy of a DP optimizer, composed with a Keras optimizer class.

    `make_dp_optimizer_class(base)` makes the class `DPKeras<Base>` whose
    bases are this mixin and `base`: the mixin takes the privacy arguments
    (see `make_dp_optimizer_class`), turns a clipped gradient sum into a
    noisy average (`apply_private`), and refuses every other `apply`; `base`
    updates the weights. Not meant to be instantiated alone.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        overridden = sorted(name for name in _PRIVATE_PIPELINE
                            if inspect.getattr_static(cls, name)
                            is not DPOptimizerMixin.__dict__[name])
        if overridden:
            raise TypeError(_pipeline_override_message(cls.__name__, overridden))

    def __setattr__(self, name, value):
        # A property's setter checks its value; a method would be shadowed.
        if name in _PRIVATE_PIPELINE and not hasattr(vars(DPOptimizerMixin)[name], "__set__"):
            raise AttributeError(_pipeline_override_message(type(self).__name__, [name]))
        if name in _MECHANISM_STATE and name in vars(self):
            raise AttributeError(
                f"{type(self).__name__}.{name} holds the state of its noise mechanism, made "
                "once with the optimizer: replaced, the step would noise, clip or key "
                "otherwise than the ledger records. Make a new DP optimizer with the "
                "settings you want; change noise_multiplier and l2_norm_clip through "
                "their setters.")
        super().__setattr__(name, value)

    def __init__(self, l2_norm_clip, noise_multiplier, num_microbatches=None,
                 gradient_accumulation_steps=None, seed=None, secure_mode=False,
                 save_seed=False, clipping="flat", normalize_gamma=0.01,
                 noise_correlation=None, **kwargs):
        _check_noise_multiplier(noise_multiplier)
        _check_no_loss_scale(kwargs.get("loss_scale_factor"))
        norms = clip_norms.ClipNorms(clip_norms.deserialize(l2_norm_clip))
        if norms.adaptive:
            norms.adaptive.check_noise(noise_multiplier)
        # gradient_accumulation_steps is not passed on: Keras' own accumulation
        # averages already-noised gradients, adding noise k times; ours
        # accumulates clipped sums and noises once.
        super().__init__(**kwargs)
        # Variables read by the traced step: a new value applies (and is
        # recorded by the privacy ledger) from the next step on.
        self._clip_norms = norms
        self._noise_multiplier = tf.Variable(float(noise_multiplier), dtype=tf.float64,
                                             trainable=False)
        self.replace_dp_settings(DPSettings(
            num_microbatches=num_microbatches,
            accumulation_steps=(1 if gradient_accumulation_steps is None
                                else gradient_accumulation_steps),
            clipping=optimizer_settings.clipping_rule(clipping),
            normalize_gamma=normalize_gamma,
            noise_correlation=correlated_noise.get(noise_correlation),
            seed=seed, secure_mode=bool(secure_mode), save_seed=bool(save_seed)))
        self._privatizer = noise.privatizer_for(self.noise_correlation)
        # The chief's on every worker, so that all replicas add the same noise
        # (keras_dp.distribute).
        self._noise_secret = _NoiseSecret(distribute.chief_value(
            tf.distribute.get_strategy(), secrets.randbits(63)))

    num_microbatches = optimizer_settings.Setting()
    accumulation_steps = optimizer_settings.Setting()
    clipping = optimizer_settings.Setting(optimizer_settings.clipping_rule)
    normalize_gamma = optimizer_settings.Setting()
    seed = optimizer_settings.Setting()
    secure_mode = optimizer_settings.Setting()
    save_seed = optimizer_settings.Setting()

    @property
    def dp_settings(self):
        """The `DPSettings` its traced step bakes in (frozen)."""
        return self._dp_settings

    def replace_dp_settings(self, settings):
        """Checks `settings` (a `DPSettings`) as the constructor does and
        makes them this optimizer's, only before a step is traced with it.
        Its setters (`optimizer.normalize_gamma = 0.1`) call this."""
        if self.built:
            raise ValueError(
                "The settings of a DP optimizer cannot change once a private step has "
                "been traced with it (the step keeps what it read). Compile the model "
                "with a new DP optimizer.")
        if "_dp_settings" in vars(self) and (
                settings.noise_correlation != self._dp_settings.noise_correlation):
            # Review round 92: the step went on adding the constructor's
            # correlated noise, recorded as independent (16.5 against 33.8).
            raise ValueError(
                "noise_correlation is fixed when a DP optimizer is made: its noise "
                "mechanism is built from it. Make a new DP optimizer with the "
                "noise_correlation you want.")
        optimizer_settings.check_settings(settings.num_microbatches,
                                          settings.accumulation_steps, settings.seed,
                                          settings.secure_mode)
        _check_clipping(settings.clipping, settings.normalize_gamma, self._clip_norms,
                        settings.num_microbatches)
        correlated_noise.check_clipping(settings.noise_correlation, self._clip_norms.adaptive)
        self._dp_settings = dataclasses.replace(
            settings, normalize_gamma=float(settings.normalize_gamma))

    @property
    def _noise_key(self):
        """The 64-bit Philox key of the noise stream: the seed's, else the
        optimizer's entropy (read from the settings at each use: review round
        90, a seed dropped for secure_mode kept its key)."""
        seed = self.dp_settings.seed
        return int(self._noise_secret.read()) if seed is None else int(seed)

    @property
    def l2_norm_clip(self):
        """C, the bound on each example's gradient norm (the current one
        under adaptive clipping; `{layer_name: C_l}` per layer); settable."""
        return self._clip_norms.value

    @l2_norm_clip.setter
    def l2_norm_clip(self, value):
        self._clip_norms.value = value

    @property
    def adaptive_clipping(self):
        """The `keras_dp.AdaptiveClipping` in use, or None."""
        return self._clip_norms.adaptive

    @property
    def noise_multiplier(self):
        """sigma, the noise std over C; settable, recorded by the ledger."""
        return float(self._noise_multiplier.numpy())

    @noise_multiplier.setter
    def noise_multiplier(self, value):
        _check_noise_multiplier(value)
        if self.adaptive_clipping:
            self.adaptive_clipping.check_noise(value)
        self._noise_multiplier.assign(float(value))

    def privacy_settings(self):
        """`(clips, sigma)` as float64 tensors, read when the step runs:
        the `[G]` clipping norms (one, or one per layer) and sigma.

        The private model's `keras_dp.mechanism.StepMechanism` reads
        them once per logical step; a change made while a logical step
        is under way applies from the next one.
        """
        return self._clip_norms.tensor(), tf.convert_to_tensor(self._noise_multiplier)

    @property
    def num_clip_norms(self):
        """G, how many clipping norms `privacy_settings` returns."""
        return self._clip_norms.num_groups

    def count_noise_multiplier(self, expected_count):
        """z of adaptive clipping's count for a logical step of
        `expected_count` examples (float64 tensor; 0 without it)."""
        if not self.adaptive_clipping:
            return tf.zeros([], tf.float64)
        return self.adaptive_clipping.count_multiplier_for(expected_count)

    def check_adaptive_noise(self, expected_count):
        """Refuses, in Python before a step, a default count noise
        that leaves the gradient no noise (see `AdaptiveClipping`)."""
        if self.adaptive_clipping:
            self.adaptive_clipping.check_noise(self.noise_multiplier, expected_count)

    def clipping_bound(self, clips, variables):
        """The `keras_dp.clipping.bounds.Bound` of a step whose norms are
        `clips` (the ones its mechanism holds), for `variables`.

        Raises:
            ValueError: per-layer norms that do not cover `variables`.
        """
        settings = self.dp_settings
        gamma = settings.normalize_gamma if settings.clipping == ClippingRule.NORMALIZE else None
        return clipping.Bound(clips, self._clip_norms.groups(variables), gamma)

    @property
    def noise_correlation(self):
        """The `keras_dp.BandedMF` of the noise, or None (DP-SGD)."""
        return self.dp_settings.noise_correlation

    @property
    def privatizer(self):
        """The `keras_dp.noise.Privatizer` that noises each logical step."""
        return self._privatizer

    @property
    def noise_column_norm(self):
        """The largest column norm of the noise's strategy matrix (1.0
        for independent noise): the ledger records sigma over it."""
        return self._privatizer.column_norm

    def start_noise_segment(self):
        """Forgets the correlated noise of earlier steps: the next step starts
        a segment of the strategy (each fit; see `keras_dp.correlated_noise`)."""
        if self.built:
            self._privatizer.start_segment()

    def build(self, variables):
        super().build(variables)
        if self.dp_settings.accumulation_steps > 1:
            self._accumulation = _Accumulation(self, variables)
        self._privatizer.build(variables, _unsaved_zeros)

    def is_mid_logical_step(self):
        """Whether some physical batches of a logical step are accumulated
        but not yet noised and applied."""
        return (self.dp_settings.accumulation_steps > 1 and self.built
                and self._accumulation.is_open())

    def closes_logical_step(self):
        """Whether the physical batch being stepped would be its logical
        step's last, the one that records it (graph code, read before the
        batch accumulates, after `held_over_logical_step` built the
        optimizer; always without accumulation)."""
        if self.dp_settings.accumulation_steps == 1:
            return tf.constant(True)
        return self._accumulation.closes()

    def held_over_logical_step(self, values, variables, opener_index, may_open):
        """`values` as they were at the first physical batch of the
        current logical step (graph code; `values` itself without
        accumulation). So every physical batch of an accumulated step
        is clipped, noised and recorded with one mechanism.

        Args:
            values: a float64 vector.
            variables: the trainable variables (to build the optimizer).
            opener_index: where `values` holds the entry point opening or
                joining the step: a batch joins an open step only if it
                comes from the entry point that opened it.
            may_open: whether this batch may open a logical step (a bool
                tensor).

        Returns:
            `(held, admitted)`: the held vector, and whether this batch
            opens or joins the logical step (a bool tensor); a batch not
            admitted changes nothing (`apply_private` applies nothing).
        """
        if self.dp_settings.accumulation_steps == 1:
            return values, tf.constant(True)
        self._build_outside_the_step(variables)
        return self._accumulation.hold(values, opener_index, may_open)

    def _build_outside_the_step(self, variables):
        """Builds the optimizer eagerly, also when a traced step is the first
        to need it: XLA cannot lift variables created in a traced step and
        read inside its conditional commit."""
        if not self.built:
            with tf.init_scope():
                self.build(variables)

    def abort_logical_step(self):
        """Discards an open accumulated logical step: its partial clipped sum
        is never noised nor released, nothing is recorded, and the next
        physical batch opens a new logical step.

        fit() calls it on every exit; call it after a train_on_batch or
        custom loop that stopped inside a logical step.

        Returns:
            How many physical batches were discarded (0 if none was open).
        """
        if not self.is_mid_logical_step():
            return 0
        return self._accumulation.abort()

    def privatize(self, grad_sum, denominator, noise_stddev, key, noise_block):
        """Noises each clipped sum (the `privatizer`'s noise, from draws of
        std noise_stddev), then divides.

        Args:
            grad_sum: list of clipped sums.
            denominator: what the noisy sums are divided by.
            noise_stddev: sigma * C of the step (float32 scalar).
            key: int64 scalar, the key of the noise stream (`_stream_key`).
            noise_block: int64 scalar, the block of the keyed noise
                stream to draw from: the ledger's counter, which gives
                each step on the model's variables its own and only
                moves forward, so no noise is reused across steps, fits,
                optimizers or a save/load.

        Returns:
            The list of noisy averages.
        """
        noisy = self._privatizer.noised(grad_sum, noise_stddev, key,
                                        tf.cast(noise_block, tf.int64))
        return [g / tf.cast(denominator, g.dtype) for g in noisy]

    def _stream_key(self, step):
        """The key of the step's noise stream: the optimizer's, and, unless
        its seed fixes it, the id of the ledger the step records into, whose
        counter numbers the blocks. One optimizer may train the variables of
        several ledgers, each counting from 0 (review round 60: two private
        models of disjoint variables compiled with one optimizer drew the
        same noise, and the difference of their updates was the clipped sum
        without noise). A seed gives the same noise to every model it
        trains, as documented."""
        seed = self.dp_settings.seed
        if seed is not None:
            return tf.constant(int(seed), tf.int64)
        # Read from a variable: a constant in the traced step would be in
        # every dump of it (review round 179: XLA's compiled program in a
        # TensorBoard profile gave the key, then every step's noise).
        return tf.bitwise.bitwise_xor(self._noise_secret.read(),
                                      tf.constant(step.noise_stream, tf.int64))

    def apply_private(self, grad_sum, denominator, variables, extra_grads, step,
                      centered_within=None):
        """Privatizes a clipped sum and applies it (every k-th call).

        Args:
            grad_sum: list of clipped per-example gradient sums, over
                all replicas (the same on every replica).
            denominator: expected number of examples (microbatches) in
                one physical batch, over all replicas.
            variables: the trainable variables, aligned with `grad_sum`.
            extra_grads: data-independent gradients (regularizers) added
                after privatization, or None.
            step: the `keras_dp.mechanism.FixedStep` of the logical
                step: its noise std, and its record in the ledger, which
                gives the noise block and which the weights change after.
            centered_within: adaptive clipping's count over all
                replicas (`keras_dp.clipping.bounds.ClippedSum`), or None.
        """
        self._build_outside_the_step(variables)
        centered_within = tf.zeros([]) if centered_within is None else centered_within
        apply = (self._apply_noisy if self.dp_settings.accumulation_steps == 1
                 else self._accumulate_then_apply)
        # A step that cannot vouch for its mechanism applies, records and
        # accumulates nothing (data flow, which XLA keeps; `step.refusal`).
        distribute.run_if(step.vouched, apply, grad_sum, centered_within, denominator,
                          variables, extra_grads, step)

    def _apply_noisy(self, grad_sum, centered_within, denominator, variables,
                     extra_grads, step):
        noise_block, recorded = step.record(grad_sum)
        grads = self.privatize(grad_sum, denominator, step.noise_stddev,
                               self._stream_key(step), noise_block)
        if extra_grads is not None:
            grads = [g + e for g, e in zip(grads, extra_grads)]
        # Nothing of the update (weights, iterations, C) runs unless the
        # ledger holds the step.
        with tf.control_dependencies([recorded]), _private_apply_scope():
            self.apply(grads, variables)
            if self.adaptive_clipping:
                self._adapt_clip(centered_within, denominator, step, noise_block)

    def _adapt_clip(self, centered_within, denominator, step, noise_block):
        """C of the next logical step, from this one's noised count."""
        count_noise = noise.gaussian(1, step.count_noise_stddev, self._stream_key(step),
                                     noise.count_noise_block(noise_block))[0]
        fraction = (centered_within + count_noise) / tf.cast(denominator, tf.float32) + 0.5
        # From the step's own C, held since its first batch.
        self._clip_norms.assign(self.adaptive_clipping.next_clip(step.bound.clips, fraction))

    def _accumulate_then_apply(self, grad_sum, centered_within, denominator, variables,
                               extra_grads, step):
        is_last = self._accumulation.add(grad_sum, centered_within)

        def apply_and_reset(denominator, extra_grads):
            total, centered_total = self._accumulation.total()
            # Emptied before the update runs: nothing the update calls (an
            # overridden apply) finds the un-noised sum in the optimizer.
            self._accumulation.reset()
            steps = self.dp_settings.accumulation_steps
            self._apply_noisy(total, centered_total, denominator * steps, variables,
                              extra_grads, step)

        # Applies across replicas too (a plain tf.cond cannot hold Keras'
        # cross-replica apply).
        distribute.run_if(is_last, apply_and_reset, denominator, extra_grads)

    def save_own_variables(self, store):
        if self.is_mid_logical_step():
            warnings.warn(
                "Saving in the middle of an accumulated logical step: its "
                "partial clipped sum is not noised, so it is not saved. A "
                "restored optimizer starts a new logical step.", stacklevel=2)
        super().save_own_variables(store)

    def load_own_variables(self, store):
        """Keras' `load_own_variables`, which skips a saved state that does not
        match this optimizer's (another momentum, say) with a warning; a DP
        optimizer that has taken steps refuses instead: the loaded weights
        would move on with the state of this optimizer's own noised sums, a
        history the file's ledger does not hold (review round 25: 4.70
        reported against 5.41)."""
        if len(store.keys()) != len(self.variables) and int(self.iterations.numpy()):
            raise ValueError(
                f"The file's optimizer state ({len(store.keys())} variables) does not "
                f"match this optimizer's ({len(self.variables)}), which has taken steps: "
                "the loaded weights would go on with this optimizer's own state, trained "
                "on steps outside the file's privacy ledger. Compile with the optimizer "
                "the file was saved with, or load into a model that has not trained.")
        super().load_own_variables(store)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Keras sums the gradients of the replicas here. The private step
        # summed the clipped gradients before adding the noise, so every
        # replica already holds the same noisy average; summing it again
        # would multiply the update by the number of replicas.
        return grads_and_vars

    def apply(self, grads, trainable_variables=None):
        if not getattr(_private_apply, "active", False):
            raise RuntimeError(
                f"{type(self).__name__} only applies privatized gradients, but it "
                "was called by an ordinary (non-private) training step: Keras' own, or "
                "a loop of your own (GradientTape, then apply_gradients), whose "
                "gradients nothing clipped. Wrap the model with "
                "keras_dp.make_private(model) (or build it as keras_dp.DPModel / "
                "keras_dp.DPSequential) before compile(); in a loop of your own, train "
                "with private.train_on_batch(x, y), or iterate "
                "keras_dp.custom_loops.PrivateSteps(model, optimizer, loss, dataset), "
                "keras-io's loop from scratch made private.")
        return super().apply(grads, trainable_variables)

    def get_config(self):
        config = super().get_config()
        settings = self.dp_settings
        config.update(
            l2_norm_clip=self._clip_norms.config(),
            noise_multiplier=self.noise_multiplier,
            num_microbatches=settings.num_microbatches,
            gradient_accumulation_steps=settings.accumulation_steps,
            seed=settings.seed if settings.save_seed else None,
            save_seed=settings.save_seed,
            secure_mode=settings.secure_mode,
            clipping=settings.clipping.value,
            normalize_gamma=settings.normalize_gamma,
            noise_correlation=(keras.saving.serialize_keras_object(settings.noise_correlation)
                               if settings.noise_correlation else None),
        )
        return config


# What a DP optimizer does between the clipped sum's release by the step and
# its noise, and what it tells the step's mechanism: a subclass (or an
# instance attribute) replacing any of it would receive the un-noised sum,
# or could scale it, keep it or noise it otherwise than the ledger records,
# and no check of the traced step could tell. Only `__init__`, `build`,
# `apply` (which receives the noised average), `get_config` and saving may
# be overridden.
_PRIVATE_PIPELINE = frozenset(
    name for name in vars(DPOptimizerMixin)
    if name not in {"__init__", "__init_subclass__", "__setattr__", "build", "apply",
                    "get_config", "save_own_variables", "load_own_variables"}
    and not name.startswith("__"))


# The state of the mechanism, each made once (in __init__ or build) and never
# replaced: the noise, its key, the clipping norms, sigma, the accumulated sums.
_MECHANISM_STATE = frozenset({"_privatizer", "_noise_secret", "_clip_norms",
                              "_noise_multiplier", "_accumulation"})


def _pipeline_override_message(class_name, names):
    return (f"{class_name} overrides {', '.join(names)} of its DP optimizer, which "
            "handles the un-noised clipped sum or the step's mechanism: the privacy "
            "guarantee could not hold. To change how the weights move, subclass the "
            "Keras optimizer and call keras_dp.make_dp_optimizer_class on your class "
            "(its update sees only noised gradients), or override apply().")


@functools.cache  # One class per base, so that its registered name is its own.
def _dp_class(base):
    name = f"DPKeras{base.__name__}"
    doc = (f"Differentially private `keras.optimizers.{base.__name__}`.\n\n"
           + make_dp_optimizer_class.__doc__.split("Args:")[0])
    dp_class = type(name, (DPOptimizerMixin, base),
                    {"__doc__": doc, "__module__": __name__, "__qualname__": name})
    return keras.saving.register_keras_serializable(package="keras_dp", name=name)(dp_class)


class _Accumulation:
    """The state of an accumulated logical step, never saved.

    The clipped sums of its physical batches so far and adaptive clipping's
    count (data-dependent and not yet noised: no save path may write them),
    the count of physical batches, and the mechanism held since its first batch. Its variables
    are not the optimizer's (Keras saves those), and this plain object is
    no trackable, so TensorFlow checkpoints do not reach them either. Made
    in the optimizer's build, they follow its distribution strategy.
    """

    def __init__(self, optimizer, variables):
        from keras_dp import mechanism  # The size of the held mechanism.

        self._steps = optimizer.dp_settings.accumulation_steps
        self.sums = [_unsaved_zeros(v.shape, v.dtype, "dp_accumulated") for v in variables]
        self.centered_within = _unsaved_zeros((), "float32", "dp_accumulated_count")
        self.physical_steps = _unsaved_zeros((), "int64", "dp_physical_steps")
        self.held_values = _unsaved_zeros((mechanism.held_size(optimizer.num_clip_norms),),
                                          "float64", "dp_held_mechanism")

    def is_open(self):
        return int(self.physical_steps.numpy()) % self._steps != 0

    def closes(self):
        """Whether the next physical batch added is the logical step's last."""
        return tf.equal(self.physical_steps % self._steps, self._steps - 1)

    def hold(self, values, opener_index, may_open):
        """The values held since the logical step's first batch, and whether
        this batch is admitted: it opens a step (none is open and it may), or
        joins the open one (it comes from the entry point that opened it)."""
        is_open = tf.not_equal(self.physical_steps % self._steps, 0)
        joins = tf.logical_and(is_open, tf.equal(self.held_values[opener_index],
                                                 values[opener_index]))
        opens = tf.logical_and(tf.logical_not(is_open), may_open)
        self.held_values.assign(tf.where(opens, values, self.held_values))
        return tf.convert_to_tensor(self.held_values), tf.logical_or(joins, opens)

    def abort(self):
        """Discards the open logical step (eager); returns its batches."""
        discarded = int(self.physical_steps.numpy()) % self._steps
        self.reset()
        self.physical_steps.assign(0)
        return discarded

    def add(self, grad_sum, centered_within):
        """Adds a physical batch's clipped sums and count; True at the
        logical step's last."""
        for total, g in zip(self.sums, grad_sum):
            total.assign_add(g)
        self.centered_within.assign_add(centered_within)
        self.physical_steps.assign_add(1)
        return tf.equal(self.physical_steps % self._steps, 0)

    def total(self):
        return ([tf.convert_to_tensor(total) for total in self.sums],
                tf.convert_to_tensor(self.centered_within))

    def reset(self):
        for total in self.sums + [self.centered_within]:
            total.assign(tf.zeros_like(total))


class _NoiseSecret:
    """The noise stream's secret entropy in a variable the step reads, never
    saved (a plain object, as `_Accumulation`: no checkpoint reaches it), so
    no traced function, compiled program or profile of the step holds it."""

    def __init__(self, entropy):
        self._value = _unsaved_zeros((), "int64", "dp_noise_secret")
        self._value.assign(entropy)

    def read(self):
        return tf.convert_to_tensor(self._value)


def _unsaved_zeros(shape, dtype, name):
    return keras.Variable(np.zeros(shape, dtype), trainable=False, name=name, autocast=False)


DPKerasSGD = make_dp_optimizer_class(keras.optimizers.SGD)
DPKerasAdam = make_dp_optimizer_class(keras.optimizers.Adam)
DPKerasAdagrad = make_dp_optimizer_class(keras.optimizers.Adagrad)


def is_dp_optimizer(optimizer):
    """True for instances of classes made by `make_dp_optimizer_class`."""
    return isinstance(optimizer, DPOptimizerMixin)
