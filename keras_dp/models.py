"""Private models: Keras models whose training step is DP-SGD.

`DPModel` and `DPSequential` are `keras.Model` and `keras.Sequential` with a
private `train_step`; `make_private` wraps any existing model (sharing its
layers and weights). Evaluation, prediction, saving and loading are Keras'.

The step reads as Keras' own `train_step`; its parts live with what owns
them: how fit() draws batches in `keras_dp.sampler`, the choice of clipping
engine in `keras_dp.clipping.engine`, the recording of each step and of
fit's sampling in `keras_dp.ledger`, the noise in the DP optimizer.
"""

import contextlib
import dataclasses
import functools
import inspect
import sys
import types
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_dp import budget
from keras_dp import callbacks
from keras_dp import clipping
from keras_dp import compiled_metrics
from keras_dp import custom_loops
from keras_dp import distribute
from keras_dp import hub_tasks
from keras_dp import ledger
from keras_dp import mechanism
from keras_dp import planning
from keras_dp import preprocessing
from keras_dp import report
from keras_dp import sampler
from keras_dp import serving
from keras_dp import validation
from keras_dp.clipping import engine
from keras_dp.clipping import vectorized
from keras_dp.clipping import losses as clipping_losses
from keras_dp.data import batch_maps


class _ReadTrainSteps(type):
    """The metaclass of private models: a train_step given to a private model
    class after its definition is read whole too (`engine.checked_override`)."""

    def __setattr__(cls, name, value):
        if name == "train_step" and callable(value):
            value = engine.checked_override(value)
        super().__setattr__(name, value)


