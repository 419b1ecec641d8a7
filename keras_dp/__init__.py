"""keras-dp: differentially private training (DP-SGD) for Keras 3 on TensorFlow."""

import importlib

from keras_dp import custom_loops
from keras_dp import data
from keras_dp.accounting import calibrate_noise_multiplier
from keras_dp.accounting import compute_epsilon
from keras_dp.accounting import default_delta
from keras_dp.callbacks import PrivacyCallback
from keras_dp.clip_norms import AdaptiveClipping
from keras_dp.clipping import GatheredRows
from keras_dp.clipping import OuterProduct
from keras_dp.clipping import PerExample
from keras_dp.clipping import UnsupportedModelError
from keras_dp.clipping import register_norm_function
from keras_dp.correlated_noise import BandedMF
from keras_dp.models import DPModel
from keras_dp.models import DPSequential
from keras_dp.models import make_private
from keras_dp.optimizers import DPKerasAdagrad
from keras_dp.optimizers import DPKerasAdam
from keras_dp.optimizers import DPKerasSGD
from keras_dp.optimizers import make_dp_optimizer_class
from keras_dp.planning import Plan
from keras_dp.planning import PrivacyUtilityWarning
from keras_dp.planning import plan
from keras_dp.preprocessing import adapt
from keras_dp.serving import export_for_serving

__version__ = "0.1.0"


def __getattr__(name):
    """Imports `keras_dp.audit` on first use, so `import keras_dp` does not load it.

    Args:
        name: the attribute asked for.

    Returns:
        The `keras_dp.audit` module, for `name == "audit"`.
    """
    if name == "audit":
        return importlib.import_module("keras_dp.audit")
    raise AttributeError(f"module 'keras_dp' has no attribute {name!r}")
