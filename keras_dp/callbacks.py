"""A Keras callback that reports the privacy spent by training, and caps it."""

import glob
import inspect
import math
import os
import re
import sys
import warnings

import keras
import tensorflow as tf

from keras_dp import budget
from keras_dp import distribute
from keras_dp.ledger import files


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

    The accounting is its `budget`, a `keras_dp.budget.PrivacyBudget` made
    as each fit begins (the delta in use, the look-ahead), which fit's step
    guard and `train_on_batch` ask too; the callback reports and stops.

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
        budget.check_settings(delta, num_examples, target_epsilon, accountant)
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
        # The `keras_dp.budget.PrivacyBudget` of the fit under way (made
        # when it begins), which fit's step guard and train_on_batch ask too.
        self.budget = None
        self._writer = None

    def on_train_begin(self, logs=None):
        if self.target_epsilon is not None and self not in ledger_of(self.model).fit_budgets():
            # Its batch hooks could not stop an execution's steps: the private
            # fit checks them before each execution and the steps check
            # themselves (review round 158: keras.Model.fit(model, ...) ran
            # to 10.15 against a target of 9.5).
            raise ValueError(
                "PrivacyCallback(target_epsilon=...) caps the epsilon of the private "
                "model's own fit() only, which checks the budget before every execution "
                "of steps; this training is not one (keras.Model.fit(model, ...), or "
                "callbacks run by a custom loop). Call model.fit(...) on the private "
                "model, or leave target_epsilon out and check model.privacy_spent() "
                "in your loop.")
        ledger_of(self.model)
        upcoming = self.model.step_mechanism.next_segment()
        # Refuse now an accountant the coming batches' scheme has none in,
        # not at the first epoch's end.
        upcoming.scheme.accountant_refusal(self.accountant)
        self.budget = budget.PrivacyBudget(
            self.model, self.delta, self.num_examples, self.target_epsilon,
            self.accountant, upcoming=upcoming)
        self._warn(upcoming)
        # Fail now, not after hours, if this fit() would use up delta or
        # exceed the budget in its first epoch.
        self.budget.check_fit((self.params or {}).get("epochs") or 1, self._steps_per_epoch())
        # Every worker of a cluster holds the same ledger, hence the same
        # epsilon; one set of TensorBoard logs is enough.
        if self.log_dir is not None and distribute.is_chief(self.model.distribute_strategy):
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_train_batch_end(self, batch, logs=None):
        # Keras calls this once per execution of steps_per_execution batches.
        if self.budget.next_execution_exceeds():
            self._stop("the next step")

    def on_epoch_end(self, epoch, logs=None):
        self.epsilon, _ = self.budget.spent()
        # Mutating the shared dict is what makes epsilon reach History, the
        # progress bar and the callbacks listed after this one.
        if logs is not None:
            logs[self._key()] = self.epsilon
        self._write_summaries(epoch, self.model.privacy_steps)
        last_epoch = epoch + 1 >= (self.params or {}).get("epochs", math.inf)
        if not last_epoch and self.budget.next_steps_exceed(self._steps_per_epoch(),
                                                               new_pass=True):
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

    def _warn(self, upcoming):
        if upcoming.noise_multiplier == 0:
            warnings.warn(
                "noise_multiplier is 0: this training is NOT differentially "
                "private; PrivacyCallback reports epsilon = inf.",
                stacklevel=3)

    def _key(self):
        """The name of the reported epsilon (`budget.epsilon_key`)."""
        return budget.epsilon_key(self.model.privacy_unit)

    def _steps_per_epoch(self):
        """Private (logical) steps in one epoch of this fit(), or None."""
        batches = (self.params or {}).get("steps")
        if batches:
            # Rounding up errs towards stopping early, never late.
            return math.ceil(batches / self.model.optimizer.dp_settings.accumulation_steps)
        info = getattr(self.model, "sampling_info", None)
        return getattr(info, "steps_per_epoch", None)

    def _stop(self, what):
        self.model.stop_training = True
        if (self.params or {}).get("verbose"):
            epsilon, _ = self.budget.spent()
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
    return [*(callback_list or []), *more]


