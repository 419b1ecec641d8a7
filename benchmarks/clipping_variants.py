"""Privacy-utility of the clipping variants on Fashion-MNIST, side by side.

Runs `examples/fashion_mnist.py` with the end-to-end tanh CNN (Tramer &
Boneh's recipe: Poisson batches of 2,048, SGD lr 4 and momentum 0.9, no
EMA, a 10% validation split, noise calibrated for the target epsilon) once
per clipping rule and starting C, each in its own process, and prints a
Markdown table of test accuracy at the target epsilon (docs/clipping.md).
The tuned fixed C of the recipe is 0.1; the other rows start 10x off.

Usage:
  python benchmarks/clipping_variants.py                      # 10 epochs, epsilon 3
  python benchmarks/clipping_variants.py --epochs=40 --rows=flat:0.1,adaptive:1.0:0.9
"""

import os
import sys
import tempfile

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.example_runs import run_example  # noqa: E402

_ROWS = flags.DEFINE_list(
    "rows", ["flat:0.1", "flat:1.0", "flat:0.01", "adaptive:1.0", "adaptive:0.01",
             "normalize:0.1", "normalize:1.0"],
    "clipping:C[:q] rows, C the (initial) clipping norm, q adaptive clipping's "
    "target quantile (0.5 by default).")
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Training epochs of every run.")
_EPSILON = flags.DEFINE_float("target_epsilon", 3.0, "Target epsilon of every run.")
_EXTRA_FLAGS = flags.DEFINE_list("extra_flags", [],
                                 "More flags for examples/fashion_mnist.py.")

_RECIPE = ["--model=cnn", "--batch_size=2048", "--learning_rate=4", "--momentum=0.9",
           "--ema=0", "--validation_fraction=0.1"]


def main(argv):
    del argv
    print(f"end-to-end CNN, {_EPOCHS.value} epochs, epsilon {_EPSILON.value:g} (delta 1e-5)")
    print("| clipping | C (initial) | target quantile | C at the end | test accuracy "
          "| epsilon | wall time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as directory:
        for row in _ROWS.value:
            rule, clip, quantile = (row.split(":") + ["0.5"])[:3]
            result = run_example(
                [*_RECIPE, f"--clipping={rule}", f"--l2_norm_clip={clip}",
                 f"--target_quantile={quantile}",
                 f"--epochs={_EPOCHS.value}", f"--target_epsilon={_EPSILON.value}",
                 *_EXTRA_FLAGS.value], directory, row.replace(":", "_"))
            print(f"| {rule} | {clip} | {quantile if rule == 'adaptive' else ''} "
                  f"| {result['final_l2_norm_clip']:.4g} "
                  f"| {result['test_accuracy']:.4f} | {result['epsilon']:.4f} "
                  f"| {result['wall_time_seconds']:.0f} s |", flush=True)


if __name__ == "__main__":
    app.run(main)
