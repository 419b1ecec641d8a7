"""Refusals that keep training private: checked before any weight changes."""

import inspect

import keras
import tensorflow as tf

from keras_dp import distribute
from keras_dp import optimizers
from keras_dp.clipping import ghost
from keras_dp.clipping.layers import recurrent

# Layers whose training-mode output for one example depends on the others in
# the batch: per-example gradients are then undefined and the bound C fails.
_BATCH_MIXING_LAYERS = (keras.layers.BatchNormalization,)

# Recurrent layers without a norm function (`keras_dp.clipping.layers.recurrent`
# covers SimpleRNN, LSTM and GRU); TF 2.21's vectorized_map cannot batch their
# while loop either.
_CONV_RECURRENT_LAYERS = (keras.layers.ConvLSTM1D, keras.layers.ConvLSTM2D,
                          keras.layers.ConvLSTM3D)


def check_private_step(model):
    """Refuses, while the private step is traced, what it cannot keep
    private: the optimizer, layers, loss and distribution strategy."""
    check_dp_optimizer(model.optimizer)
    check_layers(model)
    check_loss(model)
    distribute.check_strategy(model)


def check_compiled(model):
    """Refuses to train a private model that was never compiled, saying how,
    and why the wrapped model's own compile (a Keras Hub task's) does not count."""
    if getattr(model, "optimizer", None) is not None:
        return
    base = getattr(model, "base_model", model)
    own = getattr(base, "optimizer", None) if base is not model else None
    why = ""
    if own is not None:
        why = (f" The wrapped {type(base).__name__} compiled itself with "
               f"{type(own).__name__}, which is not private; its loss is "
               "private.base_model.loss.")
    raise ValueError(
        f"This private model is not compiled.{why} Compile it with a DP optimizer: "
        "private.compile(optimizer=keras_dp.DPKerasAdam(l2_norm_clip=1.0, "
        "noise_multiplier=1.1, learning_rate=...), loss=..., metrics=[...]).")


def check_dp_optimizer(optimizer):
    """Refuses a private model compiled with a non-DP optimizer."""
    if optimizers.is_dp_optimizer(getattr(optimizer, "inner_optimizer", None)):
        raise ValueError(
            "Keras wrapped the DP optimizer in a LossScaleOptimizer (mixed_float16 "
            "policy), which the private step cannot use. Compile with "
            "auto_scale_loss=False: the private step differentiates the sum of "
            "per-example losses, not their mean, and an example whose float16 "
            "gradient overflows contributes zero (counted in nonfinite_gradients)."
        )
    if not optimizers.is_dp_optimizer(optimizer):
        raise ValueError(
            f"A private model needs a DP optimizer, but got {type(optimizer).__name__}. "
            "Use keras_dp.DPKerasSGD / DPKerasAdam / DPKerasAdagrad, or "
            "keras_dp.make_dp_optimizer_class(keras.optimizers.X)(l2_norm_clip=..., "
            "noise_multiplier=..., ...)."
        )


def check_layers(model):
    """Refuses layers whose per-example gradients DP-SGD cannot bound."""
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, _BATCH_MIXING_LAYERS) and layer.trainable:
            raise ValueError(
                f"Layer '{layer.name}' ({type(layer).__name__}) mixes examples of a "
                "batch in training, so one example's gradient depends on the others "
                "and DP-SGD cannot bound it. Use keras.layers.GroupNormalization or "
                "keras.layers.LayerNormalization instead; or, for a pretrained base you "
                "fine-tune in inference mode (called with training=False), freeze its "
                "BatchNormalization layers (layer.trainable = False): they then "
                "normalize with their moving statistics, each example alone."
            )
        _check_recurrent(model, layer)
    if not model.weights:
        raise ValueError(
            f"Model '{model.name}' has no weights yet: Keras could not build it "
            "from its inputs. Call it on a batch first (model(x[:1])), or give it "
            "an input shape (keras.Input).")
    if not model.trainable_variables:
        raise ValueError(
            f"Model '{model.name}' has no trainable weights, so there is nothing to "
            "train privately. Unfreeze some layers (layer.trainable = True)."
        )


