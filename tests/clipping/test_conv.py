"""Conv1D and Conv2D on the ghost engine, against brute force.
"""

import keras
import pytest

from brute_force import check, labels, rng
from keras_dp.clipping.layers import conv
from small_models import sequential


def test_conv1d_causal_dilated_and_strided():
    model = sequential((12, 3), keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2,
                                                    activation="relu"),
                       keras.layers.Conv1D(3, 2, strides=2, padding="same", use_bias=False),
                       keras.layers.Conv1D(2, 3, padding="valid"))
    check(model, {"x": rng().normal(size=(8, 12, 3)).astype("float32"), "y": labels(8)})


@pytest.mark.parametrize("outer_method", ["auto", "gram"])
def test_conv2d_strides_padding_dilation(outer_method):
    model = sequential((9, 9, 2),
                       keras.layers.Conv2D(4, 4, strides=2, padding="same", activation="tanh"),
                       keras.layers.MaxPooling2D(2, strides=1),
                       keras.layers.Conv2D(3, (3, 2), dilation_rate=(1, 2), padding="same"),
                       keras.layers.Conv2D(2, 2, strides=(1, 2), padding="valid", use_bias=False))
    batch = {"x": rng().normal(size=(8, 9, 9, 2)).astype("float32"), "y": labels(8)}
    check(model, batch, outer_method=outer_method)


def test_single_channel_convolutions_through_depthwise_filter_gradients(monkeypatch):
    # The path taken when TensorFlow uses oneDNN (one input channel).
    monkeypatch.setattr(conv, "runs_on_onednn", lambda: True)
    model = sequential((10, 10, 1),
                       keras.layers.Conv2D(3, 4, strides=2, padding="same", activation="tanh"),
                       keras.layers.Reshape((25, 3)),
                       keras.layers.Conv1D(2, 3, strides=2, padding="valid"))
    check(model, {"x": rng().normal(size=(8, 10, 10, 1)).astype("float32"), "y": labels(8)})
    model = sequential((9, 1), keras.layers.Conv1D(3, 3, padding="causal"),
                       keras.layers.Conv1D(1, 2, padding="same"),
                       keras.layers.Conv1D(2, 2, padding="same"))
    check(model, {"x": rng().normal(size=(8, 9, 1)).astype("float32"), "y": labels(8)})
