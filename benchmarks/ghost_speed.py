"""Ghost clipping vs. the vectorized engine vs. non-private Keras, side by side.

For each model, measures training examples/second (train_on_batch at a fixed
batch, after warm-up steps) and peak memory of:
  * keras, keras_xla: non-private Keras (SGD), jit_compile False / True;
  * vectorized, vectorized_xla: keras_dp's private model (make_private) with
    clipping_engine="vectorized": keras_dp.clipping.clipped_gradient_sum
    (tf.vectorized_map);
  * ghost, ghost_xla: the same with clipping_engine="ghost":
    keras_dp.ghost.clipped_gradient_sum;
  * ghost_2bw: ghost clipping with a second backward pass instead of
    book-keeping (ghost.clipped_gradient_sum(..., bookkeeping=False));
  * ghost_inner_xla: only the ghost gradient computation compiled with XLA
    (ghost.clipped_gradient_sum(..., jit_compile=True)) inside the ordinary
    train step, whose noise generation stays out of XLA.
All private runs use DPKerasSGD with noise 1.1 and clip 1.0.

Speed: per model, one process builds every configuration and times them in
interleaved rounds (other load on the machine then affects all alike); the
best round of each is reported, with its ratio to the best non-private one.
Memory: each configuration then runs alone in a fresh process, which reports
its peak resident set (and the growth from before the model was built).

Models: (a) the Fashion-MNIST CNN of the DP-SGD literature, (b) a
784-512-512-10 MLP, (c) a 2-block pre-norm transformer classifier (vocab
10000, sequence 64, width 64, 4 heads; its learned position embedding gets a
ghost norm function registered below, an example of the public registry).

Usage:
  python benchmarks/ghost_speed.py                      # all models, all configurations
  python benchmarks/ghost_speed.py --models=cnn --configs=keras,ghost --steps=30
"""

import json
import os
import platform
import resource
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list("models", "cnn,mlp,transformer", "Models to time: cnn, mlp, transformer.")
flags.DEFINE_list("configs",
                  "keras,keras_xla,vectorized,vectorized_xla,ghost,ghost_xla,ghost_2bw,"
                  "ghost_inner_xla",
                  "Configurations to time.")
flags.DEFINE_integer("batch_size", 256, "Examples per training step.")
flags.DEFINE_integer("steps", 30, "Timed training steps per configuration.")
flags.DEFINE_integer("warmup_steps", 3, "Untimed steps first (tracing, compilation).")
flags.DEFINE_integer("repeats", 5, "Interleaved timed rounds per configuration; the best is kept.")
flags.DEFINE_bool("memory", True, "Also measure peak memory (one process per configuration).")
flags.DEFINE_string("child", None, "Internal: 'mode:model:configs' to run in this process.")

CONFIGS = {
    "keras": "non-private Keras, jit_compile=False",
    "keras_xla": "non-private Keras, jit_compile=True",
    "vectorized": "vectorized_map engine, jit_compile=False",
    "vectorized_xla": "vectorized_map engine, jit_compile=True",
    "ghost": "ghost clipping, jit_compile=False",
    "ghost_xla": "ghost clipping, jit_compile=True",
    "ghost_2bw": "ghost, 2nd backward, jit_compile=False",
    "ghost_inner_xla": "ghost, XLA inside step, jit_compile=False",
}
VOCAB_SIZE = 10000
SEQUENCE_LENGTH = 64


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_DEFINITIONS = {}


