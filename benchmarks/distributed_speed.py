"""Private training speed on 1 vs 2 replicas, side by side in one run.

Trains the benchmark CNN (benchmarks/models.py) with `fit` on random images
and Poisson batches of expected GLOBAL size --batch_size (DPKerasSGD, noise
1.1, clip 1.0), on one device and under MirroredStrategy over 2 logical CPU
devices. Each round is one epoch of each set-up in turn, and each set-up
keeps its best round, so that load from other processes affects both alike.
Examples/second counts the expected batch of each step after the first
--warmup_steps of the round. Prints the load average before and after: on a
shared machine, read the numbers with it.

Usage:
  python benchmarks/distributed_speed.py
  python benchmarks/distributed_speed.py --batch_size=256 --num_examples=60000 --rounds=3
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

# Logical devices must exist before TensorFlow initializes.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import keras_dp  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.timing import fit_examples_per_second  # noqa: E402
from benchmarks.speed import machine_description  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=int, default=256, help="GLOBAL expected batch")
    parser.add_argument("--num_examples", type=int, default=60000,
                        help="random images; an epoch is num_examples / batch_size steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup_steps", type=int, default=10,
                        help="untimed steps at the start of each round")
    return parser.parse_args(argv)


def build(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        private = keras_dp.make_private(models.cnn())
        private.compile(
            optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                          learning_rate=0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return private


def main(argv):
    args = parse_args(argv)
    x, y = (t.numpy() for t in models.random_batch("cnn", args.num_examples))
    setups = {
        "1 device": build(tf.distribute.get_strategy()),
        "2 replicas": build(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])),
    }
    load_before = os.getloadavg()
    best = {name: 0.0 for name in setups}
    for round_index in range(args.rounds):
        for name, private in setups.items():
            speed = fit_examples_per_second(private, (x, y), args.batch_size,
                                            args.warmup_steps)
            best[name] = max(best[name], speed)
            print(f"round {round_index + 1}, {name}: {speed:,.0f} examples/s", flush=True)
    print(machine_description())
    print(f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}")
    print(f"CNN, global expected batch {args.batch_size}, "
          f"{args.num_examples // args.batch_size} steps per round, best of {args.rounds}:")
    for name, speed in best.items():
        print(f"  {name}: {speed:,.0f} examples/s ({speed / best['1 device']:.2f}x)")


if __name__ == "__main__":
    main(sys.argv[1:])
