"""Private models: Keras models whose training step is DP-SGD.

`DPModel` and `DPSequential` are `keras.Model` and `keras.Sequential` with a
private `train_step`; `make_private` wraps any existing model (sharing its
layers and weights). Evaluation, prediction, saving and loading are Keras'.
"""

import secrets

import keras
import tensorflow as tf
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_dp import callbacks
from keras_dp import clipping
from keras_dp import data
from keras_dp import ghost
from keras_dp import optimizers
from keras_dp import validation


class _PrivateTrainStep:
    """Mixin giving a Keras model the private train step and privacy ledger."""

    def __init__(self, *args, clipping_engine="auto", **kwargs):
        super().__init__(*args, **kwargs)
        # The ledger: private (logical) steps taken. A model variable, so it is
        # saved with the model and checkpoints, and epsilon resumes after load.
        self._privacy_steps = self.add_weight(
            shape=(), dtype="int64", initializer="zeros", trainable=False,
            name="privacy_steps",
        )
        # Set by fit(): how batches are drawn (read by the accountant).
        self.sampling_info = None
        self.clipping_engine = clipping_engine
        # Expected examples per physical batch: the divisor of the noisy sum.
        # None divides by the realised batch (fixed-size batches).
        self._expected_batch_size = None

    @property
    def clipping_engine(self):
        """How per-example gradients are clipped; both engines are exact.

        "auto" (default): ghost clipping (`keras_dp.ghost`: per-example norms
        from one forward and one backward pass, no per-example gradients)
        when every trainable layer has a norm function and each example is
        its own microbatch, else the vectorized engine (`tf.vectorized_map`
        over per-example gradients). "ghost" or "vectorized" force one;
        "ghost" refuses a model it does not cover. A change takes effect at
        the next training step.
        """
        return self._clipping_engine

    @clipping_engine.setter
    def clipping_engine(self, engine):
        if engine not in ("auto", "ghost", "vectorized"):
            raise ValueError(f'clipping_engine must be "auto", "ghost" or "vectorized"; '
                             f"received {engine!r}.")
        self._clipping_engine = engine
        self.train_function = None  # Traced with the old engine.

    @property
    def privacy_steps(self):
        """Number of private (logical) steps this model has taken."""
        return int(self._privacy_steps.numpy())

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
        if sampling not in ("poisson", "shuffle"):
            raise ValueError(f'fit(sampling=...) must be "poisson" or "shuffle"; '
                             f"received sampling={sampling!r}.")
        info = data.sampling_info_of(x)
        if info is None and _is_in_memory(x):
            if validation_split:
                (x, y, sample_weight), validation_data = _split_off_validation(
                    (x, y, sample_weight), validation_split)
            batch_size = batch_size or 32
            self._check_microbatches_divide(_num_rows(x), batch_size, sampling)
            if sampling == "poisson":
                # One Poisson draw per LOGICAL batch, split over the physical
                # batches that accumulate into it.
                k = self.optimizer.accumulation_steps
                x = data.poisson_dataset(
                    x, y, sample_weight, expected_batch_size=k * batch_size,
                    num_microbatches=self.optimizer.num_microbatches,
                    accumulation_steps=k,
                    seed=secrets.randbits(62) if self.optimizer.secure_mode else None)
                info = data.sampling_info_of(x)
                y = sample_weight = batch_size = None
                kwargs["shuffle"] = False  # Sampling is the dataset's job.
            else:
                self._check_shuffled_accumulation(
                    -(-_num_rows(x) // batch_size), kwargs.get("steps_per_epoch"))
                info = data.SamplingInfo("shuffle", batch_size, _num_rows(x))
        elif info is None:
            self._check_shuffled_accumulation(_num_batches(x), kwargs.get("steps_per_epoch"))
            info = data.SamplingInfo("shuffle", _peek_batch_size(x))
        elif sampling != "poisson":
            raise ValueError(
                "fit(sampling=...) applies to in-memory arrays; this dataset was made "
                "by keras_dp.data.poisson_dataset and is Poisson-sampled."
            )
        self._use_sampling(info)
        kwargs["callbacks"] = _privacy_callbacks_first(kwargs.get("callbacks"))
        return super().fit(x, y, batch_size=batch_size, epochs=epochs,
                           sample_weight=sample_weight, validation_split=validation_split,
                           validation_data=validation_data, **kwargs)

    def _check_accumulation_matches(self, info):
        """Refuses Poisson batches that would not line up with accumulation.

        Each logical batch must be one Poisson draw; were the k physical
        batches of one update drawn separately (or started mid-way), an
        example could join several and contribute more than C.
        """
        optimizer = self.optimizer
        validation.check_dp_optimizer(optimizer)
        k = optimizer.accumulation_steps
        if info.accumulation_steps != k:
            raise ValueError(
                f"The optimizer accumulates gradient_accumulation_steps={k} batches, "
                f"but this Poisson dataset splits each draw into "
                f"{info.accumulation_steps}. Build it with "
                f"keras_dp.data.poisson_dataset(..., accumulation_steps={k}).")
        self._check_not_mid_logical_batch()

    def _check_not_mid_logical_batch(self):
        """Refuses a fit that would add its batches to a logical batch begun
        before it (by train_on_batch): they could hold an example twice."""
        optimizer = self.optimizer
        k = optimizer.accumulation_steps
        if k > 1 and optimizer.built and int(optimizer._physical_steps.numpy()) % k:
            raise ValueError(
                "The optimizer is mid-way through a logical batch (train_on_batch "
                "was called outside fit), so this fit's batches would not line up "
                f"with gradient_accumulation_steps={k}. Finish the logical batch "
                "or use a fresh optimizer.")

    def _check_shuffled_accumulation(self, batches_per_pass, steps_per_epoch):
        """Refuses shuffled batches whose logical batches could span two passes.

        A pass holds each example once; with gradient accumulation over k
        batches, a logical batch that straddles the end of a pass could hold
        an example twice and move the noised sum by 2C.
        """
        validation.check_dp_optimizer(self.optimizer)
        k = self.optimizer.accumulation_steps
        if k == 1:
            return
        self._check_not_mid_logical_batch()
        fix = ("Use Poisson sampling (fit on arrays with sampling='poisson', or "
               "keras_dp.data.poisson_dataset), or a batch_size that makes the "
               f"number of batches per pass a multiple of {k}.")
        if batches_per_pass is None:
            raise ValueError(
                f"gradient_accumulation_steps={k} needs the number of shuffled "
                f"batches per pass, and this input's length is unknown. {fix}")
        if steps_per_epoch not in (None, batches_per_pass):
            raise ValueError(
                f"With shuffled batches and gradient_accumulation_steps={k}, an "
                f"epoch must be one pass ({batches_per_pass} batches); received "
                f"steps_per_epoch={steps_per_epoch}. {fix}")
        if batches_per_pass % k:
            raise ValueError(
                f"A pass of {batches_per_pass} shuffled batches is not a multiple "
                f"of gradient_accumulation_steps={k}, so a logical batch would "
                f"span two passes and could hold an example twice. {fix}")

    def _check_microbatches_divide(self, num_examples, batch_size, sampling):
        """Refuses, before any step, a last shuffled batch k does not divide."""
        validation.check_dp_optimizer(self.optimizer)
        k = self.optimizer.num_microbatches
        if sampling == "shuffle" and k and (num_examples % batch_size) % k:
            raise ValueError(
                f"num_microbatches={k} does not divide the last batch of "
                f"{num_examples % batch_size} examples ({num_examples} examples in "
                f"batches of {batch_size}). Use a number of examples that batch_size "
                "divides, sampling='poisson', or num_microbatches=None."
            )

    def _use_sampling(self, info):
        """Records the sampler; the step's divisor is B for Poisson batches."""
        if info.sampling == "poisson":
            self._check_accumulation_matches(info)
        self.sampling_info = info
        expected = (info.batch_size / info.accumulation_steps
                    if info.sampling == "poisson" else None)
        if expected != self._expected_batch_size:
            self._expected_batch_size = expected
            self.train_function = None  # Retrace: the divisor is a constant.

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
        grad_sum, losses, y_pred, num_nonfinite = self._clipped_gradient_sum(
            batch, num_microbatches, variables)
        regularization_loss, regularization_grads = self._regularization(variables)
        divisor = self._divisor(batch_size, num_microbatches)
        applied = optimizer.apply_private(grad_sum, divisor, variables, regularization_grads)
        self._privacy_steps.assign_add(tf.cast(applied, tf.int64))

        # Per-example losses over the same divisor as the gradient, so padding
        # rows of Poisson batches do not dilute the reported loss.
        data_loss = tf.reduce_sum(losses) / divisor
        self._loss_tracker.update_state(data_loss + regularization_loss,
                                        sample_weight=batch_size)
        logs = self._compute_metrics_without_padding(x, y, y_pred, sample_weight)
        logs["nonfinite_gradients"] = num_nonfinite
        return logs

    def _clipped_gradient_sum(self, batch, num_microbatches, variables):
        """Runs the chosen per-example engine (see `clipping_engine`)."""
        optimizer = self.optimizer
        if self._uses_ghost_clipping():
            try:
                return ghost.clipped_gradient_sum(
                    self, batch, variables, optimizer.l2_norm_clip,
                    ghost.per_example_loss_fn(self))
            except ghost.UnsupportedModelError:
                # add_loss() terms and stray weight reads only show while
                # tracing; "auto" then falls back within the same trace.
                if self.clipping_engine == "ghost":
                    raise
        return clipping.clipped_gradient_sum(
            self._microbatch_loss, variables, batch, num_microbatches,
            optimizer.l2_norm_clip)

    def _uses_ghost_clipping(self):
        engine = self.clipping_engine
        if engine == "vectorized":
            return False
        per_example = self.optimizer.num_microbatches is None
        if engine == "ghost" and not (per_example and ghost.supports(self)):
            raise ValueError(
                'clipping_engine="ghost" needs num_microbatches=None and a norm '
                "function for every trainable layer; missing for: "
                f"{ghost.unsupported_layers(self)}. Register one with "
                'keras_dp.register_norm_function, or use clipping_engine="auto".')
        return per_example and ghost.supports(self)

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

    def _microbatch_loss(self, microbatch):
        """Loss of one microbatch: its compiled loss plus add_loss() terms."""
        x = microbatch["x"]
        y_pred = self(x, training=True)
        loss = self._compile_loss(microbatch["y"], y_pred,
                                  microbatch.get("sample_weight"))
        # add_loss() terms (e.g. activity regularizers) depend on this
        # microbatch only, so they belong to its clipped loss. They ignore
        # sample weights, so a microbatch of padding rows (weight 0) would
        # contribute through them: only microbatches with a real row keep them.
        data_losses = [l for layer in self._flatten_layers()
                       for l in layer._get_own_losses()]
        if data_losses:
            data_loss = tf.add_n(data_losses)
            loss = loss + data_loss * tf.cast(_has_real_row(microbatch), data_loss.dtype)
        return loss, y_pred

    def _regularization(self, variables):
        """Weight regularization: data-independent, so it is not privatized."""
        with tf.GradientTape() as tape:
            losses = self._get_regularization_losses()
            total = tf.add_n(losses) if losses else None
        if total is None:
            return 0.0, None
        return total, clipping.gradients(tape, total, variables)

    def _divisor(self, batch_size, num_microbatches):
        """Expected microbatches per physical batch: what the noisy sum is divided by."""
        if self._expected_batch_size is None:
            return tf.cast(num_microbatches, tf.float32)
        microbatch_size = tf.cast(batch_size // num_microbatches, tf.float32)
        return tf.cast(self._expected_batch_size, tf.float32) / microbatch_size


def _has_real_row(microbatch):
    """Whether a row of `microbatch` has a non-zero sample weight (True without
    sample weights): padding rows carry weight 0 in every output."""
    weights = [w for w in tf.nest.flatten(microbatch.get("sample_weight")) if w is not None]
    if not weights:
        return tf.constant(True)
    return tf.reduce_any([tf.reduce_any(tf.not_equal(w, 0)) for w in weights])


def _is_in_memory(x):
    """True for arrays or tensors (or structures of them), which fit can sample."""
    leaves = tf.nest.flatten(x)
    return bool(leaves) and all(hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                                and not isinstance(leaf, tf.data.Dataset)
                                for leaf in leaves)


def _num_rows(x):
    return int(tf.nest.flatten(x)[0].shape[0])


def _split_off_validation(arrays, validation_split):
    """Keras' validation_split: the last fraction of the rows, before sampling."""
    num_train = int(_num_rows(arrays[0]) * (1.0 - validation_split))
    head = tf.nest.map_structure(lambda a: None if a is None else a[:num_train], arrays)
    tail = tf.nest.map_structure(lambda a: None if a is None else a[num_train:], arrays)
    return head, tail


def _privacy_callbacks_first(callback_list):
    """Puts PrivacyCallback first, so every later callback (CSVLogger,
    TensorBoard, ...) sees the epsilon it adds to the epoch logs."""
    if not callback_list or isinstance(callback_list, keras.callbacks.CallbackList):
        return callback_list
    return sorted(callback_list, key=lambda c: not isinstance(c, callbacks.PrivacyCallback))


def _num_batches(dataset):
    """The number of batches in one pass of a tf.data dataset, or None."""
    if not isinstance(dataset, tf.data.Dataset):
        return None
    count = int(dataset.cardinality())
    return count if count >= 0 else None  # INFINITE or UNKNOWN.


def _peek_batch_size(dataset):
    """The static batch size of a dataset, if it has one (for reporting)."""
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None
    return tf.nest.flatten(spec)[0].shape[0]


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


def make_private(model, clipping_engine=None):
    """Returns a private version of `model` that shares its layers and weights.

    Args:
        model: any Keras model: Sequential, functional or subclassed.
        clipping_engine: "auto", "ghost" or "vectorized" (see
            `DPModel.clipping_engine`); None keeps a private model's engine
            and gives a new one "auto".

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
        if clipping_engine is not None:
            model.clipping_engine = clipping_engine
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"make_private expects a keras.Model; received {type(model).__name__}. "
            "Wrap layers in keras.Sequential([...]) first."
        )
    return PrivateModel(model, clipping_engine=clipping_engine or "auto")