def _definitions():
    """Imports TensorFlow lazily (the parent process only spawns children)."""
    if _DEFINITIONS:
        return _DEFINITIONS
    import keras
    import tensorflow as tf

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from keras_dp import ghost
    from keras_dp import models as dp_models

    class PositionEmbedding(keras.layers.Layer):
        """Adds a learned embedding of each position to a [B, T, D] sequence."""

        def __init__(self, sequence_length, width, **kwargs):
            super().__init__(**kwargs)
            self.sequence_length, self.width = sequence_length, width

        def build(self, input_shape):
            self.position_embeddings = self.add_weight(
                shape=(self.sequence_length, self.width), initializer="glorot_uniform",
                name="position_embeddings")

        def call(self, inputs):
            return inputs + self.position_embeddings[None, : keras.ops.shape(inputs)[1]]

    def position_embedding_norm(layer, args, kwargs):
        """Ghost norm function of PositionEmbedding: example i's gradient is
        its output gradient (zero-padded to all positions)."""
        inputs = args[0] if args else kwargs["inputs"]
        steps = inputs.shape[1]
        outputs = inputs + layer.position_embeddings[None, :steps]

        def gradients(grad):
            if steps != layer.sequence_length:
                grad = tf.pad(grad, [[0, 0], [0, layer.sequence_length - steps], [0, 0]])
            return [(layer.position_embeddings, ghost.PerExample(grad))]

        return outputs, outputs, gradients

    ghost.register_norm_function(PositionEmbedding, position_embedding_norm)

    class GhostVariantModel(dp_models.PrivateModel):
        """keras_dp's private model with a non-default ghost clipping option
        (a second backward pass, or XLA around the clipped sum only)."""

        def __init__(self, model, bookkeeping=True, inner_xla=False, **kwargs):
            super().__init__(model, **kwargs)
            self._bookkeeping = bookkeeping
            self._inner_xla = inner_xla

        def _clipped_gradient_sum(self, batch, num_microbatches, variables):
            return ghost.clipped_gradient_sum(
                self, batch, variables, self.optimizer.l2_norm_clip,
                ghost.per_example_loss_fn(self), bookkeeping=self._bookkeeping,
                jit_compile=self._inner_xla)

    _DEFINITIONS.update(PositionEmbedding=PositionEmbedding,
                        GhostVariantModel=GhostVariantModel)
    return _DEFINITIONS


def cnn():
    """The Fashion-MNIST CNN of the DP-SGD literature (tanh activations)."""
    import keras
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(10),
    ], name="cnn")


def mlp():
    """A 784-512-512-10 multilayer perceptron."""
    import keras
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ], name="mlp")


def transformer(num_blocks=2, width=64, num_heads=4):
    """A small pre-norm transformer text classifier (token ids to 2 logits)."""
    import keras
    position_embedding = _definitions()["PositionEmbedding"]
    tokens = keras.Input((SEQUENCE_LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB_SIZE, width)(tokens)
    x = position_embedding(SEQUENCE_LENGTH, width)(x)
    for _ in range(num_blocks):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.MultiHeadAttention(num_heads, key_dim=width // num_heads)(h, h)
        x = x + h
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(4 * width, activation="gelu")(h)
        h = keras.layers.Dense(width)(h)
        x = x + h
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(2)(x), name="transformer")


MODELS = {"cnn": cnn, "mlp": mlp, "transformer": transformer}


def build(model_name, config):
    """Returns (compiled model, x, y) of one configuration."""
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_dp
    from keras_dp import ghost

    definitions = _definitions()
    keras.utils.set_random_seed(0)
    model = MODELS[model_name]()
    rng = np.random.default_rng(0)
    b = FLAGS.batch_size
    if model_name == "cnn":
        x = rng.random((b, 28, 28, 1), dtype=np.float32)
    elif model_name == "mlp":
        x = rng.random((b, 784), dtype=np.float32)
    else:
        x = rng.integers(0, VOCAB_SIZE, size=(b, SEQUENCE_LENGTH)).astype("int32")
    y = rng.integers(0, 2 if model_name == "transformer" else 10, size=b).astype("int32")

    if config.startswith("keras"):
        optimizer = keras.optimizers.SGD(learning_rate=0.01)
    else:
        if config in ("ghost_2bw", "ghost_inner_xla"):
            model = definitions["GhostVariantModel"](
                model, bookkeeping=config != "ghost_2bw", inner_xla=config == "ghost_inner_xla")
        else:
            model = keras_dp.make_private(model)
            # The engine keras_dp's train step runs; "ghost" refuses a model
            # that ghost clipping does not cover.
            model.clipping_engine = "ghost" if config.startswith("ghost") else "vectorized"
        if config.startswith("ghost") and not ghost.supports(model):
            raise ValueError(f"ghost clipping does not support {model_name}: "
                             f"{ghost.unsupported_layers(model)}")
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                        learning_rate=0.01, seed=0)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=config.endswith("_xla"))
    return model, tf.constant(x), tf.constant(y)


def _timed_steps(model, x, y, steps):
    import numpy as np
    start = time.perf_counter()
    for _ in range(steps):
        logs = model.train_on_batch(x, y, return_dict=True)
    float(np.asarray(logs["loss"]))  # Waits for the last step.
    return steps * int(x.shape[0]) / (time.perf_counter() - start)