class FitStepPermit(keras.callbacks.Callback):
    """Last of fit's callbacks: its batch-begin hook, the last code before
    fit's loop calls its train function, permits that one call as fit's step
    (`mechanism.StepMechanism.permit_fit_step`). A call of `model.train_function`
    from anywhere else while fit runs (a callback, a generator of validation
    data) is a stranger's step: review round 28, batches a callback chose
    were recorded as fit's Poisson steps (1.12 reported against 30.1), and
    joined its accumulated step (2 C, recorded C); round 29, the same from a
    validation generator (1.52 against 7.14).

    Args:
        step_mechanism: the private model's `StepMechanism`.
    """

    def __init__(self, step_mechanism):
        super().__init__()
        self._step_mechanism = step_mechanism

    def on_train_batch_begin(self, batch, logs=None):
        self._step_mechanism.permit_fit_step()


def privacy_callbacks_lead(callback_list):
    """Whether the hooks of the `PrivacyCallback`s of fit's `callbacks` run
    before every other callback's (always so for a list, which
    `privacy_callbacks_first` sorts)."""
    kinds = [isinstance(c, PrivacyCallback) for c in _listed(callback_list)]
    return kinds == sorted(kinds, reverse=True)


def privacy_callbacks_in(callback_list):
    """The `PrivacyCallback`s of fit's `callbacks`."""
    return [c for c in _listed(callback_list) if isinstance(c, PrivacyCallback)]


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


class PassStarts(keras.callbacks.Callback):
    """One of fit's callbacks: tells the ledger that each epoch starts a new
    pass over the data, and makes a Poisson dataset's next pass fresh then.

    Fresh at each epoch, not once per fit: a step of the same variables
    between epochs (a custom loop from a callback) may have drawn the pass
    this dataset's counter would take next, with the same seed.

    Args:
        privacy_ledger: the model's ledger.
        draw_fresh: called at each epoch's start (`sampler.draw_fresh` of
            fit's Poisson dataset), or None.
    """

    def __init__(self, privacy_ledger, draw_fresh=None):
        super().__init__()
        self._ledger = privacy_ledger
        self._draw_fresh = draw_fresh

    def on_epoch_begin(self, epoch, logs=None):
        if self.model.optimizer.is_mid_logical_step():
            # A new pass may not close a step of the last one's batches: fit
            # aborts the step as it ends (review round 66).
            raise ValueError(
                "An epoch of this fit ended inside a logical step of "
                "gradient_accumulation_steps batches, so the next epoch's batches would "
                "join the last one's. Give fit an input whose epochs hold a multiple of "
                "gradient_accumulation_steps batches: a poisson_dataset's own length, or "
                "fit(..., steps_per_epoch=...) a multiple of it.")
        self._ledger.start_pass()
        if self._draw_fresh is not None:
            self._draw_fresh()


