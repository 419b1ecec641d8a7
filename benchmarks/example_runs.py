"""Runs examples/fashion_mnist.py in a process of its own, for the benchmarks."""

import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(example_flags, directory, name):
    """Runs examples/fashion_mnist.py with `example_flags` in its own process;
    returns its results JSON (written to `directory`/`name`.json)."""
    results = os.path.join(directory, f"{name}.json")
    command = [sys.executable, os.path.join(_ROOT, "examples", "fashion_mnist.py"),
               *example_flags, f"--results={results}"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with open(results, encoding="utf-8") as f:
        return json.load(f)
