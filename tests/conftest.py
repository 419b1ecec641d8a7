"""Test setup: quiet TensorFlow logs, import keras_dp from this checkout, and
the shared helpers of this folder (small_models, brute_force) from any subfolder."""

import os
import sys

# Must be set before TensorFlow is first imported.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
for path in (TESTS_DIR, REPO_ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)
