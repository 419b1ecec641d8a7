"""Keras' convolutions on the ghost engine, against brute force.

Conv1D/2D/3D, their transposes, DepthwiseConv1D/2D and SeparableConv1D/2D,
with biases, strides, dilation and "same"/"valid" padding; what is not
covered is refused, so that "auto" uses the vectorized engine.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from brute_force import RTOL, brute_force, check, labels, per_example_loss, rng
from keras_dp.clipping import ghost
from keras_dp.clipping.layers import conv
from keras_dp.clipping.onednn import runs_on_onednn
from small_models import sequential


# `check` compares the per-example norms too, tracing the model a second
# time: the tests of Conv1D/2D/3D, the transposes and DepthwiseConv1D (on both
# depthwise paths) do. The others (norms=False) compare the clipped sums,
# which, most examples clipped, are off by the error of each clipped
# example's norm.


def images(shape, n=4):
    return rng().normal(size=(n, *shape)).astype("float32")


@pytest.fixture(params=["filter_gradient_op", "patches"])
def depthwise_path(request, monkeypatch):
    """Runs a test with each way of forming depthwise per-example gradients."""
    if request.param == "patches":
        monkeypatch.setattr(conv, "_depthwise_filter_gradients",
                            conv._depthwise_gradients_from_patches)
    return request.param


def test_conv1d_causal_dilated_and_strided():
    model = sequential((12, 3), keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2,
                                                    activation="relu"),
                       keras.layers.Conv1D(3, 2, strides=2, padding="same", use_bias=False),
                       keras.layers.Conv1D(2, 3, padding="valid"))
    check(model, {"x": images((12, 3), 8), "y": labels(8)})


@pytest.mark.parametrize("outer_method", ["auto", "gram"])
def test_conv2d_strides_padding_dilation(outer_method):
    model = sequential((9, 9, 2),
                       keras.layers.Conv2D(4, 4, strides=2, padding="same", activation="tanh"),
                       keras.layers.MaxPooling2D(2, strides=1),
                       keras.layers.Conv2D(3, (3, 2), dilation_rate=(1, 2), padding="same"),
                       keras.layers.Conv2D(2, 2, strides=(1, 2), padding="valid", use_bias=False))
    # The Gram route's norms bound what its float32 weighted sum adds,
    # rounding included: above the exact ones by gamma_{B T} times the sum of
    # the positions' norms (`contributions._upper_bound`), here 2e-4.
    rtol = 1e-3 if outer_method == "gram" else RTOL
    check(model, {"x": images((9, 9, 2), 8), "y": labels(8)}, rtol=rtol,
          outer_method=outer_method)


def test_pointwise_convolutions_take_strided_slices():
    model = sequential((5, 5, 3), keras.layers.Conv2D(4, 1, strides=2, padding="same"),
                       keras.layers.Conv2D(3, 1, strides=(1, 2), activation="relu"),
                       keras.layers.Reshape((6, 3)),
                       keras.layers.Conv1D(2, 1, strides=2, padding="same"))
    check(model, {"x": images((5, 5, 3)), "y": labels(4)})


def test_conv3d_strides_padding_dilation():
    model = sequential((5, 5, 4, 2),
                       keras.layers.Conv3D(3, 3, strides=(2, 1, 2), padding="same",
                                           activation="tanh"),
                       keras.layers.Conv3D(2, (2, 2, 1), dilation_rate=(1, 2, 1),
                                           use_bias=False),
                       keras.layers.Conv3D(2, 1, strides=(1, 1, 2), padding="same"))
    check(model, {"x": images((5, 5, 4, 2)), "y": labels(4)})


def test_single_channel_convolutions_through_depthwise_filter_gradients(monkeypatch):
    # The path taken when TensorFlow uses oneDNN (one input channel).
    monkeypatch.setattr(conv, "runs_on_onednn", lambda: True)
    model = sequential((10, 10, 1),
                       keras.layers.Conv2D(3, 4, strides=2, padding="same", activation="tanh"),
                       keras.layers.Reshape((25, 3)),
                       keras.layers.Conv1D(2, 3, strides=2, padding="valid"))
    check(model, {"x": images((10, 10, 1), 8), "y": labels(8)}, norms=False)
    model = sequential((9, 1), keras.layers.Conv1D(3, 3, strides=2, padding="causal"),
                       keras.layers.Conv1D(1, 2, padding="same"),
                       keras.layers.Conv1D(2, 2, padding="same"))
    check(model, {"x": images((9, 1), 8), "y": labels(8)}, norms=False)


def test_single_channel_patches(monkeypatch):
    # One-channel patches are gathered with the examples last (the path
    # without oneDNN): "same" padding (a zero row), "valid", dilation, 1D
    # and 3D, a transposed convolution's one-filter output gradient, and a
    # depthwise kernel on one channel.
    monkeypatch.setattr(conv, "runs_on_onednn", lambda: False)
    monkeypatch.setattr(conv, "_depthwise_filter_gradients",
                        conv._depthwise_gradients_from_patches)
    model = sequential((9, 9, 1),
                       keras.layers.Conv2D(3, 4, strides=2, padding="same", activation="tanh"),
                       keras.layers.Conv2D(1, 2, dilation_rate=2, padding="valid"),
                       keras.layers.DepthwiseConv2D(2, depth_multiplier=2, padding="same"),
                       keras.layers.Conv2D(1, 1),
                       keras.layers.Conv2DTranspose(2, 3, strides=2, padding="same"))
    check(model, {"x": images((9, 9, 1), 8), "y": labels(8)}, norms=False)
    model = sequential((9, 1), keras.layers.Conv1D(2, 3, strides=2, padding="causal"))
    check(model, {"x": images((9, 1), 8), "y": labels(8)}, norms=False)
    model = sequential((4, 5, 3, 1), keras.layers.Conv3D(2, 2, strides=(2, 1, 1),
                                                         padding="same"))
    check(model, {"x": images((4, 5, 3, 1), 8), "y": labels(8)}, norms=False)


def test_conv_transpose_strides_padding_output_padding():
    model = sequential((4, 3, 2),
                       keras.layers.Conv2DTranspose(3, 3, strides=2, output_padding=1,
                                                    activation="tanh"),
                       keras.layers.Conv2DTranspose(2, (2, 3), strides=(1, 2), padding="same",
                                                    use_bias=False),
                       keras.layers.Reshape((10, 32)),
                       keras.layers.Conv1DTranspose(2, 3, strides=2, padding="same"),
                       keras.layers.Reshape((4, 5, 2, 1)),
                       keras.layers.Conv3DTranspose(2, 2, strides=(2, 1, 2), padding="same"))
    check(model, {"x": images((4, 3, 2)), "y": labels(4)})


@pytest.mark.skipif(not runs_on_onednn(),
                    reason="TensorFlow's own CPU kernels cannot run a dilated transposed "
                           "convolution; oneDNN's can")
def test_dilated_conv_transpose():
    model = sequential((4, 4, 2),
                       keras.layers.Conv2DTranspose(2, 3, dilation_rate=2, padding="same"),
                       keras.layers.Reshape((16, 2)),
                       keras.layers.Conv1DTranspose(2, 2, dilation_rate=3))
    check(model, {"x": images((4, 4, 2)), "y": labels(4)})


def test_depthwise_conv_strides_padding_dilation_multiplier(depthwise_path):
    model = sequential((11, 11, 2),
                       # Dilated (with strides, which Keras decomposes): patches.
                       keras.layers.DepthwiseConv2D(3, strides=2, dilation_rate=2,
                                                    depth_multiplier=2, activation="relu"),
                       keras.layers.DepthwiseConv2D(3, strides=2, padding="same"),
                       keras.layers.DepthwiseConv2D(2, depth_multiplier=2, padding="same",
                                                    use_bias=False),
                       keras.layers.DepthwiseConv2D((2, 1), dilation_rate=(2, 1),
                                                    padding="same"),
                       # A kernel larger than its input: patches.
                       keras.layers.DepthwiseConv2D(3, padding="same"))
    check(model, {"x": images((11, 11, 2)), "y": labels(4)}, norms=False)
    if runs_on_onednn():  # TensorFlow's own CPU kernel needs equal strides.
        model = sequential((5, 6, 2), keras.layers.DepthwiseConv2D((2, 3), strides=(1, 2)))
        check(model, {"x": images((5, 6, 2)), "y": labels(4)}, norms=False)


def test_depthwise_conv1d(depthwise_path):
    model = sequential((9, 2),
                       keras.layers.DepthwiseConv1D(3, strides=2, padding="same",
                                                    depth_multiplier=2, activation="tanh"),
                       keras.layers.DepthwiseConv1D(2, dilation_rate=2),
                       keras.layers.DepthwiseConv1D(2, use_bias=False))
    check(model, {"x": images((9, 2)), "y": labels(4)})


# Its depthwise part runs the depthwise norm function, whose patches path the
# tests above hold to brute force fast; separable convolutions on it: slow.
@pytest.mark.parametrize("depthwise_path", [
    "filter_gradient_op", pytest.param("patches", marks=pytest.mark.slow)], indirect=True)
def test_separable_conv(depthwise_path):
    model = sequential((7, 7, 2),
                       keras.layers.SeparableConv2D(3, 3, strides=2, padding="same",
                                                    depth_multiplier=2, activation="relu"),
                       keras.layers.SeparableConv2D(2, 2, dilation_rate=2, padding="same",
                                                    use_bias=False),
                       keras.layers.Reshape((16, 2)),
                       keras.layers.SeparableConv1D(3, 3, strides=2),
                       keras.layers.SeparableConv1D(2, 2, depth_multiplier=2, padding="same"))
    check(model, {"x": images((7, 7, 2)), "y": labels(4)}, norms=False)


def test_inputs_of_unknown_spatial_shape(depthwise_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((None, None, 2)),
        keras.layers.Conv2D(3, 2, strides=2, padding="same", activation="tanh"),
        keras.layers.DepthwiseConv2D(3, dilation_rate=2, padding="same", depth_multiplier=2),
        keras.layers.DepthwiseConv2D(2, padding="same"),
        keras.layers.Conv2DTranspose(2, 3, strides=2),
        keras.layers.SeparableConv2D(3, 2),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
    batch = {"x": images((5, 6, 2)), "y": labels(4)}
    clip = 0.5
    expected, norms, _ = brute_force(model, batch, clip)
    unknown = {"x": tf.TensorSpec([None, None, None, 2]), "y": tf.TensorSpec([None], tf.int64)}
    run = tf.function(lambda b: ghost.clipped_gradient_sum(
        model, b, model.trainable_variables, clip, per_example_loss)[0],
        input_signature=[unknown], autograph=False)
    assert np.mean(norms > clip) >= 0.5
    for got, want in zip(run(batch), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_conv3d_on_inputs_of_unknown_spatial_shape_is_refused_while_tracing():
    model = keras.Sequential([keras.Input((None, 4, 4, 1)), keras.layers.Conv3D(2, 2),
                              keras.layers.GlobalAveragePooling3D(), keras.layers.Dense(3)])
    spec = {"x": tf.TensorSpec([None, None, 4, 4, 1]), "y": tf.TensorSpec([None], tf.int64)}
    run = tf.function(lambda b: ghost.clipped_gradient_sum(
        model, b, model.trainable_variables, 1.0, per_example_loss)[0], autograph=False)
    with pytest.raises(ghost.UnsupportedModelError, match="unknown spatial shape"):
        run.get_concrete_function(spec)


@pytest.mark.parametrize("layer", [
    keras.layers.Conv2D(2, 2, groups=2),
    keras.layers.Conv2D(2, 2, data_format="channels_first"),
    keras.layers.DepthwiseConv2D(2, data_format="channels_first"),
    keras.layers.SeparableConv2D(2, 2, data_format="channels_first"),
    keras.layers.Conv2DTranspose(2, 2, data_format="channels_first"),
], ids=["groups", "conv_channels_first", "depthwise_channels_first",
        "separable_channels_first", "transpose_channels_first"])
def test_uncovered_configurations_are_unsupported(layer):
    model = sequential((4, 4, 4), layer)
    assert not ghost.supports(model)
    assert any(layer.name in reason for reason in ghost.unsupported_layers(model))


def test_conv_with_lora_is_unsupported():
    model = sequential((4, 4, 2), keras.layers.Conv2D(2, 2))
    model.layers[0].enable_lora(1)
    assert not ghost.supports(model)


@pytest.mark.slow
# The brute force's loss takes the model's softmax outputs as logits: still
# one function of the weights, which is all the comparison needs.
@pytest.mark.filterwarnings("ignore:.*from_logits=True")
def test_mobilenet_v2_with_group_normalization_is_exact():
    from benchmarks.mobilenet import mobilenet_v2
    check(mobilenet_v2(), {"x": images((32, 32, 3), 3), "y": labels(3, classes=10)})
