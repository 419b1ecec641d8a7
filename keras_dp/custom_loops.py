"""Custom training loops on keras-dp's Poisson draws, accounted as fit's steps.

A step is accounted as Poisson sampling only when keras-dp drew its batch
and nobody chose, saw or edited it before the step. So a custom loop does
not hand batches to the step: it hands the step keras-dp's own draws,
`PoissonBatches`, and `train_on_batch(batches)` pulls the next draw itself
(`step_of`). What leaves the step afterwards (`PoissonBatches.last_batch`)
is a plain batch again: given back to `train_on_batch`, it is a full
Gaussian release, like every batch keras-dp did not draw.

Draws are never replayed. A pass over a `keras_dp.data.poisson_dataset`
starts only once the private model's ledger has raised the dataset's pass
counter past the passes spent with its seed (`sampler.draw_fresh`, the
same rule as fit's, saved with the ledger): a second `PoissonBatches`
over the same dataset, a dataset built again with the same seed, or a model
saved and loaded, all draw new passes.

`PrivateSteps` runs keras-io's "training loop from scratch" over such
draws: each iteration is one private step, and yields what the guide's
loop body computes (the batch, its logits and the loss).
"""

import dataclasses
import warnings

import tensorflow as tf

from keras_dp import distribute
from keras_dp import mechanism
from keras_dp import models
from keras_dp import sampler
from keras_dp import validation
from keras_dp.clipping import losses as clipping_losses


class PoissonBatches:
    """The draws of a `keras_dp.data.poisson_dataset`, for a custom loop.

    `private.train_on_batch(batches)` pulls the next logical batch itself
    (its `accumulation_steps` physical batches) and trains on it: the step
    is accounted and divided exactly as fit's steps on the same dataset
    (Poisson sampling with q = B / N, the noisy sum divided by the expected
    batch size B). Each call draws a batch no step of the model's variables
    drew before, also across `PoissonBatches` objects, rebuilt datasets with
    the same seed, and a save and load of the model.

    Args:
        dataset: a `keras_dp.data.poisson_dataset` (or `truncated_poisson_dataset`),
            also after the maps, `prefetch` and `with_options` fit accepts.

    Raises:
        ValueError: for any other dataset, or one whose draws a custom loop
            cannot take exactly: users (`keras_dp.data.user_dataset`) or
            cyclic groups (`participation_groups > 1`). Train those with fit.

    Example:
    ```python
    batches = keras_dp.custom_loops.PoissonBatches(
        keras_dp.data.poisson_dataset(x_train, y_train, expected_batch_size=256))
    for step in range(batches.steps_per_epoch):
        logs = private.train_on_batch(batches, return_dict=True)
        x_seen, y_seen = batches.last_batch  # The real rows just trained on.
    ```
    """

    def __init__(self, dataset):
        self._info = _drawn_info(dataset)
        self._dataset = dataset
        # The pass being drawn, the ledger it was made fresh for, and the
        # physical batches taken from it.
        self._iterator = None
        self._ledger = None
        self._taken = 0
        self._last = None

    @property
    def sampling_info(self):
        """The `keras_dp.data.SamplingInfo` of the draws."""
        return self._info

    @property
    def steps_per_epoch(self):
        """Logical steps (calls of `train_on_batch`) in one pass."""
        return self._info.steps_per_epoch

    @property
    def last_batch(self):
        """`(x, y)`: the real rows (no padding) of the draw trained on last,
        for metrics. A plain batch: trained on again, a full release."""
        if self._last is None:
            raise ValueError("No step has drawn from these PoissonBatches yet: call "
                             "private.train_on_batch(batches) first.")
        return self._last

    def next_step(self, model):
        """The `DrawnStep` of `model`'s next private step: the next logical
        batch, drawn fresh for `model`'s ledger (in Python, before any step)."""
        _check_model(model)
        sampler.check_drawn_layout(model, self._info)
        if self._ledger is not model.privacy_ledger:
            self._iterator = None  # A pass is drawn for one ledger.
        return DrawnStep(self, model)

    def physical_batches(self, model):
        """The physical batches of the next logical batch (a generator), from
        the first of a draw: a draw left part-way (a step broken out of, or
        a batch looked at) ends its pass, or the rest of it would join the
        next draw's batches in one step (review round 74: one example in
        both, 2 C recorded C)."""
        if self._taken % self._info.accumulation_steps:
            self.drop_pass()
        self._last, drawn = None, []
        for _ in range(self._info.accumulation_steps):
            drawn.append(self._next_batch(model))
            yield drawn[-1]
        self._last = _real_rows(drawn)

    def drop_pass(self):
        """Ends the pass under way (after a logical step that did not
        complete: its remaining batches are not a Poisson draw)."""
        self._iterator = None

    def _next_batch(self, model):
        batch = None if self._iterator is None else next(self._iterator, None)
        if batch is None:
            # A new pass: the ledger raises the pass counter past the passes
            # spent with the seed, and the first batch takes its pass at once.
            sampler.account_maps_releases(model, self._dataset)
            sampler.draw_fresh(model, self._info)
            self._iterator, self._ledger = iter(self._dataset), model.privacy_ledger
            self._taken = 0
            batch = next(self._iterator)
        self._taken += 1
        return batch


