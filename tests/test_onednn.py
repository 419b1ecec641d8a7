"""The private step where TensorFlow runs oneDNN kernels.

TF 2.21's oneDNN batch matmul corrupts the heap for [B, 1, T, d] x [d, p],
which tf.vectorized_map makes of a Dense or EinsumDense on sequences: the
process aborts, or the update is silently wrong. The vectorized engine runs
under XLA there. The brute-force comparisons run in a child process with
oneDNN forced on (whatever this CPU's default), so a regression fails a test
instead of killing the test run."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from keras_dp import clipping
from keras_dp.clipping import vectorized

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_tests_with_onednn(*pytest_args):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        cwd=os.path.dirname(TESTS_DIR), env=env, capture_output=True, text=True,
        timeout=600)


@pytest.mark.program  # make test: only in its oneDNN=1 run, which skips it.
@pytest.mark.skipif(clipping.runs_on_onednn(),
                    reason="oneDNN is on in this process: test_core.py runs these "
                           "brute-force tests here")
def test_vectorized_engine_matches_brute_force_with_onednn_on():
    # The small transformer (Embedding, MultiHeadAttention, LayerNormalization,
    # pooling, Dense) among them: it aborted in every run before the fix.
    # Where oneDNN is already on, test_core.py's own brute-force tests check the
    # same in this process (a regression would abort it), so the child process
    # would only repeat them; make test runs test_core.py with oneDNN on too,
    # so it needs this child in neither run. A pytest run with oneDNN off
    # (TensorFlow's default on CPUs without AVX512_VNNI) runs it.
    result = run_tests_with_onednn(
        os.path.join(TESTS_DIR, "test_core.py"), "-k", "brute_force and vectorized")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


@pytest.mark.skipif(os.environ.get("TF_ENABLE_ONEDNN_OPTS") not in ("0", "1"),
                    reason="TF_ENABLE_ONEDNN_OPTS is not set: the slow test below sets it")
def test_onednn_is_detected_in_this_process():
    # make test sets TF_ENABLE_ONEDNN_OPTS in each of its runs: both values.
    wanted = os.environ["TF_ENABLE_ONEDNN_OPTS"] == "1"
    assert clipping.runs_on_onednn() == wanted
    # Inside an XLA function nothing runs on oneDNN kernels.
    assert not bool(tf.function(clipping.runs_on_onednn, jit_compile=True)())


# Two child processes (5 s each, importing TensorFlow), for a pytest run that
# does not set TF_ENABLE_ONEDNN_OPTS; make test checks both in process above.
@pytest.mark.slow
@pytest.mark.program
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


class StringScale(keras.layers.Layer):
    """A layer through strings, which XLA cannot compile."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        doubled = tf.strings.to_number(tf.strings.as_string(2 * x))
        return tf.ensure_shape(doubled, x.shape) * self.scale


# The oneDNN check is patched, so both runs would run the same: one run.
@pytest.mark.once
@pytest.mark.parametrize("layer, op_type", [(StringScale, "AsString"),
                                            (lambda: keras.layers.RandomRotation(0.1),
                                             "ImageProjectiveTransformV3")])
def test_a_model_xla_cannot_compile_is_refused_before_weights_change(monkeypatch, layer,
                                                                     op_type):
    # A new user's train_on_batch with Keras' RandomRotation failed with
    # TensorFlow's raw XLA error at the step; now refused as it is traced.
    monkeypatch.setattr(vectorized, "runs_on_onednn", lambda: True)
    keras.utils.set_random_seed(0)
    model = keras_dp.make_private(keras.Sequential(
        [keras.Input((4, 4, 1)), layer(), keras.layers.Flatten(), keras.layers.Dense(2)]),
        clipping_engine="vectorized")
    with pytest.warns(UserWarning, match="NOT differentially private"):
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=0.0,
                                        learning_rate=1.0)
    model.compile(optimizer=optimizer, loss="mse")
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match=f"runs {op_type} .*which XLA cannot compile"):
        model.train_on_batch(np.ones((4, 4, 4, 1), "float32"), np.ones((4, 2), "float32"))
    for w0, w1 in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(w0, w1.numpy())