class KeptFiles(keras.callbacks.Callback):
    """One of fit's callbacks: a file a `keras.callbacks.ModelCheckpoint`
    with `save_best_only=True` kept carries the ledger of all the training
    that decided to keep it.

    Such a checkpoint keeps the file of step t only because no later epoch
    (or batch, with `save_freq=N`) scored better, so the choice used every
    step after t: after each epoch (and at the end of fit) the ledger in each
    file its path names is replaced by the model's, which holds the file's
    steps and all later ones, where the model's ledger continues the file's
    (`files.write_ledger_into`). A checkpoint that compares with a best
    of before this fit (an earlier fit's, or a threshold) keeps files by
    this fit's scores whatever their history: theirs are composed with the
    model's (`ledger.table.kept_state`; review round 81: a model built again
    and resumed from `BackupAndRestore`'s backup with the same callbacks
    never scored better, and the crashed fit's file kept its 26 steps, 5.58
    reported where 50 decided it, 7.23). The files are found by the path, its
    fields standing for anything, not by the name an epoch's logs would give:
    a checkpoint saving every N batches names its file from a batch's logs
    (review round 58: the file kept at step 9 of 21 carried 9, 3.35 reported
    against 4.29), and one given to several fits may keep an earlier fit's
    (review round 52: 4.22 reported against 5.89). A fit may end by an
    exception, which runs no epoch end: fit writes them on every exit too
    (`write`; review round 71: a fit interrupted at step 398 left the file
    kept at step 199 with the ledger of step 300, 1.14 reported against
    1.24).

    Args:
        checkpoints: fit's `ModelCheckpoint`s with `save_best_only=True`.
        private_model: the model fit trains (its ledger is read when written).
        saved_in_fit: the list of the files private models of its variables
            save during the fit (`PrivacyLedger.noting_saves`).
        backup_dirs: the folders of fit's `BackupAndRestore`s.
    """

    def __init__(self, checkpoints, private_model, saved_in_fit, backup_dirs=()):
        super().__init__()
        self._checkpoints = checkpoints
        self._private_model = private_model
        self._saved_in_fit = saved_in_fit
        # A checkpoint that compares with a best of before this fit (an
        # earlier fit's, or a threshold) keeps its files by this fit's scores.
        self._carried_over = [checkpoint.best is not None for checkpoint in checkpoints]
        # The files periodic checkpoints (that never compared) and backups
        # saved, by their exact names (review round 100: a pattern also
        # matched the user's own best file beside them): each is kept
        # whatever comes after. A name missed here is only written again.
        self._periodic = {files.absolute_path(os.path.join(str(directory), name))
                          for directory in backup_dirs
                          for name in ("latest.weights.h5", "latest.weights.h5.bkp")}
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._note_periodic(batch, logs or {})

    def on_epoch_end(self, epoch, logs=None):
        self._note_periodic(None, logs or {})
        self.write()

    def _note_periodic(self, batch, logs):
        """Notes the name each checkpoint that never compared gives its file
        of this batch (or epoch), as Keras' ModelCheckpoint formats it."""
        for checkpoint in self._checkpoints:
            if checkpoint.best is None:
                fields = dict(logs, epoch=self._epoch + 1)
                if batch is not None and "batch" not in logs:
                    fields["batch"] = batch + 1
                try:
                    self._periodic.add(files.absolute_path(checkpoint.filepath.format(**fields)))
                except (KeyError, IndexError, ValueError):
                    pass  # Keras fails to name it too: no file.

    def write(self):
        """Writes the model's ledger into every file the checkpoints may keep,
        and into every file the model saved during the fit but those of
        checkpoints that never compared (periodic ones, which keep every
        file they save whatever comes after)."""
        privacy_ledger = self._private_model.privacy_ledger
        for checkpoint, carried_over in zip(self._checkpoints, self._carried_over):
            if checkpoint.best is not None:  # It saved, or may keep an earlier file.
                for path in _files_named_by(_paths_of(checkpoint)):
                    files.write_ledger_into(path, privacy_ledger, composed=carried_over)
        # Saved by any other callback, also one fit does not see (held in a
        # set, a closure, ...), which may keep it by a later score: an
        # over-count where it does not.
        for path in set(self._saved_in_fit) - self._periodic:
            files.write_ledger_into(path, privacy_ledger)


# The paths a checkpoint was given in private fits, kept with the checkpoint,
# whose `best` compares with the files saved under any of them (review round
# 96: a file saved under a path reassigned since was not found).
_PATHS_ATTRIBUTE = "keras_dp_paths"


def _paths_of(checkpoint):
    """Every path `checkpoint` has had in a private fit, its current one
    included (recorded here)."""
    paths = vars(checkpoint).setdefault(_PATHS_ATTRIBUTE, [])
    if str(checkpoint.filepath) not in paths:
        paths.append(str(checkpoint.filepath))
    return paths


def refuse_a_best_file_outside_fit(ledger):
    """Refuses a save of a private model by a `ModelCheckpoint` comparing
    scores (`save_best_only=True`) when no private fit runs on its weights:
    the file it keeps is chosen by the scores of later training, whose steps
    only fit's end can write into it (review round 133: a custom loop
    driving the checkpoint through a CallbackList kept the file of step 5 of
    the 20 that chose it, 12.3 reported against 30.1). Nothing is written.

    Args:
        ledger: the `PrivacyLedger` of the weights being saved.
    """
    if ledger.notes_saves():
        return
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _CHECKPOINT_SAVE:
        frame = frame.f_back
    checkpoint = frame and frame.f_locals.get("self")
    if getattr(checkpoint, "save_best_only", False):
        raise ValueError(
            f"A ModelCheckpoint(save_best_only=True) saves this private model to "
            f"{checkpoint.filepath} outside a private fit: the file it keeps is chosen by "
            "later scores, and only fit writes the steps that chose it into the file. "
            "Train with fit (its callbacks), or save with save_best_only=False and, after "
            "the loop, save the weights you choose again.")


_CHECKPOINT_SAVE = inspect.unwrap(keras.callbacks.ModelCheckpoint._save_model).__code__