def _drawn_info(dataset):
    """The `SamplingInfo` of a dataset whose draws a custom loop may take."""
    info = sampler.poisson_info_of(dataset)
    if info is None:
        raise ValueError(
            "PoissonBatches takes a keras_dp.data.poisson_dataset(...): keras-dp "
            f"vouches only for batches it drew; received {type(dataset).__name__}. "
            "Build the dataset with keras_dp.data.poisson_dataset(x, y, "
            "expected_batch_size=...), or pass your own batches to train_on_batch "
            "(each step then a full Gaussian release).")
    if info.unit == "user" or info.participation_groups > 1:
        kind = "users" if info.unit == "user" else "cyclic participation groups"
        raise ValueError(
            f"This Poisson dataset samples {kind}, whose accounting needs every step "
            "of a pass in fit's order; a custom loop's train_on_batch does not take "
            "them. Train it with private.fit(dataset, epochs=...).")
    return info


def _check_model(model):
    """Refuses, before a draw, a model whose steps on these draws would not
    be accounted exactly as fit's."""
    optimizer = model.optimizer
    if optimizer.privatizer.participation_groups > 1:
        raise ValueError(
            f"noise_correlation={optimizer.dp_settings.noise_correlation!r} correlates "
            "the noise of the steps of fit's cyclic groups, which a custom loop does "
            "not draw in. Train with private.fit(keras_dp.data.poisson_dataset(..., "
            "participation_groups=bands)), or use noise_correlation=None.")
    if distribute.num_replicas(model.distribute_strategy) > 1:
        raise ValueError(
            "PoissonBatches trains on one replica: under a strategy of several, fit "
            "splits each draw over the replicas. Train with private.fit(dataset) "
            "inside strategy.scope().")
    if optimizer.is_mid_logical_step():
        raise ValueError(
            "The optimizer is mid-way through a logical batch of gradient_accumulation_"
            f"steps={optimizer.dp_settings.accumulation_steps} (train_on_batch on "
            "plain batches stopped inside one), which a draw may not join. Finish it, "
            "or discard it with private.optimizer.abort_logical_step().")


class DrawnStep:
    """One private step of `train_on_batch` on a `PoissonBatches` draw: its
    sampling (fit's, for the dataset) and batches, and, as a context
    manager, its transaction (a step that does not complete is discarded).

    Args:
        batches: the `PoissonBatches`.
        model: the private model.
    """

    def __init__(self, batches, model):
        self._batches, self._model = batches, model
        info = batches.sampling_info
        # Laid out for the optimizer's settings (`next_step` checked them).
        self.sampling = mechanism.Sampling.of_fit(info, model.optimizer.dp_settings)

    def batches(self):
        """The `(x, y, sample_weight)` physical batches of the step."""
        return self._batches.physical_batches(self._model)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        discarded = self._model.optimizer.abort_logical_step()
        if discarded or kind is not None:
            self._batches.drop_pass()
        if discarded and kind is None:
            warnings.warn(f"A drawn logical step ended after {discarded} physical batches "
                          "and was discarded, neither noised nor recorded.", stacklevel=3)


