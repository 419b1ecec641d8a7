"""Poisson sampling of a tf.data pipeline of 60,000 examples, against arrays.

Measures, for Fashion-MNIST-shaped examples (28 x 28 float32) and B = 256:
the one-time copy of an unbatched pipeline (`from_tensor_slices(...).map(f)`)
into memory by `keras_dp.data.poisson_dataset`; the Poisson batches per
second of one pass over the result and over `poisson_dataset` of the same
arrays (what fit on arrays draws from); and the steps per second of a
private fit on the arrays (the Fashion-MNIST CNN of benchmarks/models.py
would be slower still), so that sampling is seen next to training.

Usage: python -m benchmarks.pipeline_sampling [--examples 60000]
"""

import argparse
import time

import keras
import numpy as np
import tensorflow as tf

import keras_dp


def batches_per_second(dataset):
    """One pass over `dataset`: batches and seconds (after the first batch)."""
    iterator = iter(dataset)
    next(iterator)
    start, count = time.perf_counter(), 0
    for _ in iterator:
        count += 1
    return count / (time.perf_counter() - start)


def fit_steps_per_second(x, y, batch_size):
    model = keras_dp.make_private(keras.Sequential([
        keras.Input((28, 28)), keras.layers.Flatten(),
        keras.layers.Dense(128, activation="tanh"), keras.layers.Dense(10)]))
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:batch_size * 8], y[:batch_size * 8], batch_size=batch_size, verbose=0)
    steps, start = int(model.optimizer.iterations.numpy()), time.perf_counter()
    model.fit(x, y, batch_size=batch_size, verbose=0)
    return (int(model.optimizer.iterations.numpy()) - steps) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=60000)
    parser.add_argument("--batch_size", type=int, default=256)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.random((args.examples, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, args.examples)
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).map(
        lambda image, label: ((image - 0.5) / 0.5, label))
    start = time.perf_counter()
    from_pipeline = keras_dp.data.poisson_dataset(pipeline, expected_batch_size=args.batch_size)
    copy_seconds = time.perf_counter() - start
    from_arrays = keras_dp.data.poisson_dataset(x, y, expected_batch_size=args.batch_size)
    print(f"copy of the {args.examples}-example pipeline: {copy_seconds:.2f} s (once)")
    print(f"Poisson batches/s, pipeline: {batches_per_second(from_pipeline):.0f}")
    print(f"Poisson batches/s, arrays:   {batches_per_second(from_arrays):.0f}")
    print(f"private fit steps/s on arrays (MLP): {fit_steps_per_second(x, y, args.batch_size):.1f}")


if __name__ == "__main__":
    main()
