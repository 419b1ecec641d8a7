"""The clipping norms a DP optimizer holds: one C, one per layer, or adaptive.

`l2_norm_clip` of a DP optimizer is one of:

* a number C: flat clipping, every example's gradient to norm C;
* a dict `{layer_name: C_l}` covering every trainable layer: per-layer
  clipping, the step's sensitivity sqrt(sum_l C_l^2) and the noise
  sigma * sqrt(sum_l C_l^2) on every coordinate (so the ledger records the
  same multiplier sigma);
* `AdaptiveClipping(...)` (Andrew et al. 2021): each logical step also
  releases a noised count of the examples within C, and C moves
  geometrically toward a target quantile of the gradient norms.

`ClipNorms` holds the current norms in a variable the train step reads once
per logical step (through `keras_dp.mechanism`); what changes them (a setter,
an adaptive update) applies from the next logical step.
"""

import math

import keras
import numpy as np
import tensorflow as tf


def _is_real(value):
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_positive(name, value, hint):
    """Refuses a `value` that is not a finite number > 0.

    Raises:
        ValueError: naming `name`, and `hint`: what to give instead.
    """
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0; received {name}={value!r}. "
                         f"{hint}")


@keras.saving.register_keras_serializable(package="keras_dp")
class AdaptiveClipping:
    """Adaptive clipping: C follows a quantile of the gradient norms, privately.

    Each logical step releases, beside the noisy gradient sum, the noisy count
    of its examples whose gradient norm is at most the current C (centered:
    each example counts 1/2 or -1/2, so adding or removing one moves it by
    1/2), and moves C geometrically toward the `target_quantile` of the norms:
    C <- C * exp(-learning_rate * (b - target_quantile)), b the noisy fraction
    within C. The gradient's noise multiplier is raised to
    sigma_g = (sigma^-2 - z^-2)^(-1/2), z the count's multiplier, so that the
    pair is worth exactly one Gaussian release of multiplier sigma: the
    ledger records sigma and epsilon includes the count (Andrew et al. 2021,
    Theorem 1).

    Args:
        initial_l2_norm_clip: C of the first step.
        target_quantile: the fraction of examples whose gradient should be
            within C, in (0, 1). 0.5 (the median) by default.
        learning_rate: eta of the geometric update, > 0. 0.2 by default.
        count_noise_multiplier: z, the count's noise std over its
            sensitivity 1/2; it must exceed the optimizer's
            noise_multiplier. None (default): a tenth of the expected
            examples per logical step, i.e. a count noise std of 1/20 of
            them (TF Privacy's recommendation).

    Example:
    ```python
    optimizer = keras_dp.DPKerasSGD(
        l2_norm_clip=keras_dp.AdaptiveClipping(initial_l2_norm_clip=1.0),
        noise_multiplier=1.1, learning_rate=0.1)
    ```
    """

    def __init__(self, initial_l2_norm_clip=1.0, target_quantile=0.5, learning_rate=0.2,
                 count_noise_multiplier=None):
        check_positive("initial_l2_norm_clip", initial_l2_norm_clip,
                       "It is C of the first step; 1.0 is a common start.")
        if not _is_real(target_quantile) or not 0 < target_quantile < 1:
            raise ValueError("target_quantile must be in (0, 1); received "
                             f"target_quantile={target_quantile!r}. 0.5 targets the median.")
        check_positive("learning_rate", learning_rate, "0.2 is the usual choice.")
        if count_noise_multiplier is not None:
            check_positive("count_noise_multiplier", count_noise_multiplier,
                           "None chooses a tenth of the expected batch size.")
        self._initial_l2_norm_clip = float(initial_l2_norm_clip)
        self._target_quantile = float(target_quantile)
        self._learning_rate = float(learning_rate)
        self._count_noise_multiplier = (None if count_noise_multiplier is None
                                        else float(count_noise_multiplier))

    # Read-only, as checked above: the step, its checks and the ledger read
    # them at different times (review round 97: count_noise_multiplier set to
    # 0 after construction released the count without noise, sigma recorded).
    @property
    def initial_l2_norm_clip(self):
        return self._initial_l2_norm_clip

    @property
    def target_quantile(self):
        return self._target_quantile

    @property
    def learning_rate(self):
        return self._learning_rate

    @property
    def count_noise_multiplier(self):
        return self._count_noise_multiplier

    def count_multiplier_for(self, expected_count):
        """z for a logical step of `expected_count` examples (a float64 tensor)."""
        if self.count_noise_multiplier is not None:
            return tf.constant(self.count_noise_multiplier, tf.float64)
        return tf.cast(expected_count, tf.float64) / 10.0

    def check_noise(self, noise_multiplier, expected_count=None):
        """Refuses a count noise that leaves no noise for the gradient.

        Args:
            noise_multiplier: sigma of the pair.
            expected_count: expected examples per logical step, if known.

        Raises:
            ValueError: when z <= sigma.
        """
        if self.count_noise_multiplier is not None:
            z, source = self.count_noise_multiplier, "count_noise_multiplier"
        elif expected_count:
            z, source = expected_count / 10.0, f"a tenth of the batch size {expected_count:g}"
        else:
            return
        if noise_multiplier and z <= noise_multiplier:
            raise ValueError(
                f"AdaptiveClipping's count noise multiplier ({source}: {z:g}) must exceed "
                f"noise_multiplier={noise_multiplier:g}: the gradient's multiplier "
                "(sigma^-2 - z^-2)^(-1/2) would be infinite. Use a larger batch size or "
                "set a larger count_noise_multiplier.")

    def next_clip(self, clip, noisy_fraction):
        """The geometric update C * exp(-eta * (b - target)) (graph code)."""
        step = self.learning_rate * (noisy_fraction - self.target_quantile)
        return clip * tf.exp(-tf.cast(step, clip.dtype))

    def get_config(self):
        return {"initial_l2_norm_clip": self.initial_l2_norm_clip,
                "target_quantile": self.target_quantile,
                "learning_rate": self.learning_rate,
                "count_noise_multiplier": self.count_noise_multiplier}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return f"AdaptiveClipping({', '.join(f'{k}={v!r}' for k, v in self.get_config().items())})"


