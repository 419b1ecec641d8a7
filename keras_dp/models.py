"""Private models: Keras models whose training step is DP-SGD.

`DPModel` and `DPSequential` are `keras.Model` and `keras.Sequential` with a
private `train_step`; `make_private` wraps any existing model (sharing its
layers and weights). Evaluation, prediction, saving and loading are Keras'.
"""

import keras
import tensorflow as tf
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_dp import clipping
from keras_dp import optimizers
from keras_dp import validation


class _PrivateTrainStep:
    """Mixin giving a Keras model the private train step and privacy ledger."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The ledger: private (logical) steps taken. A model variable, so it is
        # saved with the model and checkpoints, and epsilon resumes after load.
        self._privacy_steps = self.add_weight(
            shape=(), dtype="int64", initializer="zeros", trainable=False,
            name="privacy_steps",
        )
        # Set by fit(): how batches are drawn (read by the accountant).
        self.sampling_info = None
        # Expected examples per physical batch: the divisor of the noisy sum.
        # None divides by the realised batch (fixed-size batches).
        self._expected_batch_size = None

    @property
    def privacy_steps(self):
        """Number of private (logical) steps this model has taken."""
        return int(self._privacy_steps.numpy())

    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        validation.check_dp_optimizer(self.optimizer)
        validation.check_layers(self)
        validation.check_loss(self)
        optimizer = self.optimizer
        variables = self.trainable_variables

        batch = {"x": x, "y": y}
        if sample_weight is not None:
            batch["sample_weight"] = sample_weight
        batch_size = tf.shape(tf.nest.flatten(x)[0])[0]
        num_microbatches = optimizer.num_microbatches or batch_size
        grad_sum, losses, y_pred, num_nonfinite = clipping.clipped_gradient_sum(
            self._microbatch_loss, variables, batch, num_microbatches,
            optimizer.l2_norm_clip,
        )
        regularization_loss, regularization_grads = self._regularization(variables)
        applied = optimizer.apply_private(
            grad_sum, self._divisor(batch_size, num_microbatches), variables,
            regularization_grads,
        )
        self._privacy_steps.assign_add(tf.cast(applied, tf.int64))

        self._loss_tracker.update_state(
            tf.reduce_mean(losses) + regularization_loss, sample_weight=batch_size
        )
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        logs["nonfinite_gradients"] = num_nonfinite
        return logs

    def _microbatch_loss(self, microbatch):
        """Loss of one microbatch: its compiled loss plus add_loss() terms."""
        x = microbatch["x"]
        y_pred = self(x, training=True)
        loss = self._compile_loss(microbatch["y"], y_pred,
                                  microbatch.get("sample_weight"))
        # add_loss() terms (e.g. activity regularizers) depend on this
        # microbatch only, so they belong to its clipped loss.
        data_losses = [l for layer in self._flatten_layers()
                       for l in layer._get_own_losses()]
        if data_losses:
            loss = loss + tf.add_n(data_losses)
        return loss, y_pred

    def _regularization(self, variables):
        """Weight regularization: data-independent, so it is not privatized."""
        with tf.GradientTape() as tape:
            losses = self._get_regularization_losses()
            total = tf.add_n(losses) if losses else None
        if total is None:
            return 0.0, [tf.zeros_like(v) for v in variables]
        return total, clipping.gradients(tape, total, variables)

    def _divisor(self, batch_size, num_microbatches):
        """Expected microbatches per physical batch: what the noisy sum is divided by."""
        if self._expected_batch_size is None:
            return tf.cast(num_microbatches, tf.float32)
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


def make_private(model):
    """Returns a private version of `model` that shares its layers and weights.

    Args:
        model: any Keras model: Sequential, functional or subclassed.

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
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"make_private expects a keras.Model; received {type(model).__name__}. "
            "Wrap layers in keras.Sequential([...]) first."
        )
    return PrivateModel(model)



