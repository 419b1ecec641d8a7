"""Private models: Keras models whose training step is DP-SGD.

`DPModel` and `DPSequential` are `keras.Model` and `keras.Sequential` with a
private `train_step`; `make_private` wraps any existing model (sharing its
layers and weights). Evaluation, prediction, saving and loading are Keras'.

The step reads as Keras' own `train_step`; its parts live with what owns
them: how fit() draws batches in `keras_dp.sampler`, the choice of clipping
engine in `keras_dp.clipping.engine`, the recording of each step and of
fit's sampling in `keras_dp.ledger`, the noise in the DP optimizer.
"""

import keras
import tensorflow as tf
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_dp import accounting
from keras_dp import callbacks
from keras_dp import clipping
from keras_dp import distribute
from keras_dp import ledger
from keras_dp import sampler
from keras_dp import validation
from keras_dp.clipping import engine


class _PrivateTrainStep:
    """Mixin giving a Keras model the private train step and privacy ledger."""

    def __init__(self, *args, clipping_engine="auto", privacy_ledger=None, **kwargs):
        super().__init__(*args, **kwargs)
        # The mechanism of every private step. Model variables, so it is
        # saved with the model and checkpoints, and epsilon resumes after load.
        self._ledger = privacy_ledger or ledger.PrivacyLedger()
        for variable in self._ledger.variables:
            self._track_variable(variable)
        self._ledger_checkpoint = ledger.LedgerCheckpoint(self._ledger)
        # Set by fit(): how batches are drawn (read by the accountant).
        self.sampling_info = None
        self.clipping_engine = clipping_engine
        # Expected examples per physical batch, over all replicas: the divisor
        # of the noisy sum.
        # None divides by the realised batch (fixed-size batches).
        self._expected_batch_size = None

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
        """Number of private (logical) steps this model has taken."""
        return int(self._ledger.total_steps().numpy())

    @property
    def privacy_ledger(self):
        """The `keras_dp.ledger.PrivacyLedger`: the mechanism of every step."""
        return self._ledger

    def privacy_spent(self, delta=None, accountant="rdp"):
        """The privacy spent by every private step this model has taken.

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
            if a step had no noise) and the `dp_accounting` event composed.

        Example:
        ```python
        epsilon, event = private.privacy_spent(delta=1e-5)
        ```
        """
        segments = self._ledger.segments()
        num_examples = max([s.num_examples for s in segments], default=0)
        if delta is None:
            if not num_examples:
                raise ValueError(
                    "The privacy ledger does not record the number of training "
                    "examples, so there is no default delta: pass "
                    "privacy_spent(delta=...), below 1 / num_examples.")
            delta = accounting.default_delta(num_examples)
        elif num_examples:
            accounting.check_delta(delta, num_examples)
        return ledger.epsilon(segments, delta, accountant)

    def set_weights(self, weights):
        """Keras' `set_weights`, except that the privacy ledger is never lowered.

        `EarlyStopping(restore_best_weights=True)` restores weights (the
        ledger's variables among them) from an earlier epoch; the privacy
        spent since stays in the ledger.
        """
        with self._ledger.never_lowered():
            super().set_weights(weights)

    def load_weights(self, *args, **kwargs):
        """Keras' `load_weights`, except that the privacy ledger is never lowered.

        Loading an older checkpoint of this model keeps the spending since;
        weights of another history add that history's spending.
        """
        with self._ledger.never_lowered():
            return super().load_weights(*args, **kwargs)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """Keras' `train_on_batch`: one private step on the batch.

        Under a strategy of several replicas, the batch is the GLOBAL batch,
        the same on every worker (as a dataset given to `fit` yields global
        batches), and each replica takes its share of the rows. Keras would
        otherwise hand the whole batch to every replica, so every example
        would count once per replica in the clipped sum.
        """
        # Its own batch is the divisor, whatever expected size a fit left.
        self._use_expected_batch_size(None)
        if distribute.num_replicas(self.distribute_strategy) > 1:
            # Build from the whole batch first: Keras' symbolic build does not
            # take per-replica values.
            self._maybe_symbolic_build(data_batch=(x, y, sample_weight))
            x, y, sample_weight = distribute.split_over_replicas(
                self.distribute_strategy, (x, y, sample_weight))
        return super().train_on_batch(x, y, sample_weight=sample_weight,
                                      class_weight=class_weight, return_dict=return_dict)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras 3 builds from a batch it averages over the replicas with
        # strategy.reduce, which a multi-worker strategy refuses for an
        # (x, y, sample_weight) tuple. The build only needs the shapes: one
        # replica's share gives them.
        strategy = self.distribute_strategy
        if iterator is not None and distribute.num_workers(strategy) > 1:
            for _, _, batches in iterator:
                data_batch = distribute.first_replica_share(strategy, next(batches))
                break
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, sample_weight=None,
            validation_split=0.0, validation_data=None, sampling="poisson", **kwargs):
        """Trains privately; in-memory data is Poisson-sampled by default.

        Takes `keras.Model.fit`'s arguments plus:

        Args:
            sampling: for in-memory arrays, `"poisson"` (default: each example
                joins each batch with probability q = batch_size / N, batches
                padded to a fixed shape; the accountant's amplification
                applies) or `"shuffle"` (Keras' shuffled fixed-size batches,
                accounted without amplification). A dataset made by
                `keras_dp.data.poisson_dataset` is Poisson; any other dataset
                or generator is treated as `"shuffle"`.
        """
        info, fit_args = sampler.fit_batches(
            self, sampling, x, y, sample_weight, batch_size, validation_split,
            validation_data, kwargs.get("steps_per_epoch"))
        self._use_sampling(info)
        kwargs.update(fit_args)
        kwargs["callbacks"] = callbacks.privacy_callbacks_first(
            ledger.with_pass_starts(kwargs.get("callbacks"), self._ledger))
        with self._ledger.using_sampling(
                ledger.sampling_mechanism(info, self.optimizer.accumulation_steps)):
            return super().fit(epochs=epochs, validation_split=validation_split, **kwargs)

    def _use_sampling(self, info):
        """Records the sampler; the step's divisor is B for Poisson batches."""
        self.sampling_info = info
        self._use_expected_batch_size(info.batch_size / info.accumulation_steps
                                      if info.sampling == "poisson" else None)

    def _use_expected_batch_size(self, expected):
        """The step divides by `expected`, or by its realised batch if None."""
        if expected != self._expected_batch_size:
            self._expected_batch_size = expected
            self.train_function = None  # Retrace: the divisor is a constant.

    def train_step(self, data):
        """One DP-SGD step: clip per example, sum over replicas, noise once."""
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        validation.check_private_step(self)
        optimizer, variables = self.optimizer, self.trainable_variables

        batch_size = tf.shape(tf.nest.flatten(x)[0])[0]
        num_microbatches = optimizer.num_microbatches or batch_size
        grad_sum, losses, y_pred, num_nonfinite = self._clipped_gradient_sum(
            engine.as_batch(x, y, sample_weight), num_microbatches, variables)
        # Each replica clipped its own examples; the noise goes on the sum
        # over all of them (one all-reduce; identity on one device).
        total = distribute.sum_over_replicas({
            "grad_sum": grad_sum, "loss": tf.reduce_sum(losses),
            "nonfinite": tf.cast(num_nonfinite, tf.float32),
            "microbatches": tf.cast(num_microbatches, tf.float32)})
        regularization_loss, regularization_grads = self._regularization(variables)
        divisor = self._divisor(batch_size, total["microbatches"])
        optimizer.apply_private(total["grad_sum"], divisor, variables,
                                regularization_grads, ledger.step_recorder(self, batch_size))

        # Per-example losses over the same divisor as the gradient, so padding
        # rows of Poisson batches do not dilute the reported loss.
        data_loss = total["loss"] / divisor
        self._loss_tracker.update_state(data_loss + regularization_loss,
                                        sample_weight=batch_size)
        logs = self._compute_metrics_without_padding(x, y, y_pred, sample_weight)
        logs["nonfinite_gradients"] = tf.cast(total["nonfinite"], tf.int64)
        return distribute.reducible_logs(logs)

    def test_step(self, data):
        # Keras' logs, in the shape Keras can reduce over several workers
        # (its own test step returns scalars, which it then fails to reduce).
        return distribute.reducible_logs(super().test_step(data))

    def _clipped_gradient_sum(self, batch, num_microbatches, variables):
        """Runs the chosen per-example engine (see `clipping_engine`).

        The step's one call into the clipping package: a subclass may
        override it to run an engine with other options.
        """
        return engine.clipped_gradient_sum(self, batch, num_microbatches, variables)

    def _compute_metrics_without_padding(self, x, y, y_pred, sample_weight):
        """Keras' metrics, on the real rows only when batches are padded.

        Keras gives sample weights to `weighted_metrics` alone, so plain
        `metrics` would count the zero-weight padding rows of Poisson batches.
        """
        if self._expected_batch_size is None or sample_weight is None:
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        real = tf.reshape(sample_weight > 0, [-1])
        keep = lambda t: None if t is None else tf.boolean_mask(t, real)  # noqa: E731
        x, y, y_pred, sample_weight = tf.nest.map_structure(
            keep, (x, y, y_pred, sample_weight))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _regularization(self, variables):
        """Weight regularization: data-independent, so it is not privatized."""
        with tf.GradientTape() as tape:
            losses = self._get_regularization_losses()
            total = tf.add_n(losses) if losses else None
        if total is None:
            return 0.0, None
        return total, clipping.gradients(tape, total, variables)

    def _divisor(self, batch_size, global_microbatches):
        """Expected microbatches per physical batch over all replicas: what the
        noisy sum is divided by (the realised number for fixed-size batches)."""
        if self._expected_batch_size is None:
            return global_microbatches
        num_microbatches = self.optimizer.num_microbatches or batch_size
        microbatch_size = tf.cast(batch_size // num_microbatches, tf.float32)
        return tf.cast(self._expected_batch_size, tf.float32) / microbatch_size


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
        kwargs.setdefault("privacy_ledger", ledger.for_base_model(model))
        super().__init__(**kwargs)
        self.model = model

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

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

    The privacy ledger belongs to `model`: wrapping the same model again (or,
    in the same process, a model whose weights equal a wrapped model's, such
    as one saved and loaded back) continues its spending. keras-dp cannot
    know what a model loaded in a new process was trained on: state it with
    `prior_ledger`.

    Args:
        model: any Keras model: Sequential, functional or subclassed.
        clipping_engine: "auto", "ghost" or "vectorized" (see
            `DPModel.clipping_engine`); None keeps a private model's engine
            and gives a new one "auto".
        prior_ledger: privacy already spent on this data by `model`'s
            weights, added to the ledger: a list of
            `keras_dp.ledger.Segment`, or another model's `privacy_ledger`.

    Returns:
        A `keras_dp.DPModel` whose `fit` / `train_on_batch` run DP-SGD. Compile
        it with a DP optimizer. A model that is already private is returned
        as is.

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
        private = PrivateModel(model, clipping_engine=clipping_engine or "auto")
    else:
        raise TypeError(
            f"make_private expects a keras.Model; received {type(model).__name__}. "
            "Wrap layers in keras.Sequential([...]) first."
        )
    if prior_ledger is not None:
        private.privacy_ledger.add(prior_ledger)
    return private