def _check_own_saving(checkpoint):
    """Refuses a `ModelCheckpoint` subclass that changes how or where it
    saves: the files it keeps may be none its path names (review round 96:
    a subclass naming its files itself kept one with 5 of the 20 steps that
    kept it, 4.54 reported against 7.52)."""
    base = keras.callbacks.ModelCheckpoint
    changed = sorted(name for name, value in vars(base).items()
                     if callable(value) and name != "__init__"
                     and inspect.getattr_static(type(checkpoint), name) is not value)
    if changed:
        raise ValueError(
            f"{type(checkpoint).__name__} changes how keras.callbacks.ModelCheckpoint saves "
            f"({', '.join(changed)}): keras-dp finds the files a checkpoint keeps by its "
            "path, to write in them the epsilon of the training that kept them, and could "
            "miss these. Use keras.callbacks.ModelCheckpoint itself (a subclass may add "
            "methods of its own), or save the files yourself and save them again after "
            "the training that chose them.")


def _files_named_by(filepaths):
    """The files `ModelCheckpoint` paths name, their fields (`{epoch:02d}`,
    `{val_loss:.2f}`) standing for anything."""
    found = []
    for filepath in filepaths:
        parts = re.split(r"\{[^{}]*\}", filepath)
        # tf.io.gfile, as Keras saves a path of another file system (gs://).
        found += [path for path in tf.io.gfile.glob("*".join(glob.escape(part)
                                                            for part in parts))
                  if path not in found]
    return found


def check_search(callback_list):
    """Refuses a fit that a Keras Tuner search other than
    `keras_dp.tuning.RandomSearch` runs (its `TunerCallback`, public `tuner`):
    such a search picks among private trials without accounting for the
    choice, so the best model's epsilon would count its own trial alone
    (review round 80: 4.22 reported against 7.16 for four trials composed)."""
    keras_tuner = sys.modules.get("keras_tuner")
    tuning = sys.modules.get("keras_dp.tuning")
    for callback in _listed(callback_list) if keras_tuner else ():
        tuner = getattr(callback, "tuner", None)
        if isinstance(tuner, keras_tuner.Tuner) and not (
                tuning and isinstance(tuner, tuning.RandomSearch)):
            raise ValueError(
                f"This fit runs a trial of a Keras Tuner search ({type(tuner).__name__}) "
                "that picks among private trials without accounting for the choice: the "
                "best model's epsilon would count its own trial alone, while every "
                "trial's training decided it. Search with keras_dp.tuning.RandomSearch, "
                "which accounts the selection, or tune on public data.")


def check_checkpoint_formats(callback_list):
    """Refuses, before any step, a `keras.callbacks.ModelCheckpoint` of fit's
    `callbacks` that would save the private model in Keras' legacy HDF5
    format, without its ledger (`files.refuse_legacy_h5_save`)."""
    for callback in _listed(callback_list):
        if isinstance(callback, keras.callbacks.ModelCheckpoint) and not callback.save_weights_only:
            files.refuse_legacy_h5_save(callback.filepath)


def _listed(callback_list):
    """Every callback fit's `callbacks` (a list, a `CallbackList` or None)
    runs, in order: also those inside a `CallbackList` given as one of them,
    or held by another callback (an attribute, or a list, tuple or dict of
    them), which it may run itself (review round 91: a best-only checkpoint
    inside a CallbackList or a wrapper kept its file unseen, 5 of the 20
    steps that chose it, 2.91 reported against 5.23)."""
    found, seen = [], set()

    def visit(value):
        if isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            visit(list(value.values()))
        elif isinstance(value, keras.callbacks.Callback) and id(value) not in seen:
            seen.add(id(value))
            if not isinstance(value, keras.callbacks.CallbackList):
                found.append(value)
            visit(list(vars(value).values()))

    visit(callback_list.callbacks if isinstance(callback_list, keras.callbacks.CallbackList)
          else callback_list or [])
    return found


def kept_files(callback_list, private_model, saved_in_fit):
    """A `KeptFiles` for the `ModelCheckpoint`s of fit's `callbacks` (a
    list, a `CallbackList` or None) and the files of `saved_in_fit`.

    A checkpoint's relative path is made absolute here, once: its `best`
    compares with the file it kept where it first saved, which a later fit
    run from another directory would neither find nor write (review round
    93: after os.chdir, the file kept by the first fit carried 10 of the 30
    steps that kept it, 5.76 reported against 8.94)."""
    # Every checkpoint, whatever its save_best_only now: a callback may turn
    # it on during the fit (review round 95: the file kept carried 5 of the
    # 20 steps that kept it, 2.91 reported against 5.23). `write` skips one
    # that never compared (its `best` None).
    checkpoints = [c for c in _listed(callback_list)
                   if isinstance(c, keras.callbacks.ModelCheckpoint)]
    for checkpoint in checkpoints:
        _check_own_saving(checkpoint)
        checkpoint.filepath = files.absolute_path(checkpoint.filepath)
        _paths_of(checkpoint)
    # BackupAndRestore's files: each backup is kept until the next one,
    # whatever the scores.
    backups = [c.backup_dir for c in _listed(callback_list)
               if isinstance(c, keras.callbacks.BackupAndRestore)]
    return KeptFiles(checkpoints, private_model, saved_in_fit, backups)


