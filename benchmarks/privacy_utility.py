"""Privacy-utility curve of the demo's recipe: test accuracy at several epsilons.

Runs `examples/fashion_mnist.py` (ScatterNet + linear, its defaults) once per
target epsilon and once without noise, each in its own process, and prints a
Markdown table of test accuracy, epsilon and wall time (the README's table).
The no-noise run still clips (C = 0.1): epsilon is infinite.

Usage:
  python benchmarks/privacy_utility.py                       # epsilon 1, 2, 3, 8, inf
  python benchmarks/privacy_utility.py --epsilons=3 --extra_flags=--epochs=10
"""

import os
import sys
import tempfile

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.example_runs import run_example  # noqa: E402

_EPSILONS = flags.DEFINE_list("epsilons", ["1", "2", "3", "8", "inf"],
                              "Target epsilons; inf trains without noise.")
_EXTRA_FLAGS = flags.DEFINE_list("extra_flags", [],
                                 "More flags for examples/fashion_mnist.py.")


def run_demo(epsilon, directory):
    """Runs the demo for one target epsilon; returns its results JSON."""
    privacy = (["--target_epsilon=0", "--noise_multiplier=0"] if epsilon == "inf"
               else [f"--target_epsilon={epsilon}"])
    return run_example([*privacy, *_EXTRA_FLAGS.value], directory, f"epsilon_{epsilon}")


def main(argv):
    del argv
    print("| target epsilon | test accuracy | epsilon (delta 1e-5) | noise multiplier "
          "| wall time |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as directory:
        for epsilon in _EPSILONS.value:
            result = run_demo(epsilon, directory)
            print(f"| {epsilon} | {result['test_accuracy']:.4f} | {result['epsilon']:.4f} "
                  f"| {result['noise_multiplier']:.4f} "
                  f"| {result['wall_time_seconds']:.0f} s |", flush=True)


if __name__ == "__main__":
    app.run(main)
