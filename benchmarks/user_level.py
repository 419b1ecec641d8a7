"""User-level vs example-level private fit() speed, side by side (issue 27).

For each model (the benchmark MLP and transformer of benchmarks/models.py),
one process builds two private models of the same weights and times one
fit() epoch of each in interleaved rounds, keeping each one's best round
(load from other processes then affects both alike):

  example  fit(x, y, batch_size=--users_per_batch * --rows_per_user): Poisson
           batches of rows, each row clipped
  user     fit(x, y, user_ids=ids, batch_size=--users_per_batch,
           max_examples_per_user=--rows_per_user): Poisson batches of users,
           each user's --rows_per_user rows summed and clipped once

Every user has exactly --rows_per_user rows, so both draw the same expected
rows per step; rows/second are compared (users of fewer rows than k would
add padding rows, which the user-level step computes too). It runs once per
oneDNN setting (TF_ENABLE_ONEDNN_OPTS=0 and 1, each in its own process, as
TensorFlow reads it at import) and prints user / example rows per second.
Only the ratios are meant to be compared.

Usage:
  python benchmarks/user_level.py
  python benchmarks/user_level.py --models=mlp --num_users=256 --repeats=2 --onednn=0
(--models, --warmup_steps, --repeats and --onednn are benchmarks/speed.py's flags.)
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

# benchmarks/speed.py's flags --models, --warmup_steps,
# --repeats and --onednn.
from benchmarks import speed  # noqa: E402,F401  (its flags)
from benchmarks.timing import fit_examples_per_second  # noqa: E402

FLAGS = flags.FLAGS
FLAGS.set_default("models", ["mlp", "transformer"])
FLAGS.set_default("onednn", ["0", "1"])
FLAGS.set_default("repeats", 3)
flags.DEFINE_integer("num_users", 1024, "Users in the timed data.")
flags.DEFINE_integer("rows_per_user", 8, "Rows of every user, and k.")
flags.DEFINE_integer("users_per_batch", 32, "Expected users per step.")

CONFIGS = ("example", "user")


def build(model_name):
    import keras
    import keras_dp
    from benchmarks import models
    keras.utils.set_random_seed(0)
    model = keras_dp.make_private(models.MODELS[model_name]())
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                                learning_rate=0.01, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def measure():
    import numpy as np
    from benchmarks import models
    k, users = FLAGS.rows_per_user, FLAGS.users_per_batch
    rows_per_step = users * k
    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    for model_name in FLAGS.models:
        x, y = models.random_batch(model_name, FLAGS.num_users * k)
        ids = np.random.default_rng(0).permutation(np.repeat(np.arange(FLAGS.num_users), k))
        fits = {
            "example": dict(),
            "user": dict(user_ids=ids, max_examples_per_user=k),
        }
        built = {config: build(model_name) for config in CONFIGS}
        best = {config: 0.0 for config in CONFIGS}
        for _ in range(FLAGS.repeats):
            for config in CONFIGS:
                batch_size = rows_per_step if config == "example" else users
                steps_per_second = fit_examples_per_second(
                    built[config], (x, y), batch_size, FLAGS.warmup_steps,
                    **fits[config]) / batch_size
                best[config] = max(best[config], steps_per_second * rows_per_step)
        print(f"{model_name}: {rows_per_step} expected rows per step ({users} users of {k} "
              f"rows), TF_ENABLE_ONEDNN_OPTS={setting}, best of {FLAGS.repeats} fit() "
              f"epochs: example-level {best['example']:.0f} rows/s, user-level "
              f"{best['user']:.0f} rows/s, ratio {best['user'] / best['example']:.2f}",
              flush=True)


def main(argv):
    del argv
    if len(FLAGS.onednn) == 1:
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = FLAGS.onednn[0]
        measure()
        return
    for setting in FLAGS.onednn:  # TensorFlow reads the setting at import: one process each.
        flags_here = [arg for arg in sys.argv[1:] if not arg.startswith("--onednn")]
        subprocess.run([sys.executable, os.path.abspath(__file__), f"--onednn={setting}",
                        *flags_here], check=True,
                       env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS=setting))


if __name__ == "__main__":
    app.run(main)
