"""A released layer loaded in a fresh process, whose classes no
keras_dp.adapt wrapped (a subprocess: the test process has wrapped them).

Reads releases and the ledger, not TensorFlow's CPU kernels: `make test`
runs it once, with oneDNN off, which balances its two runs (pytest.ini).
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dp
from test_preprocessing import DELTA, compile_private

pytestmark = pytest.mark.once


# A fresh process, in which no keras_dp.adapt wrapped the layer's class.
LOADED_LAYER_IN_A_LAMBDA = """
import sys, numpy as np, keras, tensorflow as tf, keras_dp
loaded = keras.models.load_model(sys.argv[1])
disc = next(layer for layer in loaded.base_model.layers
            if isinstance(layer, keras.layers.Discretization))
private = keras_dp.make_private(keras.Sequential([
    keras.Input((1,)), keras.layers.Lambda(lambda t: disc(t)),
    keras.layers.CategoryEncoding(4, output_mode="one_hot"), keras.layers.Dense(2)]))
private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                loss="sparse_categorical_crossentropy")
x = np.random.default_rng(1).uniform(0, 1, (200, 1)).astype("float32")
private.fit(tf.data.Dataset.from_tensor_slices((x, (x[:, 0] > 0.5).astype("int64"))).batch(50),
            verbose=0)
print(repr(private.privacy_spent(float(sys.argv[2]))[1]))
"""


def test_a_loaded_released_layer_called_in_a_lambda_of_a_fresh_process_is_recorded(tmp_path):
    """Review round 189: loading gave the layer its release but did not
    wrap its class's call to note it, so in a fresh process the step of a
    model calling it through a Lambda (which Keras does not track) found no
    released layer: 11.69 reported against 11.99."""
    x = np.random.default_rng(0).uniform(0, 1, (500, 1)).astype("float32")
    disc = keras.layers.Discretization(num_bins=4)
    release = keras_dp.adapt(disc, x, epsilon=2.0, delta=DELTA, value_range=(0, 1), seed=0)
    path = str(tmp_path / "released.keras")
    compile_private(keras.Sequential([
        keras.Input((1,)), disc, keras.layers.CategoryEncoding(4, output_mode="one_hot"),
        keras.layers.Dense(2)])).save(path)
    result = subprocess.run(
        [sys.executable, "-c", LOADED_LAYER_IN_A_LAMBDA, path, str(DELTA)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 0, result.stderr[-3000:]
    event = result.stdout.strip().splitlines()[-1]
    assert f"GaussianDpEvent(noise_multiplier={release.noise_multiplier!r})" in event
    assert "count=4" in event  # The fit's four steps.
