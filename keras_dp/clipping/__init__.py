"""Per-example clipping: the transforms of DP-SGD and the two clipping engines."""

from keras_dp.clipping.onednn import runs_on_onednn
from keras_dp.clipping.transforms import MAX_NOISE_STDDEVS
from keras_dp.clipping.transforms import add_gaussian_noise
from keras_dp.clipping.transforms import box_muller
from keras_dp.clipping.transforms import clip_by_global_norm
from keras_dp.clipping.transforms import gaussian
from keras_dp.clipping.transforms import global_norm
from keras_dp.clipping.transforms import gradients
from keras_dp.clipping.transforms import noise_tail_probability
from keras_dp.clipping.vectorized import clipped_gradient_sum
