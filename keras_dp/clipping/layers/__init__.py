"""The built-in norm functions, one module per layer family.

Importing this package registers them. Keras Hub's layers (`hub`) are a
lazy plugin, registered the first time the engine meets one, so keras-hub
stays optional.
"""

from keras_dp.clipping.layers import conv  # noqa: F401
from keras_dp.clipping.layers import dense  # noqa: F401
from keras_dp.clipping.layers import embedding  # noqa: F401
from keras_dp.clipping.layers import normalization  # noqa: F401
from keras_dp.clipping.layers import recurrent  # noqa: F401
from keras_dp.clipping.registry import register_lazy_plugin

register_lazy_plugin("keras_hub.", "keras_dp.clipping.layers.hub")