def _check_recurrent(model, layer):
    """Refuses a recurrent or stateful layer that no exact engine can train."""
    name = f"Layer '{layer.name}' ({type(layer).__name__})"
    if isinstance(layer, _CONV_RECURRENT_LAYERS):
        raise ValueError(
            f"{name} is a convolutional recurrent layer, for which keras-dp has no exact "
            "per-example gradient path on TensorFlow 2.21. Use convolutions followed by "
            "an LSTM or GRU over their features, or Conv3D / MultiHeadAttention over time.")
    if isinstance(layer, keras.layers.RNN):
        recurrent.check_covered(layer)
        unsupported = ghost.unsupported_layers(model)
        if model.clipping_engine == "vectorized" or model.optimizer.dp_settings.num_microbatches:
            unsupported.append('clipping_engine="vectorized" or num_microbatches is set')
        if unsupported:
            raise ValueError(
                f"{name} is recurrent, and only ghost clipping trains recurrent layers "
                "privately (TF 2.21's vectorized_map cannot batch their while loop), but "
                f"this model cannot use it: {'; '.join(unsupported)}. Use "
                'clipping_engine="auto" with num_microbatches=None, and layers that ghost '
                "clipping covers (keras_dp.register_norm_function for your own).")
    elif getattr(layer, "stateful", False):
        raise ValueError(
            f"{name} is stateful: its state carries over from one batch to the next, so "
            "an example's gradient depends on the examples before it. Use stateful=False.")


# What computes and releases a private step's clipped sum, and what runs it:
# whatever a subclass's replacement returned would be released as the clipped
# sum (review round 10: 100 times it moved the weights by 91 C, recorded C),
# and a train function of its own would run a step nothing reads (round 11).
_PRIVATE_STEP_PARTS = ("_private_step", "_clipped_gradient_sum", "make_train_function")


def check_private_step_kept(cls, private_class):
    """Refuses, where it is defined, a private model class replacing a part of
    `private_class`'s step that computes or releases the clipped sum."""
    replaced = [name for name in _PRIVATE_STEP_PARTS
                if inspect.getattr_static(cls, name) is not vars(private_class)[name]]
    if replaced:
        raise TypeError(
            f"{cls.__name__} overrides {', '.join(replaced)} of keras-dp's private step, "
            "which computes and releases the clipped gradient sum: the privacy guarantee "
            "could not hold. Override train_step() and call super().train_step(data) "
            "(keras-dp reads the whole step), or change the model's call() and "
            "compile(loss=...).")


def check_own_train_step(model):
    """Refuses to wrap a model whose own train_step or compute_loss the
    private step would skip."""
    _check_own_loss(model)
    if type(model).train_step is not keras.Model.train_step:
        raise ValueError(
            f"{type(model).__name__} overrides train_step(), which keras-dp's private "
            "step replaces: it would never be called. Move its computation into the "
            "model's call() and compile(loss=...); for a custom loop, call "
            "private.train_on_batch(x, y) on each batch (docs/migrating_from_tf_privacy.md).")


def _check_own_loss(model):
    """Refuses a model class overriding compute_loss (the private step
    evaluates the compiled loss per example and would ignore it)."""
    if type(model).compute_loss is not keras.Model.compute_loss:
        raise ValueError(
            f"{type(model).__name__} overrides compute_loss(), which the private "
            "step cannot use: it evaluates the loss given to compile(loss=...) per "
            "example. Move the loss into compile(loss=...) (a function of y_true "
            "and y_pred, per example), or its weight penalties into the layers' "
            "kernel_regularizer."
        )


def check_loss(model):
    """Refuses a model whose loss the private step cannot split per example
    (also a wrapped model's own compute_loss)."""
    _check_own_loss(model)
    wrapped = getattr(model, "model", None)
    if isinstance(wrapped, keras.Model):
        _check_own_loss(wrapped)
    unreduced = [loss for loss in tf.nest.flatten(model.loss)
                 if getattr(loss, "reduction", "sum_over_batch_size") in ("none", None)]
    if unreduced:
        raise ValueError(
            f"Loss '{unreduced[0].name}' has reduction='none'. keras-dp computes each "
            "example's loss itself and sums them; compile with the loss's default "
            "reduction (e.g. keras.losses.MeanSquaredError()).")
    if model._compile_loss is None:
        raise ValueError(
            "A private model needs a loss given to compile(loss=...), which keras-dp "
            "evaluates per example. Losses added only with add_loss() or a custom "
            "compute_loss() cannot be split per example."
        )
