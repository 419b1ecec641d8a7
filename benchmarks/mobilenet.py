"""Private vs. non-private training speed of MobileNetV2, side by side in one run.

The model: keras.applications.MobileNetV2(alpha=0.35, weights=None,
input_shape=(32, 32, 3), classes=10) with every BatchNormalization replaced
by a GroupNormalization (batch statistics mix the examples, so DP-SGD cannot
use them; `with_group_normalization`). It measures examples/second of
train_on_batch on one fixed random batch after warm-up steps for:

  keras       non-private Keras (SGD)
  ghost       make_private(clipping_engine="ghost") + DPKerasSGD (noise 1.1, clip 1.0)
  vectorized  the same with clipping_engine="vectorized" (not by default: at
              batch 64 it asked for 31 GiB and ran out of memory)

in interleaved rounds, each keeping its best round, so that load from other
processes affects all alike, and prints each private configuration's ratio
to non-private Keras. Only the ratios are meant to be compared: absolute
examples/second depend on the machine and its load.

Usage:
  python benchmarks/mobilenet.py
  TF_ENABLE_ONEDNN_OPTS=0 python benchmarks/mobilenet.py --configs=keras,ghost --repeats=3
"""

import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

FLAGS = flags.FLAGS

PRIVATE = ("ghost", "vectorized")
CLASSES = 10


def group_normalization_for(layer):
    """A GroupNormalization in place of a BatchNormalization `layer`.

    Args:
        layer: a built `keras.layers.BatchNormalization` on channels last.

    Returns:
        A `keras.layers.GroupNormalization` with `gcd(channels, 8)` groups
        (the groups must divide the channels), the same epsilon, name and
        affine weights switched on or off as in `layer`.
    """
    import keras
    channels = layer.moving_mean.shape[0]
    return keras.layers.GroupNormalization(
        groups=math.gcd(channels, 8), axis=layer.axis, epsilon=layer.epsilon,
        center=layer.center, scale=layer.scale, name=layer.name)


def with_group_normalization(model):
    """`model` rebuilt with every BatchNormalization a GroupNormalization.

    Args:
        model: a functional or Sequential Keras model.

    Returns:
        A new model (`keras.models.clone_model`, fresh weights) of the same
        architecture otherwise.
    """
    import keras

    def clone(layer):
        if isinstance(layer, keras.layers.BatchNormalization):
            return group_normalization_for(layer)
        return layer.__class__.from_config(layer.get_config())

    def call(layer, *args, **kwargs):
        if isinstance(layer, keras.layers.GroupNormalization):
            # BatchNormalization's call took a mask (None here), GroupNormalization's has none.
            kwargs.pop("mask", None)
        return layer(*args, **kwargs)

    return keras.models.clone_model(model, clone_function=clone, call_function=call)


def mobilenet_v2():
    """The benchmark's model: MobileNetV2 (alpha 0.35, 32x32) with GroupNormalization."""
    import keras
    keras.utils.set_random_seed(0)
    return with_group_normalization(keras.applications.MobileNetV2(
        alpha=0.35, weights=None, input_shape=(32, 32, 3), classes=CLASSES))


def build(config):
    """Returns the compiled model of one configuration."""
    import keras
    import keras_dp
    model = mobilenet_v2()
    if config in PRIVATE:
        model = keras_dp.make_private(model, clipping_engine=config)
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                        learning_rate=0.01, seed=0)
    else:
        optimizer = keras.optimizers.SGD(learning_rate=0.01)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy())
    return model


def examples_per_second(model, x, y):
    """Examples/second of --steps train_on_batch calls on one batch."""
    start = time.perf_counter()
    for _ in range(FLAGS.steps):
        logs = model.train_on_batch(x, y, return_dict=True)
    float(logs["loss"])  # Reading a value waits for the last step.
    return FLAGS.steps * len(x) / (time.perf_counter() - start)


def main(argv):
    del argv
    import numpy as np
    unknown = set(FLAGS.configs) - {"keras", *PRIVATE}
    if unknown or "keras" not in FLAGS.configs:
        raise app.UsageError(f"--configs needs keras and takes ghost, vectorized; "
                             f"got {FLAGS.configs}.")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(FLAGS.batch_size, 32, 32, 3)).astype("float32")
    y = rng.integers(0, CLASSES, FLAGS.batch_size)
    models = {}
    for config in FLAGS.configs:
        models[config] = build(config)
        for _ in range(FLAGS.warmup_steps):
            models[config].train_on_batch(x, y)
    best = {config: 0.0 for config in models}
    for _ in range(FLAGS.repeats):
        for config, model in models.items():
            best[config] = max(best[config], examples_per_second(model, x, y))
    print(f"MobileNetV2 (alpha 0.35, 32x32, GroupNormalization), batch {FLAGS.batch_size}, "
          f"best of {FLAGS.repeats} rounds of {FLAGS.steps} steps, "
          f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'unset')}")
    print(f"{'config':<12}{'examples/s':>12}{'ratio':>8}")
    for config, speed in best.items():
        print(f"{config:<12}{speed:>12.0f}{speed / best['keras']:>8.2f}")


def define_flags():
    """The command line's flags (defined only when run: the tests import this module)."""
    flags.DEFINE_list("configs", "keras,ghost", "Configurations (see the docstring).")
    flags.DEFINE_integer("batch_size", 64, "Examples per step.")
    flags.DEFINE_integer("steps", 20, "Timed training steps per round.")
    flags.DEFINE_integer("warmup_steps", 3, "Untimed steps first (tracing).")
    flags.DEFINE_integer("repeats", 3,
                         "Interleaved timed rounds; each configuration keeps its best.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