_CLIP_HINT = ("It is the per-example L2 bound C: 1.0 is a common start, and "
              "keras_dp.AdaptiveClipping() tunes it privately.")


class ClipNorms:
    """The clipping norms of a DP optimizer and how to change them.

    Args:
        l2_norm_clip: a number, a dict `{layer_name: C_l}` or an
            `AdaptiveClipping` (see the module docstring).
    """

    def __init__(self, l2_norm_clip):
        self.adaptive = l2_norm_clip if isinstance(l2_norm_clip, AdaptiveClipping) else None
        self.layer_names = None
        if self.adaptive:
            values = [self.adaptive.initial_l2_norm_clip]
        elif isinstance(l2_norm_clip, dict):
            self.layer_names = tuple(l2_norm_clip)
            values = self._per_layer_values(l2_norm_clip)
        else:
            check_positive("l2_norm_clip", l2_norm_clip, _CLIP_HINT)
            values = [l2_norm_clip]
        # Every replica computes the same update: the first one's is kept.
        self._values = tf.Variable(np.array(values, np.float64), trainable=False,
                                   name="dp_l2_norm_clips",
                                   aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def _per_layer_values(self, norms):
        if not norms:
            raise ValueError("l2_norm_clip={} names no layer: give {layer_name: C_l} for "
                             "every trainable layer, or one number.")
        if set(self.layer_names) != set(norms):
            raise ValueError(f"l2_norm_clip must name the layers {list(self.layer_names)}, "
                             f"as it did; received {sorted(norms)}.")
        for name, value in norms.items():
            if not isinstance(name, str):
                raise ValueError(f"The keys of l2_norm_clip are layer names; received {name!r}.")
            check_positive(f"l2_norm_clip[{name!r}]", value, _CLIP_HINT)
        return [float(norms[name]) for name in self.layer_names]

    @property
    def num_groups(self):
        return 1 if self.layer_names is None else len(self.layer_names)

    @property
    def value(self):
        """C (a float), or `{layer_name: C_l}` for per-layer clipping."""
        values = self._values.numpy().tolist()
        return values[0] if self.layer_names is None else dict(zip(self.layer_names, values))

    @value.setter
    def value(self, new):
        if self.layer_names is None:
            check_positive("l2_norm_clip", new, _CLIP_HINT)
            self._values.assign([float(new)])
        else:
            if not isinstance(new, dict):
                raise ValueError("This optimizer clips per layer: set l2_norm_clip to a dict "
                                 f"{{layer_name: C_l}} for {list(self.layer_names)}.")
            self._values.assign(self._per_layer_values(new))

    def tensor(self):
        """The `[G]` float64 norms, read when the step runs."""
        return tf.convert_to_tensor(self._values)

    def assign(self, values):
        """Sets the norms from graph code (the adaptive update)."""
        return self._values.assign(values)

    def config(self):
        """`l2_norm_clip` for `get_config`: an adaptive one starts where this one is."""
        if self.adaptive:
            config = dict(self.adaptive.get_config(), initial_l2_norm_clip=self.value)
            return keras.saving.serialize_keras_object(AdaptiveClipping(**config))
        return self.value

    def groups(self, variables):
        """The group of each trainable variable: the innermost layer of its
        path that `l2_norm_clip` names (None for one group).

        Raises:
            ValueError: a variable in no named layer, or a name matching none.
        """
        if self.layer_names is None:
            return None
        index = {name: i for i, name in enumerate(self.layer_names)}
        groups, missing, used = [], [], set()
        for variable in variables:
            layers = getattr(variable, "path", variable.name).split("/")[:-1]
            named = [index[layer] for layer in layers if layer in index]
            if not named:
                missing.append("/".join(layers) or variable.name)
                continue
            groups.append(named[-1])
            used.add(named[-1])
        if missing:
            raise ValueError(
                "Per-layer clipping needs a norm for every trainable layer; l2_norm_clip "
                f"names none of the layers of {sorted(set(missing))}. Add them to the dict.")
        unused = [name for name, i in index.items() if i not in used]
        if unused:
            raise ValueError(f"l2_norm_clip names {unused}, which hold no trainable weight of "
                             "the model. Use the names of its layers (model.layers).")
        return tuple(groups)


def deserialize(l2_norm_clip):
    """`l2_norm_clip` from a config: a serialized `AdaptiveClipping` becomes one."""
    if isinstance(l2_norm_clip, dict) and "class_name" in l2_norm_clip:
        return keras.saving.deserialize_keras_object(l2_norm_clip)
    return l2_norm_clip