def time_configs(model_name, configs):
    """Examples/s of each configuration, measured in this process.

    The configurations run in interleaved rounds (each round times every
    configuration for --steps steps), so that load from other processes on
    the machine affects all of them alike; the best round is kept.
    """
    built = {}
    for config in configs:
        try:
            model, x, y = build(model_name, config)
            for _ in range(FLAGS.warmup_steps):
                model.train_on_batch(x, y)
            built[config] = (model, x, y)
        except Exception as error:  # Report and go on with the others.
            first_line = (str(error).strip().splitlines() or [""])[0]
            print(f"[{model_name} {config}] failed: {type(error).__name__}: "
                  f"{first_line[:300]}", file=sys.stderr)
    rounds = {config: [] for config in built}
    for _ in range(FLAGS.repeats):
        for config, (model, x, y) in built.items():
            rounds[config].append(_timed_steps(model, x, y, FLAGS.steps))
    return {config: max(speeds) for config, speeds in rounds.items()}


def measure_memory(model_name, config):
    """Peak resident memory of one configuration (run alone in this process)."""
    _definitions()  # TensorFlow, Keras and keras_dp loaded before the baseline.
    rss_before = _rss_mb()
    model, x, y = build(model_name, config)
    rss_built = _rss_mb()
    for _ in range(FLAGS.warmup_steps + 2):
        model.train_on_batch(x, y)
    peak = _peak_rss_mb()
    return {"peak_rss_mb": peak, "working_set_mb": peak - max(rss_before, rss_built)}


def machine_description():
    import keras
    import tensorflow as tf
    return (f"{os.cpu_count()} logical CPUs, "
            f"{'GPU' if tf.config.list_physical_devices('GPU') else 'no GPU'}, "
            f"{platform.machine()}, Python {platform.python_version()}, "
            f"TensorFlow {tf.__version__}, Keras {keras.__version__}")


def run_in_subprocess(mode, model_name, configs):
    """Runs `mode` ("speed" or "memory") in a fresh process; returns its JSON."""
    command = [sys.executable, os.path.abspath(__file__),
               f"--child={mode}:{model_name}:{','.join(configs)}",
               f"--batch_size={FLAGS.batch_size}", f"--steps={FLAGS.steps}",
               f"--warmup_steps={FLAGS.warmup_steps}", f"--repeats={FLAGS.repeats}"]
    done = subprocess.run(command, capture_output=True, text=True)
    for line in done.stderr.splitlines():
        if line.startswith("["):
            print(line, file=sys.stderr)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    print(f"[{model_name} {mode} {configs}] failed: {last[:300]}", file=sys.stderr)
    return {}


def main(argv):
    del argv
    if FLAGS.child:
        mode, model_name, configs = FLAGS.child.split(":")
        configs = configs.split(",")
        if mode == "speed":
            print(json.dumps(time_configs(model_name, configs)))
        else:
            print(json.dumps(measure_memory(model_name, configs[0])))
        return
    for config in FLAGS.configs:
        if config not in CONFIGS:
            raise app.UsageError(f"unknown configuration {config!r}")
    print(f"batch_size={FLAGS.batch_size} steps={FLAGS.steps} repeats={FLAGS.repeats} "
          f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'unset')} "
          f"({machine_description()})")
    for model_name in FLAGS.models:
        speeds = run_in_subprocess("speed", model_name, FLAGS.configs)
        memory = ({c: run_in_subprocess("memory", model_name, [c]) for c in FLAGS.configs}
                  if FLAGS.memory else {})
        keras_speeds = [speeds[c] for c in ("keras", "keras_xla") if c in speeds]
        best = max(keras_speeds) if keras_speeds else None
        keras_memory = [memory[c]["peak_rss_mb"] for c in ("keras", "keras_xla")
                        if memory.get(c)]
        print(f"\nmodel={model_name}")
        print(f"{'configuration':<42} {'examples/s':>11} {'ratio':>7} "
              f"{'peak RSS MB':>12} {'RSS ratio':>10} {'training growth MB':>19}")
        for config in FLAGS.configs:
            speed = speeds.get(config)
            speed_text = f"{speed:,.0f}" if speed else "failed"
            ratio_text = f"{speed / best:.3f}" if speed and best else "-"
            mem = memory.get(config) or {}
            peak_text = f"{mem['peak_rss_mb']:,.0f}" if mem else "-"
            mem_ratio = (f"{mem['peak_rss_mb'] / min(keras_memory):.2f}"
                         if mem and keras_memory else "-")
            growth = f"{mem['working_set_mb']:,.0f}" if mem else "-"
            print(f"{CONFIGS[config]:<42} {speed_text:>11} {ratio_text:>7} "
                  f"{peak_text:>12} {mem_ratio:>10} {growth:>19}")
        ghosts = [speeds[c] for c in ("ghost", "ghost_xla") if speeds.get(c)]
        if ghosts and best:
            print(f"best ghost / best non-private: {max(ghosts) / best:.3f}")


if __name__ == "__main__":
    app.run(main)
