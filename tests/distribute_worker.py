"""Private training under tf.distribute, measured; tests/test_distribute.py asserts.

Usage:
    python distribute_worker.py mirrored LOG_DIR     # MirroredStrategy, 2 logical CPUs
    python distribute_worker.py multiworker LOG_DIR  # one worker of a TF_CONFIG cluster

Runs in its own process because logical devices (and a cluster) must be set
up before TensorFlow initializes. Prints one JSON line, `result {...}`:

    noise0_error: {engine: relative error of the distributed update against
        the single-device update of the same global batch, noise 0}
    noise_std_ratio: std of the distributed update's noise * B / (sigma C)
    accumulation_refused: the error refusing gradient accumulation before
        any step ("" if it trained, "changed" if weights or ledger moved)
    replicas_agree: whether every replica of this process holds the same weights
    fit: a Poisson fit (noise > 0): privacy_steps, epsilon, the same for a
        single-device fit, traces, and a digest of the final weights
    fit_noise0_error: the Poisson fit without noise against a single-device
        fit on the same batches
    refused: (multiworker) the error of each fit the workers cannot run
        privately ("" if it ran), and whether the weights stayed unchanged

The Poisson fit's PrivacyCallback writes TensorBoard logs to LOG_DIR/task<i>.
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

MODE, LOG_DIR = sys.argv[1:3]
TASK = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
if MODE == "mirrored":
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
else:
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_dp import models  # noqa: E402

BATCH = 32  # Global batch.
SIGMA, CLIP = 1.0, 1.0
DELTA = 1e-3
_DATA = np.random.default_rng(0)
X = _DATA.normal(size=(256, 20)).astype("float32")
Y = _DATA.integers(0, 4, 256)


def build(noise_multiplier, engine="auto", width=16, learning_rate=1.0, seed=None,
          accumulation_steps=None):
    """A private MLP with fixed initial weights (the same in every process)."""
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(width, activation="tanh"),
                              keras.layers.Dense(4)])
    weights = np.random.default_rng(1)
    model.set_weights([weights.normal(scale=0.3, size=w.shape).astype("float32")
                       for w in model.get_weights()])
    private = keras_dp.make_private(model, clipping_engine=engine)
    private.compile(
        optimizer=keras_dp.DPKerasSGD(l2_norm_clip=CLIP, noise_multiplier=noise_multiplier,
                                      learning_rate=learning_rate, seed=seed,
                                      gradient_accumulation_steps=accumulation_steps),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return private


def build_distributed(*args, **kwargs):
    with STRATEGY.scope():
        return build(*args, **kwargs)


def weights(private):
    return [np.asarray(w) for w in private.model.get_weights()]


def relative_error(got, want, start):
    """Largest error of the update got - start, relative to the update want - start."""
    return max(float(np.abs((g - s) - (w - s)).max() / np.abs(w - s).max())
               for g, w, s in zip(got, want, start))


def noise0_error(engine):
    single, distributed = build(0.0, engine), build_distributed(0.0, engine)
    start = weights(single)
    single.train_on_batch(X[:BATCH], Y[:BATCH])
    distributed.train_on_batch(X[:BATCH], Y[:BATCH])
    return relative_error(weights(distributed), weights(single), start)


def accumulation_refusal():
    """Gradient accumulation, refused before any step: the error, "" if none."""
    distributed = build_distributed(SIGMA, accumulation_steps=2)
    start = weights(distributed)
    try:
        distributed.train_on_batch(X[:BATCH], Y[:BATCH])
        return ""
    except ValueError as error:
        unchanged = all(np.array_equal(a, b) for a, b in zip(start, weights(distributed)))
        return str(error) if unchanged and distributed.privacy_steps == 0 else "changed"


def noise_std_ratio():
    """The noise of one distributed step, in units of sigma * C / B (1 is right).

    A 20-256-4 MLP has 6,404 weights: the std estimate has a relative
    standard error of 1 / sqrt(2 * 6404) = 0.9%.
    """
    clean, noisy = build(0.0, width=256), build_distributed(SIGMA, width=256)
    clean.train_on_batch(X[:BATCH], Y[:BATCH])
    noisy.train_on_batch(X[:BATCH], Y[:BATCH])
    noise = np.concatenate([(n - c).ravel() for n, c in zip(weights(noisy), weights(clean))])
    return float(noise.std() * BATCH / (SIGMA * CLIP))


def replicas_agree(private):
    return all(
        all(np.array_equal(local, STRATEGY.experimental_local_results(v.value)[0])
            for local in STRATEGY.experimental_local_results(v.value))
        for v in private.model.weights)


def counting_traces():
    """Counts the Python calls of the private train step (one per replica per trace)."""
    calls = []
    original = models._PrivateTrainStep.train_step

    def train_step(self, data):
        calls.append(1)
        return original(self, data)

    models._PrivateTrainStep.train_step = train_step
    return calls


def fit(private, epochs, log_dir=None):
    private.fit(X, Y, batch_size=BATCH, epochs=epochs, verbose=0,
                callbacks=[keras_dp.PrivacyCallback(delta=DELTA, log_dir=log_dir)])
    return private


def digest(arrays):
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()


def fit_noise0_error():
    """A Poisson fit without noise against one device on the same batches.

    Under a strategy Keras opens (and drops) one iterator of the dataset to
    build the model, so the fit's batches are the dataset's second pass; the
    single-device run skips a pass likewise.
    """
    single, distributed = build(0.0, learning_rate=0.5), build_distributed(0.0, learning_rate=0.5)
    start = weights(single)
    seed = 7
    on_one = keras_dp.data.poisson_dataset(X, Y, expected_batch_size=BATCH, seed=seed)
    next(iter(on_one))
    single.fit(on_one, verbose=0)
    distributed.fit(keras_dp.data.poisson_dataset(
        X, Y, expected_batch_size=BATCH, seed=seed,
        num_replicas=STRATEGY.num_replicas_in_sync), verbose=0)
    return relative_error(weights(distributed), weights(single), start)


def refusals():
    """Fits whose data the workers cannot share privately."""
    private = build_distributed(SIGMA)
    start = weights(private)
    attempts = {
        "shuffle": lambda: private.fit(X, Y, batch_size=BATCH, sampling="shuffle", verbose=0),
        "seeds": lambda: private.fit(keras_dp.data.poisson_dataset(
            X, Y, expected_batch_size=BATCH, seed=100 + TASK,
            num_replicas=STRATEGY.num_replicas_in_sync), verbose=0),
    }
    refused = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            refused[name] = ""
        except ValueError as error:
            refused[name] = str(error)
    refused["unchanged"] = all(np.array_equal(a, b) for a, b in zip(start, weights(private)))
    refused["privacy_steps"] = private.privacy_steps
    return refused


def main():
    result = {"noise0_error": {engine: noise0_error(engine)
                               for engine in ("ghost", "vectorized")},
              "noise_std_ratio": noise_std_ratio(),
              "accumulation_refused": accumulation_refusal(),
              "fit_noise0_error": fit_noise0_error()}
    if MODE == "multiworker":
        result["refused"] = refusals()
    single = fit(build(SIGMA, learning_rate=0.5), epochs=2)
    calls = counting_traces()
    distributed = fit(build_distributed(SIGMA, learning_rate=0.5), epochs=2,
                      log_dir=os.path.join(LOG_DIR, f"task{TASK}"))
    result["replicas_agree"] = replicas_agree(distributed)
    result["fit"] = {
        "privacy_steps": distributed.privacy_steps,
        "epsilon": distributed.privacy_spent(DELTA)[0],
        "history_epsilon": distributed.history.history["epsilon"],
        "single_privacy_steps": single.privacy_steps,
        "single_epsilon": single.privacy_spent(DELTA)[0],
        "traces": len(calls) / len(STRATEGY.extended.worker_devices),
        "weights_digest": digest(weights(distributed)),
    }
    print("result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
