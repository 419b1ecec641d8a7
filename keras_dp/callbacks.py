"""A Keras callback that reports the privacy spent by training, and caps it."""

import dataclasses
import math
import warnings

import keras
import tensorflow as tf

from keras_dp import accounting
from keras_dp import distribute
from keras_dp import ledger


@keras.saving.register_keras_serializable(package="keras_dp")
class PrivacyCallback(keras.callbacks.Callback):
    """Reports epsilon after every epoch and stops before a budget is exceeded.

    After each epoch, `logs["epsilon"]` is set to the epsilon of every
    private step the model has taken (`model.privacy_spent`): the privacy
    ledger records each step's sampling, noise multiplier and sensitivity as
    it ran, whichever fit or loop ran it, and is saved with the model, so a
    resumed run keeps counting. It then shows in the `History`, the progress
    bar, and the logs seen by the callbacks that come after this one. For
    user-level privacy (`fit(..., user_ids=...)`) the key is
    `logs["user_epsilon"]`: the guarantee protects all rows of a user.

    Put `PrivacyCallback` before `keras.callbacks.CSVLogger`,
    `keras.callbacks.TensorBoard` and any other callback that records logs:
    Keras hands one shared logs dict to the callbacks in list order, so those
    placed earlier have already written their row without `epsilon`.
    (`History` and the progress bar always run last.) A private model's
    `fit()` moves it first.

    Requires a keras-dp private model (`keras_dp.DPModel`, `DPSequential` or
    `make_private`).

    With shuffled batches (`sampling="shuffle"`), the reported epsilon is the
    unamplified bound of `keras_dp.accounting` (a warning says so).

    Args:
        delta: the delta of the reported (epsilon, delta) guarantee. Must be
            in (0, 1 / num_examples). Defaults to
            `keras_dp.accounting.default_delta(num_examples)`. Padded Poisson
            batches are truncated with a tiny probability `extra_delta` per
            step; epsilon is then computed at
            `delta - steps * extra_delta`, so that `delta` stays the total.
        num_examples: number of training examples, for the default delta
            and to check that delta < 1 / N. Only needed without `delta`
            when the ledger does not record it (a dataset not made by
            `keras_dp.data.poisson_dataset`).
        target_epsilon: optional privacy budget, never exceeded. Training
            stops at the end of the last epoch whose successor would exceed
            it (or, should an epoch's length be unknown or its mechanism
            change, after the last step that stays within it), and `fit()`
            raises a ValueError if even the first epoch would exceed it.
        accountant: `"rdp"` or `"pld"`.
        log_dir: optional directory for TensorBoard scalars:
            `privacy/epsilon` per epoch and `privacy/epsilon_by_step` per
            private step (`privacy/user_epsilon...` for user-level
            privacy). Under a multi-worker strategy only the chief writes
            them (every worker reports the same epsilon).

    Example:

    ```python
    model.fit(x, y, batch_size=256, epochs=60, callbacks=[
        keras_dp.PrivacyCallback(delta=1e-5, target_epsilon=3.0),
        keras.callbacks.CSVLogger("training.csv"),
    ])
    model.history.history["epsilon"]
    ```
    """

    def __init__(self, delta=None, num_examples=None, target_epsilon=None,
                 accountant="rdp", log_dir=None):
        super().__init__()
        accounting._check_choice("accountant", accountant, accounting.ACCOUNTANTS)
        if num_examples is not None:
            accounting._check_positive_int("num_examples", num_examples)
        if delta is not None and num_examples is not None:
            accounting.check_delta(delta, num_examples)
        if target_epsilon is not None:
            accounting._check_target_epsilon(target_epsilon)
        self.delta = delta
        self.num_examples = num_examples
        self.target_epsilon = target_epsilon
        # Without a budget its batch hook does nothing: Keras may then run
        # the batch callbacks off the training thread.
        self.async_safe = target_epsilon is None
        self.accountant = accountant
        self.log_dir = log_dir
        # The latest reported epsilon.
        self.epsilon = None
        self._delta = None
        self._allowance = {}
        # Set by a look-ahead check before an execution, read once after it.
        self._next_execution_fits = False
        self._writer = None

    def on_train_begin(self, logs=None):
        self._next_execution_fits = False
        ledger_of(self.model)
        upcoming = self.model.step_mechanism.next_segment()
        self._delta = self._resolve_delta(upcoming)
        self._warn(upcoming)
        # Fail now, not after hours, if this fit() would use up delta or
        # exceed the budget in its first epoch.
        epochs = (self.params or {}).get("epochs") or 1
        ledger.delta_left(self._after(upcoming, epochs * (self._steps_per_epoch() or 1)),
                          self._delta)
        if self.target_epsilon is not None and self._next_epoch_exceeds():
            epsilon = self._epsilon(self._after(upcoming, self._steps_per_epoch() or 1))
            raise ValueError(
                f"target_epsilon={self.target_epsilon} would be exceeded by the "
                f"first epoch: epsilon would reach {epsilon:.4g}. Increase the "
                f"noise_multiplier (see keras_dp.calibrate_noise_multiplier), "
                f"reduce the batch_size, or raise target_epsilon.")
        # Every worker of a cluster holds the same ledger, hence the same
        # epsilon; one set of TensorBoard logs is enough.
        if self.log_dir is not None and distribute.is_chief(self.model.distribute_strategy):
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def check_next_steps(self, steps=None, look_ahead=False):
        """Refuses the next execution if it could exceed the budget.

        A private model's fit calls it after every other callback's
        `on_train_batch_begin`, whatever their order: the checks after each
        execution and epoch looked ahead, so only a setting changed since
        (by a callback) can fail here, and Keras runs the execution
        whatever stop_training says.

        Args:
            steps: the private steps about to run; default: an execution's.
            look_ahead: True when nothing but the execution runs between
                this call and this callback's `on_train_batch_end` (fit
                puts this callback's batch hooks first). The check then also
                asks whether a second execution would fit; if it does,
                `on_train_batch_end` knows that the next execution fits
                (the one in between took at most an execution's steps of
                the mechanism checked) without reading the ledger again.

        Raises:
            RuntimeError: before the steps run; no weight or ledger changes.
        """
        self._next_execution_fits = False
        if self.target_epsilon is None:
            return
        execution = steps or self._steps_per_execution()
        counts = [execution, 2 * execution] if look_ahead and steps is None else [execution]
        exceeds = self._next_steps_exceed(*counts)
        if exceeds[0]:
            raise RuntimeError(
                f"target_epsilon={self.target_epsilon} would be exceeded by the next "
                "steps: a callback changed the noise multiplier or sampling after "
                "PrivacyCallback's last check, and Keras runs the next "
                "steps_per_execution batches whatever stop_training says. Training "
                "stopped before them; change such settings between fit() calls, or "
                "raise target_epsilon.")
        self._next_execution_fits = len(exceeds) > 1 and not exceeds[1]

    def on_train_batch_end(self, batch, logs=None):
        # Keras calls this once per execution of steps_per_execution batches.
        next_fits, self._next_execution_fits = self._next_execution_fits, False
        if (self.target_epsilon is not None and not next_fits
                and self._next_steps_exceed(self._steps_per_execution())[0]):
            self._stop("the next step")

    def on_epoch_end(self, epoch, logs=None):
        self._next_execution_fits = False
        self.epsilon, _ = self.model.privacy_spent(self._delta, self.accountant)
        # Mutating the shared dict is what makes epsilon reach History, the
        # progress bar and the callbacks listed after this one.
        if logs is not None:
            logs[self._key()] = self.epsilon
        self._write_summaries(epoch, self.model.privacy_steps)
        last_epoch = epoch + 1 >= (self.params or {}).get("epochs", math.inf)
        if self.target_epsilon is not None and not last_epoch and self._next_epoch_exceeds():
            self._stop("another epoch")

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def get_config(self):
        return {
            "delta": self.delta,
            "num_examples": self.num_examples,
            "target_epsilon": self.target_epsilon,
            "accountant": self.accountant,
            "log_dir": self.log_dir,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def _resolve_delta(self, upcoming):
        recorded = max([s.num_examples for s in self._segments() + [upcoming]])
        if self.num_examples and recorded and self.num_examples != recorded:
            warnings.warn(
                f"PrivacyCallback(num_examples={self.num_examples}) differs "
                f"from the {recorded} examples the model trains on; "
                f"accounting uses {recorded}.", stacklevel=3)
        num_examples = recorded or self.num_examples
        if num_examples is None and self.delta is not None:
            return self.delta  # Stated; below 1 / N is then the user's to check.
        if num_examples is None:
            raise ValueError(
                "The number of training examples is unknown (the data was not "
                "drawn by keras_dp.data.poisson_dataset or from arrays): pass "
                "PrivacyCallback(num_examples=...).")
        delta = accounting.default_delta(num_examples) if self.delta is None else self.delta
        accounting.check_delta(delta, num_examples)
        return delta

    def _warn(self, upcoming):
        if upcoming.noise_multiplier == 0:
            warnings.warn(
                "noise_multiplier is 0: this training is NOT differentially "
                "private; PrivacyCallback reports epsilon = inf.",
                stacklevel=3)

    def _segments(self):
        return ledger_of(self.model).segments()

    def _key(self):
        """The name of the reported epsilon (`ledger.epsilon_key`)."""
        return ledger.epsilon_key(self.model.privacy_unit)

    def _epsilon(self, segments):
        return ledger.epsilon(segments, self._delta, self.accountant)[0]

    def _after(self, segment, steps, left_in_pass=0.0, segments=None):
        """The ledger (`segments`, default: read now) after `steps` more
        steps of `segment`'s mechanism."""
        segments = self._segments() if segments is None else segments
        return ledger.extended(segments, segment, steps,
                               ledger.releases_of(segment, steps, left_in_pass))

    def _next_steps_exceed(self, *counts):
        """For each count of private steps, whether that many more steps
        could exceed the budget (the ledger is read once for all)."""
        segment = self.model.step_mechanism.next_segment()
        segments = self._segments()
        if segment.sampling == "poisson":
            allowance = self._poisson_allowance(segment, segments)
            return [allowance < steps for steps in counts]
        left = 0.0  # An execution stays within its epoch, and so in its pass.
        if segments and segments[-1].same_mechanism(segment):
            left = ledger_of(self.model).steps_left_in_open_pass()
        return [self._epsilon(self._after(segment, steps, left, segments)) > self.target_epsilon
                for steps in counts]

    def _next_epoch_exceeds(self):
        segment = self.model.step_mechanism.next_segment()
        # Unknown length: its first execution; on_train_batch_end checks on.
        steps = self._steps_per_epoch() or self._steps_per_execution()
        if segment.sampling == "poisson":
            return self._poisson_allowance(segment, self._segments()) < steps
        return self._epsilon(self._after(segment, steps)) > self.target_epsilon

    def _poisson_allowance(self, segment, segments):
        """How many more Poisson steps of `segment`'s mechanism stay in
        budget after `segments`."""
        done = 0
        if segments and segments[-1].same_mechanism(segment):
            done = segments[-1].steps
            segments = segments[:-1]
        key = (tuple(segments), segment.row())
        if key not in self._allowance:
            self._allowance[key] = self._max_steps(segments, segment)
        return self._allowance[key] - done

    def _max_steps(self, segments, segment):
        """The most steps of `segment` after `segments` within the budget."""
        def epsilon_after(steps):
            return self._epsilon(
                segments + [dataclasses.replace(segment, steps=steps, releases=steps)])

        return accounting.max_steps_within(epsilon_after, self.target_epsilon)

    def _steps_per_execution(self):
        """Private (logical) steps Keras runs between two batch callbacks."""
        return math.ceil(getattr(self.model, "steps_per_execution", 1)
                         / self.model.optimizer.accumulation_steps)

    def _steps_per_epoch(self):
        """Private (logical) steps in one epoch of this fit(), or None."""
        batches = (self.params or {}).get("steps")
        if batches:
            # Rounding up errs towards stopping early, never late.
            return math.ceil(batches / self.model.optimizer.accumulation_steps)
        info = getattr(self.model, "sampling_info", None)
        return getattr(info, "steps_per_epoch", None)

    def _stop(self, what):
        self.model.stop_training = True
        if (self.params or {}).get("verbose"):
            epsilon, _ = self.model.privacy_spent(self._delta, self.accountant)
            print(f"\nPrivacyCallback: stopping at {self._key()}={epsilon:.4g}: {what} "
                  f"would exceed target_epsilon={self.target_epsilon}.")

    def _write_summaries(self, epoch, steps):
        if self._writer is None:
            return
        value = tf.constant(self.epsilon, tf.float32)
        with self._writer.as_default():
            tf.summary.write(f"privacy/{self._key()}", value, step=epoch,
                             metadata=_SCALAR_METADATA)
            tf.summary.write(f"privacy/{self._key()}_by_step", value, step=steps,
                             metadata=_SCALAR_METADATA)
        self._writer.flush()


def privacy_callbacks_first(callback_list):
    """`callback_list` with its `PrivacyCallback` first, so every later
    callback (CSVLogger, TensorBoard, ...) sees the epsilon it adds to the
    epoch logs. A `CallbackList` is returned as it is."""
    if not callback_list or isinstance(callback_list, keras.callbacks.CallbackList):
        return callback_list
    return sorted(callback_list, key=lambda c: not isinstance(c, PrivacyCallback))


def appended(callback_list, model, *more):
    """fit's `callbacks` (a list, a `CallbackList` or None) with `more` last.

    Keras hands a `CallbackList` its model and parameters when it builds
    one, not when it is given one: `more` get the list's parameters and
    `model` here."""
    if isinstance(callback_list, keras.callbacks.CallbackList):
        for callback in more:
            callback.set_model(model)
            callback.set_params(callback_list.params)
            callback_list.callbacks.append(callback)
        return callback_list
    return list(callback_list or []) + list(more)


def privacy_callbacks_lead(callback_list):
    """Whether the hooks of the `PrivacyCallback`s of fit's `callbacks` run
    before every other callback's (always so for a list, which
    `privacy_callbacks_first` sorts)."""
    if isinstance(callback_list, keras.callbacks.CallbackList):
        callback_list = callback_list.callbacks
    kinds = [isinstance(c, PrivacyCallback) for c in callback_list or []]
    return kinds == sorted(kinds, reverse=True)


def privacy_callbacks_in(callback_list):
    """The `PrivacyCallback`s of fit's `callbacks`."""
    if isinstance(callback_list, keras.callbacks.CallbackList):
        callback_list = callback_list.callbacks
    return [c for c in callback_list or [] if isinstance(c, PrivacyCallback)]


def ledger_of(model):
    """The privacy ledger of a keras-dp private model; refuses any other model."""
    privacy_ledger = getattr(model, "privacy_ledger", None)
    if privacy_ledger is None:
        raise ValueError(
            f"PrivacyCallback needs a keras-dp private model, which records every "
            f"private step in its privacy_ledger; {type(model).__name__} has none. "
            "Use keras_dp.DPModel, keras_dp.DPSequential or keras_dp.make_private.")
    return privacy_ledger


# Marks a summary as a TensorBoard scalar. Written with tf.summary.write
# rather than tf.summary.scalar, which needs the tensorboard package at
# training time; viewing the logs is the only step that needs it.
_SCALAR_METADATA = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))
