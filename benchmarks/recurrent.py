"""Private vs. non-private fit() speed of LSTM and GRU text classifiers, side by side.

The models (issue 28): Embedding(10000, --embedding_dim, mask_zero=True) on
64-token sequences, one LSTM(128) or GRU(128), Dense(2); random token ids
with random trailing padding (id 0, masked). Configurations:

  keras    non-private Keras (SGD), Keras' own recurrent loop
  private  make_private + DPKerasSGD (noise 1.1, clip 1.0), clipping_engine
           "auto" (ghost clipping through keras_dp.clipping.layers.recurrent)

For each model one process builds both and times one fit() epoch of
--fit_examples examples at --batch_size in interleaved rounds (private fit
draws Poisson batches, padded; non-private fit shuffles), counting the steps
after the first --warmup_steps; each keeps its best round, so that load from
other processes affects both alike. It runs once per oneDNN setting
(TF_ENABLE_ONEDNN_OPTS=0 and 1, each in its own process, as TensorFlow reads
it at import) and prints private / non-private examples/second. Only the
ratios are meant to be compared.

Usage:
  python benchmarks/recurrent.py
  python benchmarks/recurrent.py --models=gru --fit_examples=2560 --repeats=3 --onednn=0
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from benchmarks.timing import timed_fit  # noqa: E402

FLAGS = flags.FLAGS

CONFIGS = ("keras", "private")
VOCAB, STEPS, UNITS, CLASSES = 10000, 64, 128, 2


def text_classifier(kind):
    """Embedding(mask_zero), one LSTM or GRU of 128 units, Dense(2) logits."""
    import keras
    keras.utils.set_random_seed(0)
    layer = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU}[kind](UNITS)
    return keras.Sequential([keras.Input((STEPS,), dtype="int32"),
                             keras.layers.Embedding(VOCAB, FLAGS.embedding_dim, mask_zero=True),
                             layer, keras.layers.Dense(CLASSES)])


def build(kind, config):
    import keras
    import keras_dp
    model = text_classifier(kind)
    if config == "private":
        model = keras_dp.make_private(model)
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                        learning_rate=0.1, seed=0)
    else:
        optimizer = keras.optimizers.SGD(learning_rate=0.1)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def padded_tokens(n, rng):
    """`n` random sequences of 8 to 64 tokens, padded with 0 at the end."""
    import numpy as np
    ids = rng.integers(1, VOCAB, size=(n, STEPS)).astype("int32")
    lengths = rng.integers(8, STEPS + 1, size=n)
    ids[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
    return ids, rng.integers(0, CLASSES, n)


def fit_examples_per_second(model, x, y):
    """One fit() epoch: expected examples per wall second and per CPU second
    of this process, after --warmup_steps steps."""
    per_second, cpu_ms_per_step = timed_fit(model, (x, y), FLAGS.batch_size,
                                            FLAGS.warmup_steps)
    return per_second, 1000 * FLAGS.batch_size / cpu_ms_per_step


def measure():
    """Times both configurations of every model in this process; prints a table."""
    import numpy as np
    x, y = padded_tokens(FLAGS.fit_examples, np.random.default_rng(0))
    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    for kind in FLAGS.models:
        models = {config: build(kind, config) for config in CONFIGS}
        best = {config: (0.0, 0.0) for config in CONFIGS}  # (wall, CPU) examples/s.
        for _ in range(FLAGS.repeats):
            for config, model in models.items():
                rates = fit_examples_per_second(model, x, y)
                best[config] = tuple(map(max, best[config], rates))
        (wall, cpu), (private_wall, private_cpu) = best["keras"], best["private"]
        print(f"{kind.upper()}({UNITS}) text classifier, vocabulary {VOCAB}, {STEPS} tokens, "
              f"batch {FLAGS.batch_size}, TF_ENABLE_ONEDNN_OPTS={setting}, best of "
              f"{FLAGS.repeats} fit() epochs: keras {wall:.0f} ex/s ({cpu:.0f} per CPU s), "
              f"private {private_wall:.0f} ex/s ({private_cpu:.0f} per CPU s), ratio "
              f"{private_wall / wall:.2f} (CPU time {private_cpu / cpu:.2f})", flush=True)


def main(argv):
    del argv
    unknown = set(FLAGS.models) - {"lstm", "gru"}
    if unknown:
        raise app.UsageError(f"--models takes lstm and gru; got {FLAGS.models}.")
    if FLAGS.onednn != "both":
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = FLAGS.onednn
        measure()
        return
    for setting in ("0", "1"):  # TensorFlow reads the setting at import: one process each.
        flags_here = [arg for arg in sys.argv[1:] if not arg.startswith("--onednn")]
        subprocess.run([sys.executable, os.path.abspath(__file__), f"--onednn={setting}",
                        *flags_here], check=True,
                       env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS=setting))


def define_flags():
    """The command line's flags (defined only when run)."""
    flags.DEFINE_list("models", "lstm,gru", "Models: lstm, gru.")
    flags.DEFINE_integer("batch_size", 256, "Expected examples per step.")
    flags.DEFINE_integer("embedding_dim", 64, "Width of the token embedding.")
    flags.DEFINE_integer("fit_examples", 256 * 12, "In-memory examples of one fit() epoch.")
    flags.DEFINE_integer("warmup_steps", 2, "Untimed steps first in each epoch.")
    flags.DEFINE_integer("repeats", 2,
                         "Interleaved fit() epochs; each configuration keeps its best.")
    flags.DEFINE_enum("onednn", "both", ["0", "1", "both"],
                      "TF_ENABLE_ONEDNN_OPTS setting(s) to measure.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
