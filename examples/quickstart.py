"""keras-dp in one minute: a private Fashion-MNIST classifier and its epsilon.

Run: python examples/quickstart.py. `make install` points Keras' dataset cache
at the Debian package's Fashion-MNIST files, so `load_data()` reads them
offline; elsewhere Keras downloads them.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# TensorFlow's C++ log level: 2 hides its INFO and WARNING lines; on a machine
# without an NVIDIA GPU, 3 also hides the one ERROR it prints there, the GPU
# probe's "failed call to cuInit". Python warnings and exceptions still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if os.path.exists("/dev/nvidiactl") else "3")

# --- README: quickstart ---
import keras
import keras_dp

(x_train, y_train), (x_test, y_test) = keras.datasets.fashion_mnist.load_data()
x_train, x_test = x_train.reshape(-1, 784) / 255.0, x_test.reshape(-1, 784) / 255.0

model = keras_dp.make_private(keras.Sequential([
    keras.Input((784,)),
    keras.layers.Dense(128, activation="tanh"),
    keras.layers.Dense(10),
]))
model.compile(
    optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                  learning_rate=0.5, momentum=0.9),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    weighted_metrics=["accuracy"],
)
model.fit(x_train, y_train, batch_size=512, epochs=3,   # Poisson-sampled batches
          callbacks=[keras_dp.PrivacyCallback(delta=1e-5)], verbose=2)
_, accuracy = model.evaluate(x_test, y_test, verbose=0)
epsilon, _ = model.privacy_spent(delta=1e-5)
print(f"test accuracy {accuracy:.4f} at epsilon {epsilon:.4f} (delta 1e-05)")
# --- end ---
