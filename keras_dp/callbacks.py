"""A Keras callback that reports the privacy spent by training, and caps it."""

import math
import warnings

import keras
import tensorflow as tf

from keras_dp import accounting


@keras.saving.register_keras_serializable(package="keras_dp")
class PrivacyCallback(keras.callbacks.Callback):
    """Reports epsilon after every epoch and stops before a budget is exceeded.

    After each epoch, `logs["epsilon"]` is set to the epsilon of all private
    steps the model has taken so far (`model.privacy_steps`, which is saved
    with the model, so a resumed run keeps counting), at `delta`, for the
    batch sampling recorded by the private model's `fit()`
    (`model.sampling_info`). It then shows in the `History`, the progress bar,
    and the logs seen by the callbacks that come after this one.

    Put `PrivacyCallback` before `keras.callbacks.CSVLogger`,
    `keras.callbacks.TensorBoard` and any other callback that records logs:
    Keras hands one shared logs dict to the callbacks in list order, so those
    placed earlier have already written their row without `epsilon`.
    (`History` and the progress bar always run last.)

    Requires a keras-dp private model: it reads `model.optimizer`'s
    `noise_multiplier` and gradient accumulation steps,
    `model.privacy_steps` and `model.sampling_info` (`sampling`,
    `batch_size`, `num_examples`, `extra_delta`).

    With shuffled batches (`sampling="shuffle"`), the reported epsilon is the
    unamplified bound of `keras_dp.accounting` (a warning says so).

    Args:
        delta: the delta of the reported (epsilon, delta) guarantee. Must be
            in (0, 1 / num_examples). Defaults to
            `keras_dp.accounting.default_delta(num_examples)`. Padded Poisson
            batches are truncated with a tiny probability `extra_delta` per
            step; epsilon is then computed at
            `delta - steps * extra_delta`, so that `delta` stays the total.
        num_examples: number of training examples. Only needed when the
            model's `sampling_info` does not record it.
        target_epsilon: optional privacy budget. Training stops at the end of
            the last epoch whose successor would exceed it, and `fit()`
            raises a ValueError if even the first epoch would.
        accountant: `"rdp"` or `"pld"`.
        log_dir: optional directory for TensorBoard scalars:
            `privacy/epsilon` per epoch and `privacy/epsilon_by_step` per
            private step.

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
        self.accountant = accountant
        self.log_dir = log_dir
        # The latest reported epsilon.
        self.epsilon = None
        self._run = None
        self._writer = None
        self._warned_shuffle = False

    def on_train_begin(self, logs=None):
        self._run = self._describe_run()
        if self._run["noise_multiplier"] == 0:
            warnings.warn(
                "noise_multiplier is 0: this training is NOT differentially "
                "private; PrivacyCallback reports epsilon = inf.",
                stacklevel=2)
        if self._run["sampling"] == "shuffle" and not self._warned_shuffle:
            self._warned_shuffle = True
            warnings.warn(
                "The model trains on shuffled fixed-size batches, for which "
                "amplification by Poisson sampling does not strictly apply; "
                "PrivacyCallback reports the larger, unamplified bound (one "
                "Gaussian release per pass over the data).", stacklevel=2)
        # Fail now, not after hours, if the truncation deltas of this fit()
        # would use up delta.
        epochs = (self.params or {}).get("epochs") or 1
        self._accounting_delta(self.model.privacy_steps
                               + epochs * self._steps_per_epoch())
        if self.target_epsilon is not None:
            self._refuse_if_first_epoch_exceeds()
        if self.log_dir is not None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_end(self, epoch, logs=None):
        steps = self.model.privacy_steps
        self.epsilon = self._epsilon_after(steps)
        # Mutating the shared dict is what makes epsilon reach History, the
        # progress bar and the callbacks listed after this one.
        if logs is not None:
            logs["epsilon"] = self.epsilon
        self._write_summaries(epoch, steps)
        if self.target_epsilon is None:
            return
        next_epsilon = self._epsilon_after(steps + self._steps_per_epoch())
        if next_epsilon > self.target_epsilon:
            self.model.stop_training = True
            if (self.params or {}).get("verbose"):
                print(f"\nPrivacyCallback: stopping at epsilon={self.epsilon:.4g}; "
                      f"another epoch would reach {next_epsilon:.4g} > "
                      f"target_epsilon={self.target_epsilon}.")

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

    def _describe_run(self):
        """Collects what the accountant needs from the model and arguments."""
        info = getattr(self.model, "sampling_info", None)
        if info is None:
            raise ValueError(
                "model.sampling_info is not set, so PrivacyCallback cannot "
                "tell how batches were drawn. Train a keras-dp private model "
                "(keras_dp.DPModel, DPSequential or make_private), whose "
                "fit() records it.")
        num_examples = self._num_examples(info)
        delta = (accounting.default_delta(num_examples) if self.delta is None
                 else self.delta)
        accounting.check_delta(delta, num_examples)
        return {
            "num_examples": num_examples,
            "batch_size": int(info.batch_size),
            "sampling": info.sampling,
            "noise_multiplier": float(self.model.optimizer.noise_multiplier),
            "delta": delta,
            "extra_delta": float(info.extra_delta or 0.0),
        }

    def _num_examples(self, info):
        if info.num_examples is None:
            if self.num_examples is None:
                raise ValueError(
                    "The number of training examples is unknown (the model's "
                    "sampling_info does not record it): pass num_examples to "
                    "PrivacyCallback(num_examples=...).")
            return self.num_examples
        if self.num_examples is not None and self.num_examples != info.num_examples:
            warnings.warn(
                f"PrivacyCallback(num_examples={self.num_examples}) differs "
                f"from the {info.num_examples} examples the model trains on; "
                f"accounting uses {info.num_examples}.", stacklevel=3)
        return int(info.num_examples)

    def _epsilon_after(self, steps):
        run = self._run
        return accounting.compute_epsilon(
            run["num_examples"], run["batch_size"], run["noise_multiplier"],
            self._accounting_delta(steps), steps=steps,
            accountant=self.accountant, sampling=run["sampling"])

    def _accounting_delta(self, steps):
        """The delta left for the accountant after `steps` truncation risks."""
        truncation = steps * self._run["extra_delta"]
        if truncation >= self._run["delta"]:
            raise ValueError(
                f"delta={self._run['delta']:.3g} is used up by the truncation "
                f"probability of padded Poisson batches ({steps} steps x "
                f"extra_delta={self._run['extra_delta']:.3g}). Use a larger "
                f"delta, or a larger max_batch_size for the batches.")
        return self._run["delta"] - truncation

    def _steps_per_epoch(self):
        """Private (logical) steps in one epoch of this fit()."""
        batches = (self.params or {}).get("steps")
        if not batches:
            # Unknown dataset length: assume one expected pass over the data.
            return math.ceil(self._run["num_examples"] / self._run["batch_size"])
        # keras-dp's DP optimizers accumulate clipped sums themselves
        # (`accumulation_steps`); Keras optimizers call it
        # `gradient_accumulation_steps`.
        optimizer = self.model.optimizer
        accumulation = (getattr(optimizer, "accumulation_steps", None)
                        or getattr(optimizer, "gradient_accumulation_steps", None)
                        or 1)
        # Rounding up errs towards stopping early, never late.
        return math.ceil(batches / accumulation)

    def _refuse_if_first_epoch_exceeds(self):
        steps = self.model.privacy_steps + self._steps_per_epoch()
        epsilon = self._epsilon_after(steps)
        if epsilon > self.target_epsilon:
            raise ValueError(
                f"target_epsilon={self.target_epsilon} would be exceeded by the "
                f"first epoch: epsilon would reach {epsilon:.4g} after {steps} "
                f"private steps. Increase the noise_multiplier (see "
                f"keras_dp.calibrate_noise_multiplier), reduce the batch_size, "
                f"or raise target_epsilon.")

    def _write_summaries(self, epoch, steps):
        if self._writer is None:
            return
        value = tf.constant(self.epsilon, tf.float32)
        with self._writer.as_default():
            tf.summary.write("privacy/epsilon", value, step=epoch,
                             metadata=_SCALAR_METADATA)
            tf.summary.write("privacy/epsilon_by_step", value, step=steps,
                             metadata=_SCALAR_METADATA)
        self._writer.flush()


# Marks a summary as a TensorBoard scalar. Written with tf.summary.write
# rather than tf.summary.scalar, which needs the tensorboard package at
# training time; viewing the logs is the only step that needs it.
_SCALAR_METADATA = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))