class TrainingLogDecisions(keras.callbacks.Callback):
    """One of fit's callbacks: warns, once per fit, of each callback that
    decides from a value fit computes from the training batches without
    noise (its `monitor`, as Keras' EarlyStopping, ReduceLROnPlateau and
    ModelCheckpoint have, names the loss or a training metric; Keras'
    TerminateOnNaN watches the loss).

    The learning rate it sets, the epoch it stops at or the file it keeps
    then depends on the training data outside the guarantee the reported
    epsilon gives. Values of validation data ("val_...") and those other
    callbacks add to the logs are not the model's training metrics.

    Args:
        given: fit's callbacks (a list, a `CallbackList` or None).
    """

    def __init__(self, given):
        super().__init__()
        self._monitoring = [c for c in _listed(given) if isinstance(_monitored(c), str)]

    def on_epoch_end(self, epoch, logs=None):
        # The exact count of non-finite gradients too (review round 12).
        trained = set(self.model.get_metrics_result()) | {"nonfinite_gradients"}
        for callback in self._monitoring:
            if _monitored(callback) in trained:
                warnings.warn(
                    f"{type(callback).__name__} monitors {_monitored(callback)!r}, which fit "
                    "computes from the training batches without noise, so what it decides "
                    "(the learning rate, when to stop, the file kept) depends on the training "
                    "data outside the guarantee of the reported epsilon. Monitor a validation "
                    f"value ('val_{_monitored(callback)}') on held-out data instead.",
                    stacklevel=2)
        self._monitoring = []


def _monitored(callback):
    """The log value a callback decides from: its `monitor`, or the training
    loss for TerminateOnNaN (which stops at a non-finite one: review round
    12 told apart a dataset holding an example whose loss overflowed, at
    any reported epsilon, by the iterations saved)."""
    if isinstance(callback, keras.callbacks.TerminateOnNaN):
        return "loss"
    return getattr(callback, "monitor", None)


class StepGuard(keras.callbacks.Callback):
    """Last of fit's callbacks: refuses, before each execution, steps the
    ledger could not record or that could exceed a `PrivacyCallback`'s
    budget, whatever the callbacks before it changed.

    Args:
        privacy_callbacks: fit's `PrivacyCallback`s.
        look_ahead: whether their batch hooks run first after each execution
            (see `keras_dp.budget.PrivacyBudget.check_next_steps`).
        enclosing: the `PrivacyCallback`s with a budget of the fits this one
            runs in (called from one of their callbacks), checked too.
    """

    def __init__(self, privacy_callbacks, look_ahead=False, enclosing=()):
        super().__init__()
        self._budgets = [c for c in privacy_callbacks if c.target_epsilon is not None]
        self._look_ahead = look_ahead
        self._enclosing = list(enclosing)

    def on_train_batch_begin(self, batch, logs=None):
        self.model.check_before_steps()
        if not (self._budgets or self._enclosing):
            return
        # One reading of the settings, checked and permitted (a setting
        # changed meanwhile, from the data's thread, is the step's to refuse).
        row = self.model.step_mechanism.next_row()
        for callback in self._budgets:  # Each made its budget as fit began.
            callback.budget.check_next_steps(look_ahead=self._look_ahead, row=row)
        for callback in self._enclosing:  # Their hooks do not run in this fit.
            callback.budget.check_next_steps(steps=self.model.train_steps_per_execution,
                                             stepping=self.model, row=row)
        # What the checks allowed is all the execution's steps may spend
        # (each checks itself: `keras_dp.ledger.table.PrivacyLedger.permits`).
        self.model.privacy_ledger.permit(budget.steps_per_execution(self.model),
                                         self.model.step_mechanism.opener, row)

    def on_train_batch_end(self, batch, logs=None):
        self.model.step_mechanism.raise_refusals()

    def on_train_end(self, logs=None):
        # A custom loop's steps after the last execution (as the last epoch
        # ends), warned of as those before an execution are.
        self.model.step_mechanism.warn_refusals()

