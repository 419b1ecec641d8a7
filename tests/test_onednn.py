"""The private step where TensorFlow runs oneDNN kernels, in a child process.

TF 2.21's oneDNN batch matmul corrupts the heap for [B, 1, T, d] x [d, p],
which tf.vectorized_map makes of a Dense or EinsumDense on sequences: the
process aborts, or the update is silently wrong. The child forces oneDNN on
(whatever this CPU's default), so a regression fails this test instead of
killing the test run.
"""

import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_tests_with_onednn(*pytest_args):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        cwd=os.path.dirname(TESTS_DIR), env=env, capture_output=True, text=True,
        timeout=600)


def test_vectorized_engine_matches_brute_force_with_onednn_on():
    # The small transformer (Embedding, MultiHeadAttention, LayerNormalization,
    # pooling, Dense) among them: it aborted in every run before the fix.
    result = run_tests_with_onednn(
        os.path.join(TESTS_DIR, "test_core.py"), "-k", "brute_force and vectorized")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


@pytest.mark.parametrize("onednn", ["0", "1"])
def test_onednn_is_detected_as_tensorflow_sets_it(onednn):
    code = ("import tensorflow as tf; from keras_dp import clipping; "
            "print(clipping.runs_on_onednn(), "
            "bool(tf.function(clipping.runs_on_onednn, jit_compile=True)()))")
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(TESTS_DIR),
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # Inside an XLA function nothing runs on oneDNN kernels.
    assert result.stdout.split() == [str(onednn == "1"), "False"]