@dataclasses.dataclass(frozen=True)
class FixedBatch:
    """One private step of `train_on_batch` on a batch keras-dp did not
    draw: a full Gaussian release, divided by its own size."""

    x: object
    y: object
    sample_weight: object
    sampling = mechanism.OUTSIDE_FIT

    def batches(self):
        return [(self.x, self.y, self.sample_weight)]

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        return None


def step_of(model, x, y=None, sample_weight=None, class_weight=None):
    """What a private model's `train_on_batch(x, y, sample_weight)` trains on.

    Args:
        model: the private model.
        x, y, sample_weight, class_weight: train_on_batch's arguments.

    Returns:
        A `DrawnStep` when `x` is a `PoissonBatches` (the next draw), else a
        `FixedBatch` of the arguments.

    Raises:
        ValueError: for targets or weights beside a `PoissonBatches`, or a
            train_on_batch that would join fit's accumulated logical step.
    """
    # The model's own good errors first: the checks below read its DP optimizer.
    validation.check_compiled(model)
    validation.check_dp_optimizer(model.optimizer)
    _check_not_inside_accumulated_fit(model)
    if not isinstance(x, PoissonBatches):
        return FixedBatch(x, y, sample_weight)
    if any(arg is not None for arg in (y, sample_weight, class_weight)):
        raise ValueError(
            "train_on_batch(batches) draws the targets and sample weights with the "
            "inputs from its PoissonBatches; received y, sample_weight or "
            "class_weight too. Call private.train_on_batch(batches) alone (weights "
            "go into keras_dp.data.poisson_dataset(x, y, sample_weight=...)).")
    return x.next_step(model)


def _check_not_inside_accumulated_fit(model):
    """Refuses a train_on_batch that would join a fit's logical steps."""
    steps = model.optimizer.dp_settings.accumulation_steps
    if model.step_mechanism.in_fit and steps > 1:
        raise ValueError(
            "train_on_batch was called during fit() with "
            f"gradient_accumulation_steps={steps}: its batch would be accumulated into "
            "fit's logical step, and an example in both could move the noised sum by "
            "2C. Call it between fits.")


def _real_rows(physical_batches):
    """`(x, y)` of a logical batch's physical batches without their padding
    rows (weight 0 in every output)."""
    kept = []
    for x, y, sample_weight in physical_batches:
        real = clipping_losses.real_rows({"sample_weight": sample_weight})
        rows = tf.reshape(tf.where(real), [-1])
        kept.append(tf.nest.map_structure(
            lambda t, rows=rows: None if t is None else tf.gather(t, rows), (x, y)))
    return tf.nest.map_structure(
        lambda *parts: None if parts[0] is None else tf.concat(parts, 0), *kept)


class PrivateSteps:
    """keras-io's "training loop from scratch", private: iterating it trains.

    Each iteration is one private step of `model` (made private, compiled
    with `optimizer` and `loss`) on the next draw of `dataset`, accounted
    as fit's steps on it, and yields what the guide's loop body computes
    after its `GradientTape` block: `(x, y, logits, loss)`, the real rows
    of the batch, their logits by the model after the step (inference
    mode), and the step's loss. One iteration over it is one pass
    (`steps_per_epoch` steps); each pass draws fresh batches.

    Args:
        model: a Keras model (or a private one).
        optimizer: a DP optimizer (`keras_dp.DPKerasSGD(...)`, ...).
        loss: the loss, as for `compile`.
        dataset: a `keras_dp.data.poisson_dataset`.

    Example:
    ```python
    train_dataset = keras_dp.custom_loops.PrivateSteps(model, optimizer, loss_fn,
        keras_dp.data.poisson_dataset(x_train, y_train, expected_batch_size=64))
    for epoch in range(epochs):
        for step, (x_batch_train, y_batch_train, logits, loss_value) in enumerate(
                train_dataset):
            train_acc_metric.update_state(y_batch_train, logits)
    ```
    """

    def __init__(self, model, optimizer, loss, dataset):
        self.private_model = models.make_private(model)
        self.private_model.compile(optimizer=optimizer, loss=loss)
        self.batches = PoissonBatches(dataset)

    def __len__(self):
        return self.batches.steps_per_epoch

    def __iter__(self):
        for _ in range(len(self)):
            logs = self.private_model.train_on_batch(self.batches, return_dict=True)
            x, y = self.batches.last_batch
            yield x, y, self.private_model(x, training=False), logs["loss"]