class _PrivateTrainStep(metaclass=_ReadTrainSteps):
    """Mixin giving a Keras model the private train step and privacy ledger."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        validation.check_private_step_kept(cls, _PrivateTrainStep)
        own_step = inspect.getattr_static(cls, "train_step")
        if own_step is not vars(_PrivateTrainStep)["train_step"]:
            # A subclass's (or a mixin's) step, super().train_step and all, is read whole.
            cls.train_step = own_step

    def __setattr__(self, name, value):
        if name == "train_step" and callable(value):
            # An instance's own step, read whole as a class's is.
            own_step = value
            value = types.MethodType(engine.checked_override(
                lambda model, data: own_step(data)), self)
        super().__setattr__(name, value)

    def __init__(self, *args, clipping_engine="auto", privacy_ledger=None, **kwargs):
        super().__init__(*args, **kwargs)
        # The ledger of variables nobody trained privately yet; the model's
        # ledger is that of its variables (see `privacy_ledger`).
        self._own_ledger = privacy_ledger or ledger.PrivacyLedger()
        # TensorFlow checkpoints reach the ledger through this trackable.
        self._ledger_checkpoint = ledger.LedgerCheckpoint(lambda: self.privacy_ledger)
        # The owner of each step's mechanism (C, sigma, sampling, divisor).
        self._mechanism = mechanism.StepMechanism(self)
        self._train_optimizer = None  # The optimizer the train function applies.
        # How the last fit() drew its batches (read by the accountant).
        self.sampling_info = None
        # The engine the traced step runs: "ghost" or "vectorized" (None
        # before the first trace).
        self.clipping_engine_in_use = None
        self.clipping_engine = clipping_engine

    @property
    def clipping_engine(self):
        """How per-example gradients are clipped; both engines are exact.

        "auto" (default): ghost clipping (`keras_dp.clipping.ghost`: per-example norms
        from one forward and one backward pass, no per-example gradients)
        when every trainable layer has a norm function and each example is
        its own microbatch, else the vectorized engine (`tf.vectorized_map`
        over per-example gradients). "ghost" or "vectorized" force one;
        "ghost" refuses a model it does not cover. A change takes effect at
        the next training step.
        """
        return self._clipping_engine

    @clipping_engine.setter
    def clipping_engine(self, value):
        engine.check_engine(value)
        self._clipping_engine = value
        self.train_function = None  # Traced with the old engine.

    @property
    def privacy_steps(self):
        """Number of private (logical) steps taken on this model's variables."""
        return self.privacy_ledger.total_steps()

    @property
    def privacy_ledger(self):
        """The `keras_dp.ledger.PrivacyLedger` of this model's variables.

        It belongs to the variables, not to this model object: every private
        model that trains them (a re-wrap, an alias, a larger model around
        this one) records into it, and variables carrying several ledgers
        compose them (`keras_dp.ledger.for_variables`). It holds the
        releases of the layers `keras_dp.adapt` adapted.
        """
        privacy_ledger = ledger.for_variables(self.weights, prior=self._own_ledger)
        preprocessing.record_releases(self, privacy_ledger)
        return privacy_ledger

    @property
    def base_model(self):
        """A plain Keras model with this model's layers and weights, for
        serving: it saves, loads and exports without keras-dp (see
        `keras_dp.export_for_serving`). Not private: train this model."""
        if isinstance(self, keras.Sequential):
            return keras.Sequential(self.layers, name=f"{self.name}_base")
        if isinstance(self, Functional):
            return keras.Model(self.inputs, self.outputs, name=f"{self.name}_base")
        raise TypeError(
            f"{type(self).__name__} is a subclassed DPModel: it has no plain Keras "
            "twin. Subclass keras.Model instead and wrap it with "
            "keras_dp.make_private(model), whose base_model is your model.")

    @property
    def step_mechanism(self):
        """The `keras_dp.mechanism.StepMechanism` that fixes each step's mechanism."""
        return self._mechanism

    @property
    def privacy_unit(self):
        """What `privacy_spent`'s epsilon protects: `"example"` (one row) or
        `"user"` (every row of one user, after `fit(..., user_ids=...)`)."""
        return self.privacy_ledger.unit() or "example"

    def privacy_spent(self, delta=None, accountant="rdp"):
        """The privacy spent by every private step taken on this model's variables.

        Composes, with `dp_accounting`, the segments of the privacy ledger:
        each run of steps with the sampling, noise multiplier and
        sensitivity it really had, whichever fit, train_on_batch or loop ran
        them, including spending restored from checkpoints and stated with
        `make_private(..., prior_ledger=...)`.

        Args:
            delta: the total delta; the truncation deltas of padded Poisson
                batches are taken from it. Default:
                `keras_dp.accounting.default_delta(num_examples)` for the
                largest number of examples the ledger recorded.
            accountant: `"rdp"` or `"pld"`.

        Returns:
            `(epsilon, event)`: epsilon as a float (0.0 before any step, inf
            if a step had no noise, or could not be recorded) and the
            `dp_accounting` event composed. The epsilon protects one
            `privacy_unit`: an example, or, after user-level fits, a user
            (the default delta is then below 1 / the number of users).

        Raises:
            ValueError: when delta is not below 1 / num_examples, or is None
                while the ledger does not record num_examples
                (`keras_dp.budget.resolve_delta`).

        Example:
        ```python
        epsilon, event = private.privacy_spent(delta=1e-5)
        ```
        """
        return budget.PrivacyBudget(self, delta, accountant=accountant).spent()

    def privacy_report(self, delta=None, accountant="rdp"):
        """The privacy spent, as readable text: epsilon and delta, the
        accountant, the unit, each run of steps with its sampling and noise,
        the clipping norm, N, what the guarantee does not cover, and its
        statement (`keras_dp.report.privacy_report`).

        Args:
            delta: the total delta; default that of `privacy_spent`.
            accountant: `"rdp"` or `"pld"`.

        Returns:
            The report, a string of lines.

        Example:
        ```python
        print(private.privacy_report(delta=1e-5))
        ```
        """
        return report.privacy_report(self, delta, accountant)

    def save_own_variables(self, store):
        """Keras' `save_own_variables`, with the privacy ledger beside the weights."""
        super().save_own_variables(store)
        ledger.save_to(store, self.privacy_ledger)
        preprocessing.save_released(store, self)
        ledger.remember_values(self.weights, self.privacy_ledger)

    def load_own_variables(self, store):
        """Keras' `load_own_variables`; the saved ledger is merged into this
        model's, never lowering it: loading an older checkpoint keeps the
        spending since, weights of another history add that history's."""
        try:
            store = ledger.load_from(store, self.privacy_ledger)  # May refuse: before marks.
        except ValueError:
            self.privacy_ledger.count_refused_load()
            raise
        super().load_own_variables(preprocessing.load_released(store, self))

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """`keras.Model.load_weights`, whole or not at all (`ledger.load_whole`)."""
        if skip_mismatch and self.privacy_steps:
            # The skipped weights would keep this model's own history under
            # the file's ledger, the same history at two times to the merge.
            raise ValueError(
                "load_weights(skip_mismatch=True) would keep this model's own trained "
                "weights where the file's do not fit, under the file's privacy ledger, "
                "which does not hold the steps that trained them. Load into a model "
                "that has not trained, or load without skip_mismatch.")
        if ledger.is_legacy_h5(filepath):
            raise ValueError(
                f"{filepath} is in Keras' legacy HDF5 format, which holds weights without "
                "a privacy ledger, so what trained them would be missing from this model's "
                "epsilon. Load a .keras or .weights.h5 file, or load these weights into "
                "the base model before make_private and state their spending with "
                "make_private(..., prior_ledger=...).")
        ledger.load_whole(self, functools.partial(super().load_weights, filepath,
                                                  skip_mismatch=skip_mismatch, **kwargs))

    def save(self, filepath, *args, **kwargs):
        """`keras.Model.save`, but not in Keras' legacy HDF5 format, which
        would save the weights without the privacy ledger."""
        ledger.refuse_legacy_h5_save(filepath)
        callbacks.refuse_a_best_file_outside_fit(self.privacy_ledger)
        result = super().save(filepath, *args, **kwargs)
        self._note_saved(filepath)
        return result

    def save_weights(self, filepath, *args, **kwargs):
        """`keras.Model.save_weights` (the ledger is saved with the weights)."""
        callbacks.refuse_a_best_file_outside_fit(self.privacy_ledger)
        result = super().save_weights(filepath, *args, **kwargs)
        self._note_saved(filepath)
        return result

    def _note_saved(self, filepath):
        # A file saved while a fit runs on these variables may be kept by a
        # later score whatever callback saved it (`callbacks.KeptFiles`;
        # review round 98: a checkpoint held in a frozenset kept a file with
        # 10 of the 40 steps that kept it, 3.44 reported against 5.39).
        self.privacy_ledger.note_saved(ledger.absolute_path(filepath))

    def export(self, filepath, format="tf_saved_model", verbose=None, **kwargs):
        """`keras.Model.export` (same arguments) of `base_model`: the artifact
        serves without keras-dp (and holds no ledger), also for a loaded
        model, and holds fresh random states, not the training's (review
        round 176: a Dropout's state replayed every mask, 5.22 C under
        ghost; `keras_dp.serving.fresh_random_states`)."""
        with serving.fresh_random_states(self.base_model):
            return self.base_model.export(filepath, format=format, verbose=verbose, **kwargs)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # tf.saved_model.save serves the model: its SavedModel holds the
        # weights and the serving function, not the ledger (checkpoints do).
        # Its serving signature is the base model's.
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel":
            _refuse_saving_random_states(self.base_model)
            children = {name: child for name, child in children.items()
                        if child is not self._ledger_checkpoint}
            serving = self.base_model._trackable_children(save_type, **kwargs).get(
                "_default_save_signature")
            if serving is not None:
                children["_default_save_signature"] = serving
        return children

    def evaluate(self, *args, **kwargs):
        """Keras' `evaluate` (also fit's validation), refused after it if
        it wrote any of the model's variables, which are put back: a layer
        keeping a value of an evaluated batch (its own variable written in
        inference mode) would carry rows outside the private step into
        training and the saved model, un-noised (review round 195: a
        held-out row of validation_split kept in a layer's variable, 19.68
        C, its value saved)."""
        with _variables_kept(self):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """Keras' `predict`, refused after it, as `evaluate`, if it wrote
        any of the model's variables (put back)."""
        with _variables_kept(self):
            return super().predict(*args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        """Keras' `test_on_batch`, refused as `evaluate` (review round 196:
        a held-out row kept by a layer, 35.78 C, saved)."""
        with _variables_kept(self):
            return super().test_on_batch(*args, **kwargs)

    def predict_on_batch(self, *args, **kwargs):
        """Keras' `predict_on_batch`, refused as `evaluate`."""
        with _variables_kept(self):
            return super().predict_on_batch(*args, **kwargs)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """Keras' `train_on_batch`: one private step on the batch.

        A batch keras-dp did not draw is accounted as a full Gaussian
        release, and divides by its own batch size, also when called from a
        callback during fit (whose steps keep their own mechanism). Given a
        `keras_dp.custom_loops.PoissonBatches` as `x` alone, the step pulls
        its next draw itself, accounted and divided as fit's steps on it.

        Under a strategy of several replicas, the batch is the GLOBAL batch,
        the same on every worker (as a dataset given to `fit` yields global
        batches), and each replica takes its share of the rows. Keras would
        otherwise hand the whole batch to every replica, so every example
        would count once per replica in the clipped sum.
        """
        step = custom_loops.step_of(self, x, y, sample_weight, class_weight)
        with self._mechanism.using(step.sampling), step:
            self.check_before_steps()
            self.optimizer.check_adaptive_noise(_num_rows(x))
            # The step hides the batch's size from Python (it refuses such a
            # batch while running): the error a Python check can give.
            vectorized.check_microbatches_divide(
                _num_rows(x), self.optimizer.dp_settings.num_microbatches)
            # Called from a fit's callback, of this or another private model of
            # these variables (review round 123: 8.09 against a target of 6.0).
            budgets = self.privacy_ledger.fit_budgets()
            row = self._mechanism.next_row() if budgets else None
            for callback in budgets:
                callback.budget.check_next_steps(steps=1, stepping=self, row=row)
            # The one step those checks allowed (the step checks itself).
            with (self.privacy_ledger.permitting(1, self._mechanism.opener, row)
                  if budgets else contextlib.nullcontext()):
                logs = self._train_on_batches(step, class_weight, return_dict)
            self._mechanism.raise_refusals()
            return logs

    def _train_on_batches(self, step, class_weight, return_dict):
        """Keras' train_on_batch on each physical batch of `step` (a
        `keras_dp.custom_loops` step); returns the last one's logs."""
        for x, y, sample_weight in step.batches():
            if distribute.num_replicas(self.distribute_strategy) > 1:
                # Build from the whole batch first: Keras' symbolic build
                # does not take per-replica values.
                self._maybe_symbolic_build(data_batch=(x, y, sample_weight))
                x, y, sample_weight = distribute.split_over_replicas(
                    self.distribute_strategy, (x, y, sample_weight))
            logs = super().train_on_batch(x, y, sample_weight=sample_weight,
                                          class_weight=class_weight, return_dict=return_dict)
        return logs

    def make_train_function(self, force=False):
        """Keras' train function, run as its entry point's (fit or
        train_on_batch: see `keras_dp.mechanism.StepMechanism.entered`)."""
        # Made again for an optimizer assigned since (`model.optimizer = ...`):
        # the old function would apply the old one's noise, while the budget
        # and the next segment read the new one (review round 90: a target
        # of 4.0 passed, 4.11).
        if (self.train_function is not None and not force
                and self._train_optimizer is self.optimizer):
            return self.train_function
        super().make_train_function(True)
        self.train_function = self._mechanism.entered(self.train_function)
        self._train_steps_per_execution = self.steps_per_execution
        self._train_optimizer = self.optimizer
        return self.train_function

    @property
    def train_steps_per_execution(self):
        """The batches the train function in use runs per call: Keras bakes
        `steps_per_execution` into it when it is made, so a later change of
        the attribute runs the old value until it is made again (review
        round 46: a budget checked 1 step while 50 ran past its target)."""
        if self.train_function is None:
            return self.steps_per_execution
        return self._train_steps_per_execution

    def check_before_steps(self):
        """Refuses, in Python, steps that could not be recorded or are not
        set up (good errors; the step itself refuses what it cannot vouch
        for, `keras_dp.mechanism.Refusal`)."""
        validation.check_compiled(self)
        validation.check_dp_optimizer(self.optimizer)
        self._mechanism.warn_refusals()  # Of a custom loop's steps since.
        self._mechanism.check_next_step()

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras 3 builds from a batch averaged over the replicas (strategy.reduce,
        # which a multi-worker strategy refuses for a tuple): the build needs
        # only shapes, which one replica's share gives.
        strategy = self.distribute_strategy
        if iterator is not None and distribute.num_workers(strategy) > 1:
            for _, _, batches in iterator:
                data_batch = distribute.first_replica_share(strategy, next(batches))
                break
            iterator = None
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
        compiled_metrics.build_before_first_step(self, iterator, data_batch)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, sample_weight=None,
            validation_split=0.0, validation_data=None, sampling=None, user_ids=None,
            max_examples_per_user=None, **kwargs):
        """Trains privately; in-memory data is Poisson-sampled by default.

        Takes `keras.Model.fit`'s arguments plus:

        Args:
            sampling: for in-memory arrays, `"poisson"` (the default: each
                example joins each batch with probability q = batch_size / N,
                batches padded to a fixed shape, `steps_per_epoch` fresh
                draws an epoch, by default N / batch_size; the accountant's
                amplification applies) or `"shuffle"` (Keras' shuffled
                fixed-size batches, accounted without amplification, one
                release per pass). A dataset made by
                `keras_dp.data.poisson_dataset` is Poisson (also after
                `.map`, `.prefetch` or `.with_options`). Any other dataset or
                generator counts every step as a full Gaussian release,
                unless you state `sampling="shuffle"`: that each epoch holds
                every example at most once (one release per pass).
            user_ids: for in-memory arrays, the user of each row (a length-N
                array), for user-level privacy: the guarantee then protects
                all rows of one user. Each step Poisson-samples USERS with
                q = batch_size / (number of users), so `batch_size` counts
                users; each sampled user brings at most
                `max_examples_per_user` of its rows, whose summed gradient
                is clipped once to C (`keras_dp.data.user_dataset`; see
                docs/user_level.md). None (default): example-level privacy.
            max_examples_per_user: k, the most rows a user brings to a step
                (default `keras_dp.data.DEFAULT_MAX_EXAMPLES_PER_USER`, 8);
                only with `user_ids`. It changes speed and utility, never
                the guarantee.
        """
        if self.train_steps_per_execution != self.steps_per_execution:
            self.train_function = None  # Made again with the value set now.
        info, fit_args = sampler.fit_batches(
            self, sampling, x, y, sample_weight, batch_size, validation_split,
            validation_data, kwargs.get("steps_per_epoch"), kwargs.pop("class_weight", None),
            users=sampler.Users.of(user_ids, max_examples_per_user), epochs=epochs)
        kwargs.update(fit_args)
        given = callbacks.privacy_callbacks_first(kwargs.get("callbacks"))
        callbacks.check_checkpoint_formats(given)
        callbacks.check_search(given)
        # A user's Poisson dataset is made fresh each epoch (arrays: fit's own seed).
        fresh = (functools.partial(sampler.draw_fresh, self, info)
                 if isinstance(x, tf.data.Dataset) and info else None)
        # A fit called from a fit's callback keeps the budgets of the fits it
        # runs in (review round 115: a nested fit ran 201 steps past a target
        # of 2.0, to 3.24, and reset them for the outer fit's callbacks).
        enclosing_budgets = self.privacy_ledger.fit_budgets()
        saved_in_fit = []  # By any callback, through any wrapper: `_note_saved`.
        kept_files = callbacks.kept_files(given, self, saved_in_fit)
        kwargs["callbacks"] = callbacks.appended(
            given, self, callbacks.PassStarts(self.privacy_ledger, fresh),
            planning.NoiseCheck(),
            kept_files, callbacks.TrainingLogDecisions(given),
            callbacks.StepGuard(callbacks.privacy_callbacks_in(given),
                                look_ahead=callbacks.privacy_callbacks_lead(given),
                                enclosing=enclosing_budgets),
            callbacks.FitStepPermit(self._mechanism))
        # fit's own draws on arrays are fresh by their seed from OS entropy,
        # which no ledger records (one a fit): shown, it could be given to
        # poisson_dataset and replay them (review round 32: the same 4
        # batches drawn again, recorded as 8 draws; 0.985 reported against
        # 2.32 for an epoch of N = 60000 replayed). Not shown, it is unknown.
        self.sampling_info = (info if info is None or isinstance(x, tf.data.Dataset)
                              else dataclasses.replace(info, seed=None))
        preprocessing.check_adapted_layers(self, getattr(self.optimizer, "secure_mode", False))
        budgets = [c for c in callbacks.privacy_callbacks_in(given) if c.target_epsilon is not None]
        try:
            with self._mechanism.using(
                    mechanism.Sampling.of_fit(info, self.optimizer.dp_settings),
                    gated=sys._getframe()), self.privacy_ledger.noting_saves(saved_in_fit), \
                    self.privacy_ledger.budgets_in_force(budgets):
                self.check_before_steps()
                self.optimizer.start_noise_segment()  # A fit is a segment of its own.
                return super().fit(epochs=epochs, validation_split=validation_split,
                                   **kwargs)
        finally:
            self._abort_open_step()
            kept_files.write()  # Also after an exception: no epoch end ran.
            ledger.remember_values(self.weights, self.privacy_ledger)

    def _abort_open_step(self):
        """Closes fit's transaction on every exit (its end, stop_training, an
        exception, a budget refusal, an interrupt): a logical step it opened
        and did not complete is discarded, never completed by another entry
        point."""
        discarded = self.optimizer.abort_logical_step()
        if discarded:
            warnings.warn(
                f"fit() ended inside a logical step ({discarded} of its "
                f"gradient_accumulation_steps={self.optimizer.dp_settings.accumulation_steps} "
                "physical batches): that step was discarded, its partial clipped sum "
                "neither noised, released nor recorded.", stacklevel=3)

    @tf.autograph.experimental.do_not_convert  # A custom loop's tf.function traces it as fit.
    def train_step(self, data):
        """One DP-SGD step: clip per example, sum over replicas, noise once;
        checked as a whole while traced, and, called eagerly, run as the
        function traced and checked (`keras_dp.clipping.engine.checked_step`)."""
        return engine.checked_step(self, self._private_step, data)

    def _private_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        validation.check_private_step(self)
        optimizer, variables = self.optimizer, self.trainable_variables

        # The batch reaches what the step keeps only through what the step
        # releases (`engine.checked_step`): its size, public to the
        # accounting, and below the clipped sum and adaptive count, noised.
        batch_size = engine.released(tf.shape(tf.nest.flatten(x)[0])[0])
        # C, sigma, sampling and divisor of this logical step, read once.
        step = self._mechanism.fix(
            batch_size, engine.released(engine.rows_agree(batch_size, (x, y, sample_weight))))
        num_microbatches = optimizer.dp_settings.num_microbatches or batch_size
        clipped = self._clipped_gradient_sum(
            engine.as_batch(x, y, sample_weight), num_microbatches, variables, step.bound,
            step.rows_per_unit)
        # Released layers the forward pass ran that Keras does not track (one
        # a Lambda closes over: review round 139, 2.48 reported against
        # 2.97): the graph traced their calls. Recorded before any step runs.
        preprocessing.record_releases_of(
            [preprocessing.release_of(layer) for layer in
             preprocessing.layers_called_in([tf.compat.v1.get_default_graph()])],
            self.privacy_ledger)
        counted = batch_maps.step_reads_problem(tf.compat.v1.get_default_graph())
        if counted:
            raise ValueError(
                f"The private step {counted}. Fix: compute each example from its own "
                "values alone (no counter in the maps of its examples).")
        # Outputs of the batch's rows, as the clipping took them: a free
        # tensor shaped while the step runs (from a variable) could broadcast
        # one example over rows of its own, each clipped to C (review round
        # 33: 4 C from an example made 4 rows, under ghost).
        step.also_requires(distribute.on_every_replica(engine.released(
            engine.rows_agree(batch_size, clipped.outputs))), mechanism.Refusal.UNEVEN_ROWS)
        # Each replica clipped its own examples; the noise goes on the sum
        # over all of them (one all-reduce; identity on one device).
        total = distribute.sum_over_replicas({
            "grad_sum": clipped.grad_sum, "loss": tf.reduce_sum(clipped.losses),
            "nonfinite": tf.cast(clipped.num_nonfinite, tf.float32),
            "centered_within": clipped.centered_within,
            "microbatches": tf.cast(num_microbatches, tf.float32)})
        # Released after the all-reduce, which packs them with the logs:
        # the clipped sum and the count, noised; the batches' sizes, public.
        total.update(engine.released(
            {key: total[key] for key in ("grad_sum", "centered_within", "microbatches")}))
        regularization_loss, regularization_grads = self._regularization(variables)
        divisor = step.divisor(total["microbatches"], batch_size // num_microbatches)

        # Per-example losses over the same divisor as the gradient, so padding
        # rows of Poisson batches do not dilute the reported loss.
        data_loss = total["loss"] / divisor
        self._loss_tracker.update_state(data_loss + regularization_loss,
                                        sample_weight=batch_size)
        logs = self._compute_metrics_without_padding(x, y, clipped.outputs, sample_weight)
        # The commit (record, noise, update) comes last: an op of the step
        # that fails (a metric on a bad label) fails it before anything is
        # recorded or applied.
        with tf.control_dependencies(tf.nest.flatten(logs)):
            optimizer.apply_private(total["grad_sum"], divisor, variables,
                                    regularization_grads, step, total["centered_within"])
        self._mechanism.count_refusal(step)
        logs["nonfinite_gradients"] = tf.cast(total["nonfinite"], tf.int64)
        if optimizer.adaptive_clipping:
            logs["l2_norm_clip"] = step.l2_norm_clip  # This step's C.
        return distribute.reducible_logs(logs)

    def test_step(self, data):
        # Keras' logs, in the shape Keras can reduce over several workers
        # (its own test step returns scalars, which it then fails to reduce).
        return distribute.reducible_logs(super().test_step(data))

    def _clipped_gradient_sum(self, batch, num_microbatches, variables, bound,
                              rows_per_unit=1):
        """Runs the chosen per-example engine (see `clipping_engine`) with the
        step's `keras_dp.clipping.Bound`, each `rows_per_unit` consecutive
        rows one unit (user) clipped once; returns its `ClippedSum`: the
        step's one call into the clipping package (no subclass may replace
        it, `validation.check_private_step_kept`).
        """
        return engine.clipped_gradient_sum(self, batch, num_microbatches, variables,
                                           bound, report=self._engine_chosen,
                                           rows_per_unit=rows_per_unit)

    def _engine_chosen(self, name, reason):
        """Keeps the engine the traced step runs, and says why when "auto"
        could not use ghost clipping (the vectorized engine is slower)."""
        self.clipping_engine_in_use = name
        if reason:
            warnings.warn(
                f'clipping_engine="auto" runs the vectorized engine (exact, and '
                f"slower than ghost clipping): {reason}", stacklevel=2)

    def _compute_metrics_without_padding(self, x, y, y_pred, sample_weight):
        """Keras' metrics, on the real rows only when batches are padded.

        Keras gives sample weights to `weighted_metrics` alone, so plain
        `metrics` would count the zero-weight padding rows of Poisson batches.
        """
        real = clipping_losses.real_rows({"sample_weight": sample_weight})
        if real is None:
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        # A row is padding when its weights are 0 in every output.
        keep = tf.logical_or(tf.logical_not(self._mechanism.padded()), real)
        # tf.boolean_mask's gather, with the indices formed once for all.
        kept = tf.reshape(tf.where(keep), [-1])
        rows = lambda t: None if t is None else tf.gather(t, kept)  # noqa: E731
        x, y, y_pred, sample_weight = tf.nest.map_structure(
            rows, (x, y, y_pred, sample_weight))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _regularization(self, variables):
        """Weight regularization: data-independent, so it is not privatized."""
        with tf.GradientTape() as tape:
            losses = self._get_regularization_losses()
            total = tf.add_n(losses) if losses else None
        if total is None:
            return 0.0, None
        return total, clipping.gradients(tape, total, variables)


def _refuse_saving_random_states(model):
    """Refuses `tf.saved_model.save` of a private model with random states
    (a Dropout's SeedGenerator): the SavedModel would hold the state the
    training's draws came from, which keeps their masks unknown (review
    round 176), and the save cannot give it fresh values and then the
    model its own back."""
    if serving.random_states(model):
        raise ValueError(
            "tf.saved_model.save of this private model would write the state of its "
            "random layers (a Dropout's SeedGenerator), from which every mask of "
            "training can be replayed. Export with keras_dp.export_for_serving(private, "
            "path) or private.export(path), which write fresh random states.")


@contextlib.contextmanager
def _variables_kept(model):
    """Puts back `model`'s variables after the block, and refuses the block
    when it changed any (their values before it are the last the private
    step and the ledger account for)."""
    before = [(v, v.numpy()) for v in model.variables]
    try:
        yield
    finally:
        changed = [(v, value) for v, value in before if not _same_values(v.numpy(), value)]
        for variable, value in changed:
            variable.assign(value)
    if changed:
        raise ValueError(
            f"Evaluating the private model wrote its variable {changed[0][0].path} (put back): "
            "a layer keeping a value of the batches it evaluates would carry examples "
            "outside the private step into training and the saved model, un-noised. "
            "Keep layers from writing state while evaluating; compute such state before "
            "training (keras_dp.adapt).")


def _same_values(now, before):
    return np.array_equal(now, before, equal_nan=np.asarray(before).dtype.kind in "fc")


def _num_rows(x):
    """The number of rows of a batch of inputs, if known."""
    return (list(getattr(tf.nest.flatten(x)[0], "shape", [])) or [None])[0]


@keras.saving.register_keras_serializable(package="keras_dp")
class DPModel(_PrivateTrainStep, keras.Model):
    """A `keras.Model` whose training step is DP-SGD.

    Use it exactly like `keras.Model` (functional: `DPModel(inputs, outputs)`,
    or subclass it), then compile with a DP optimizer.

    Example:
    ```python
    inputs = keras.Input((784,))
    outputs = keras.layers.Dense(10)(inputs)
    model = keras_dp.DPModel(inputs, outputs)
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ```
    """

    def __new__(cls, *args, **kwargs):
        # Like keras.Model, hand functional construction to a Functional
        # class; keras would otherwise rewrite DPModel's own bases.
        if cls is DPModel and functional_init_arguments(args, kwargs):
            return DPFunctional(*args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


@keras.saving.register_keras_serializable(package="keras_dp")
class DPFunctional(_PrivateTrainStep, Functional):
    """What `DPModel(inputs, outputs)` builds: a private functional model."""


@keras.saving.register_keras_serializable(package="keras_dp")
class DPSequential(_PrivateTrainStep, keras.Sequential):
    """A `keras.Sequential` whose training step is DP-SGD."""


@keras.saving.register_keras_serializable(package="keras_dp")
class PrivateModel(_PrivateTrainStep, keras.Model):
    """Wraps a model, sharing its layers and weights, with a private step."""

    def __init__(self, model, **kwargs):
        kwargs.setdefault("name", f"private_{model.name}")
        super().__init__(**kwargs)
        self.model = model
        # Built with its model: summary() and count_params() work before fit.
        self.built = model.built

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    @property
    def output_names(self):
        """The wrapped model's output names, by which `compile` matches a
        dict of losses, loss weights or metrics to a list of outputs."""
        return getattr(self.model, "output_names", None)

    @property
    def base_model(self):
        """The wrapped model (shared layers and weights), for serving."""
        return self.model

    def fit(self, x=None, y=None, batch_size=None, epochs=1, sample_weight=None, **kwargs):
        """`DPModel.fit`; a Keras Hub task's preprocessor runs on each example
        first (before sampling, so Poisson batches hold preprocessed examples)."""
        x, y, sample_weight = hub_tasks.preprocessed_examples(self.model, x, y, sample_weight)
        if kwargs.get("validation_data") is not None:
            kwargs["validation_data"] = hub_tasks.preprocessed_validation(self.model,
                                                                 kwargs["validation_data"])
        return super().fit(x, y, batch_size=batch_size, epochs=epochs,
                           sample_weight=sample_weight, **kwargs)

    def predict(self, x, *args, **kwargs):
        """Keras' `predict`; a Keras Hub task's, with its preprocessor, for a task."""
        if getattr(self.model, "preprocessor", None) is not None:
            return self.model.predict(x, *args, **kwargs)
        return super().predict(x, *args, **kwargs)

    def get_config(self):
        return {"name": self.name,
                "model": keras.saving.serialize_keras_object(self.model)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects)
        return cls(model, **config)


def make_private(model, clipping_engine=None, prior_ledger=None):
    """Returns a private version of `model` that shares its layers and weights.

    The privacy ledger belongs to `model`'s variables: wrapping the same
    model again (or a larger model around it) continues its spending.
    Copies of its values in other variables (`set_weights` into a fresh
    model, a base model saved alone and loaded) are not followed: save the
    private model, or state the spending with `prior_ledger`.

    Args:
        model: any Keras model: Sequential, functional or subclassed.
        clipping_engine: "auto", "ghost" or "vectorized" (see
            `DPModel.clipping_engine`); None keeps a private model's engine
            and gives a new one "auto".
        prior_ledger: privacy already spent on this data by `model`'s
            weights, added to the ledger: a list of
            `keras_dp.ledger.Segment`, or another model's `privacy_ledger`.

    Returns:
        A private model (`keras_dp.models.PrivateModel`, a `keras.Model`
        calling `model`) whose `fit` / `train_on_batch` run DP-SGD. Compile
        it with a DP optimizer. A model that is already private (a
        `keras_dp.DPModel`, or an earlier result) is returned as is.

    Example:
    ```python
    private = keras_dp.make_private(model)
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0,
                                                  noise_multiplier=1.1),
                    loss="sparse_categorical_crossentropy")
    private.fit(x, y, batch_size=256)
    ```
    """
    if isinstance(model, _PrivateTrainStep):
        private = model
        if clipping_engine is not None:
            private.clipping_engine = clipping_engine
    elif isinstance(model, keras.Model):
        validation.check_own_train_step(model)
        private = PrivateModel(model, clipping_engine=clipping_engine or "auto")
    else:
        raise TypeError(
            f"make_private expects a keras.Model; received {type(model).__name__}. "
            "Wrap layers in keras.Sequential([...]) first."
        )
    # The variables' ledger, composed now: histories that cannot be composed
    # are refused when wrapped, before any step.
    privacy_ledger = private.privacy_ledger
    if prior_ledger is not None:
        privacy_ledger.add(prior_ledger)
    preprocessing.check_adapted_layers(private)
    return private
