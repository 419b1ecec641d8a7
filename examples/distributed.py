"""Private training of the Fashion-MNIST CNN under tf.distribute.

On one machine, 2 logical CPU devices stand in for 2 GPUs:

    python examples/distributed.py                 # MirroredStrategy, 2 replicas
    python examples/distributed.py --replicas=1    # the same run on one device

On several machines, start one process per machine with its TF_CONFIG (see
docs/distributed.md) and `--multiworker`.

Reads Fashion-MNIST from --data_dir when it is there, else trains on random
images (to measure speed). Prints the examples per second of each epoch and
the epsilon spent, which is the single-device run's.
"""

import argparse
import os
import sys
import time

# TensorFlow's C++ log level: 2 hides its INFO and WARNING lines; on a machine
# without an NVIDIA GPU, 3 also hides the one ERROR it prints there, the GPU
# probe's "failed call to cuInit". Python warnings and exceptions still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if os.path.exists("/dev/nvidiactl") else "3")

import tensorflow as tf  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2,
                        help="logical CPU devices to mirror over (one machine)")
    parser.add_argument("--multiworker", action="store_true",
                        help="MultiWorkerMirroredStrategy over the TF_CONFIG cluster")
    parser.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--num_examples", type=int, default=60000,
                        help="random images when Fashion-MNIST is missing")
    parser.add_argument("--batch_size", type=int, default=1024, help="GLOBAL expected batch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--noise_multiplier", type=float, default=1.3)
    parser.add_argument("--l2_norm_clip", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=0.6)
    parser.add_argument("--delta", type=float, default=1e-5)
    return parser.parse_args(argv)


def make_strategy(args):
    """Must run before TensorFlow initializes its devices."""
    if args.multiworker:
        return tf.distribute.MultiWorkerMirroredStrategy()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])


def load_data(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import datasets  # noqa: E402  (examples/datasets.py)
    import numpy as np  # noqa: E402

    if os.path.isdir(args.data_dir):
        (x, y), _ = datasets.load_fashion_mnist(args.data_dir)
        return (x[..., None] / 255.0).astype("float32"), y.astype("int64")
    rng = np.random.default_rng(0)
    return (rng.random((args.num_examples, 28, 28, 1), dtype=np.float32),
            rng.integers(0, 10, args.num_examples))


def build_model(args):
    import keras
    import keras_dp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fashion_mnist  # noqa: E402  (examples/fashion_mnist.py: the same CNN)

    model = fashion_mnist.build_cnn()
    private = keras_dp.make_private(model)
    private.compile(
        optimizer=keras_dp.DPKerasSGD(l2_norm_clip=args.l2_norm_clip,
                                      noise_multiplier=args.noise_multiplier,
                                      learning_rate=args.learning_rate, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    return private


def main(argv=None):
    args = parse_args(argv)
    strategy = make_strategy(args)
    import keras
    import keras_dp

    x, y = load_data(args)
    # Everything that creates variables goes inside the scope: the model,
    # make_private (its privacy ledger) and the DP optimizer (its noise key).
    with strategy.scope():
        private = build_model(args)

    class Speed(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self.start
            print(f"epoch {epoch + 1}: {len(x) / seconds:,.0f} examples/s, "
                  f"epsilon {logs['epsilon']:.3f}, accuracy {logs['accuracy']:.4f}")

    private.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
                callbacks=[keras_dp.PrivacyCallback(delta=args.delta), Speed()])
    print(f"{strategy.num_replicas_in_sync} replicas, {private.privacy_steps} private "
          f"steps, epsilon {private.privacy_spent(args.delta)[0]:.3f} (delta {args.delta})")


if __name__ == "__main__":
    main()
