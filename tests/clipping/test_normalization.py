"""Layer, group and RMS normalization on the ghost engine, against brute force.
"""

import keras
import pytest

from brute_force import check, labels, rng
from small_models import sequential


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
def test_layer_group_and_rms_normalization():
    model = sequential((6, 6, 4),
                       keras.layers.Conv2D(4, 3, padding="same"),
                       keras.layers.GroupNormalization(groups=2),
                       keras.layers.LayerNormalization(axis=[1, 3]),
                       keras.layers.LayerNormalization(center=False),
                       keras.layers.LayerNormalization(rms_scaling=True),
                       keras.layers.RMSNormalization())
    batch = {"x": rng().normal(size=(8, 6, 6, 4)).astype("float32") * 2, "y": labels(8)}
    check(model, batch)
