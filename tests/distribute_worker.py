"""Private training under tf.distribute, measured; tests/test_distribute.py asserts.

Usage:
    python distribute_worker.py mirrored LOG_DIR     # MirroredStrategy, 2 logical CPUs
    python distribute_worker.py mirrored-core LOG_DIR  # its checks of every step only
    python distribute_worker.py multiworker LOG_DIR  # one worker of a TF_CONFIG cluster

"mirrored-core" gives noise_std_ratio, noise0_error, replica_batches and
accumulation without its fits (make test); "mirrored" all below.

Runs in its own process because logical devices (and a cluster) must be set
up before TensorFlow initializes. Prints one JSON line, `result {...}`:

    noise_std_ratio: std of the distributed update's noise * B / (sigma C)
    fit: a Poisson fit (noise > 0): privacy_steps, epsilon, the same for a
        single-device fit, traces, whether every replica of this process
        holds the same weights, evaluate_error (the relative error of
        `evaluate` against one device's on the same weights), and a digest
        of the final weights
    multiworker only:
    fit_noise0_error: the Poisson fit without noise against a single-device
        fit on the same batches
    refused: the error of each fit the workers cannot run privately ("" if
        it ran), and whether the weights stayed unchanged
    mirrored only:
    noise0_error: {engine: relative error of the distributed update against
        the single-device update of the same global batch, noise 0}
    adaptive: the C of three adaptive-clipping steps (noise > 0, one seed)
        on the replicas and on one device, and the update's relative error
    accumulation: gradient accumulation over k = 2 batches (Adam, noise 0)
        against one device with k = 2 and one device on the combined
        batches: relative errors, whether the first batch left the weights
        and the ledger alone, logical steps recorded, optimizer iterations;
        fit: `fit` with k = 2 (without evaluate_error); noise_std_ratio:
        the noise * k B / (sigma C) of one logical step; fit_noise0_error:
        `fit_noise0_error` with k = 2
    user_fit_noise0_error: `fit_noise0_error` of a user-level fit with
        accumulation over 2 batches
    banded: a fit with correlated noise against one device (one seed):
        relative error, and both epsilons
    replica_batches: a custom loop giving each replica a batch of its own
        (review round 27): with one input of a single row on replica 1, the
        weight change and the steps recorded; with 4 rows on replica 0 and
        8 on replica 1 at 4 microbatches, the recorded sensitivity

The Poisson fit's PrivacyCallback writes TensorBoard logs to LOG_DIR/task<i>.
"""

import contextlib
import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

MODE, LOG_DIR = sys.argv[1:3]
TASK = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
if MODE != "multiworker":  # "mirrored" or "mirrored-core".
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
          accumulation_steps=None, optimizer_class=keras_dp.DPKerasSGD, l2_norm_clip=CLIP,
          noise_correlation=None):
    """A private MLP with fixed initial weights (the same in every process).

    Built in the strategy's scope, it runs on the replicas; outside, it is
    a single-device reference. Both are traced: an eager step is traced and
    checked at every call (`keras_dp.clipping.engine`), which costs more
    than one trace per fit.
    """
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(width, activation="tanh"),
                              keras.layers.Dense(4)])
    weights = np.random.default_rng(1)
    model.set_weights([weights.normal(scale=0.3, size=w.shape).astype("float32")
                       for w in model.get_weights()])
    private = keras_dp.make_private(model, clipping_engine=engine)
    private.compile(
        optimizer=optimizer_class(l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
                                  learning_rate=learning_rate, seed=seed,
                                  gradient_accumulation_steps=accumulation_steps,
                                  noise_correlation=noise_correlation),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
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


def train_on_batches(private, steps):
    """Trains on the global batches of BATCH rows numbered `steps`."""
    for step in steps:
        rows = slice(step * BATCH, (step + 1) * BATCH)
        private.train_on_batch(X[rows], Y[rows])


def accumulation_errors():
    """Two logical Adam steps of k = 2 batches each on the replicas, noise 0.

    Adam's moments and step counter make any extra or skipped apply show.
    """
    options = {"optimizer_class": keras_dp.DPKerasAdam, "learning_rate": 0.01}
    distributed = build_distributed(0.0, accumulation_steps=2, **options)
    single, combined = build(0.0, accumulation_steps=2, **options), build(0.0, **options)
    start = weights(single)
    train_on_batches(distributed, range(1))
    unchanged = all(np.array_equal(a, b) for a, b in zip(start, weights(distributed)))
    mid_batch_steps = distributed.privacy_steps
    train_on_batches(distributed, range(1, 4))
    train_on_batches(single, range(4))
    for step in range(2):  # The same rows, as two batches of 2 BATCH.
        rows = slice(2 * step * BATCH, 2 * (step + 1) * BATCH)
        combined.train_on_batch(X[rows], Y[rows])
    return {"vs_single": relative_error(weights(distributed), weights(single), start),
            "vs_combined": relative_error(weights(distributed), weights(combined), start),
            "first_batch_unchanged": unchanged and mid_batch_steps == 0,
            "privacy_steps": distributed.privacy_steps,
            "iterations": int(distributed.optimizer.iterations.numpy())}


def noise_std_ratio(accumulation_steps=1):
    """The noise of one logical distributed step, in units of sigma * C / (k B)
    (1 is right), for k = `accumulation_steps` batches of B = BATCH.

    A 20-256-4 MLP has 6,404 weights: the std estimate has a relative
    standard error of 1 / sqrt(2 * 6404) = 0.9%.
    """
    clean = build(0.0, width=256)
    noisy = build_distributed(SIGMA, width=256, accumulation_steps=accumulation_steps)
    clean.train_on_batch(X[:accumulation_steps * BATCH], Y[:accumulation_steps * BATCH])
    train_on_batches(noisy, range(accumulation_steps))
    noise = np.concatenate([(n - c).ravel() for n, c in zip(weights(noisy), weights(clean))])
    return float(noise.std() * accumulation_steps * BATCH / (SIGMA * CLIP))


def adaptive_clipping(steps=3):
    """Adaptive clipping on the replicas and on one device, one seed: the C
    each step leaves (the count summed over all replicas, noised once) and
    the error of the noisy update."""
    runs = {}
    for name, make in (("single", build), ("distributed", build_distributed)):
        clip = keras_dp.AdaptiveClipping(CLIP, count_noise_multiplier=4.0)
        private = make(SIGMA, seed=11, l2_norm_clip=clip)
        start, clips = weights(private), []
        for step in range(steps):
            train_on_batches(private, [step])
            clips.append(private.optimizer.l2_norm_clip)
        runs[name] = (clips, weights(private))
    return {"single": runs["single"][0], "distributed": runs["distributed"][0],
            "error": relative_error(runs["distributed"][1], runs["single"][1], start)}


def replicas_agree(private):
    return all(
        all(np.array_equal(local, STRATEGY.experimental_local_results(v.value)[0])
            for local in STRATEGY.experimental_local_results(v.value))
        for v in private.model.weights)


@contextlib.contextmanager
def counting_traces():
    """Counts the Python calls of the private train step (one per replica per trace)."""
    calls = []
    original = models._PrivateTrainStep.train_step

    def train_step(self, data):
        calls.append(1)
        return original(self, data)

    models._PrivateTrainStep.train_step = train_step
    try:
        yield calls
    finally:
        models._PrivateTrainStep.train_step = original


def fit(private, epochs, log_dir=None):
    private.fit(X, Y, batch_size=BATCH, epochs=epochs, verbose=0,
                callbacks=[keras_dp.PrivacyCallback(delta=DELTA, log_dir=log_dir)])
    return private


def digest(arrays):
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()


def fit_noise0_error(accumulation_steps=1, dataset=None, **sampling):
    """A Poisson fit without noise against one device on the same batches.

    Under a strategy Keras opens (and drops) one iterator of the dataset to
    build the model, so the fit's batches are the dataset's second pass; the
    single-device run skips a pass likewise. `dataset(X, Y, **sampling)`
    makes the batches; by default Poisson batches of examples of the
    global batch size.
    """
    options = {"learning_rate": 0.5, "accumulation_steps": accumulation_steps}
    single, distributed = build(0.0, **options), build_distributed(0.0, **options)
    start = weights(single)
    if dataset is None:
        dataset, sampling = keras_dp.data.poisson_dataset, {
            "expected_batch_size": accumulation_steps * BATCH}
    sampling.update(seed=7, accumulation_steps=accumulation_steps)
    on_one = dataset(X, Y, **sampling)
    next(iter(on_one))
    single.fit(on_one, verbose=0)
    distributed.fit(dataset(X, Y, num_replicas=STRATEGY.num_replicas_in_sync, **sampling),
                    verbose=0)
    assert distributed.privacy_unit == single.privacy_unit
    return relative_error(weights(distributed), weights(single), start)


def user_fit_noise0_error(accumulation_steps=2):
    """`fit_noise0_error` of a user-level fit: users of 1 to 8 rows, k = 4.
    A user split over two replicas or physical batches would be clipped twice."""
    ids = np.repeat(np.arange(256), np.random.default_rng(2).integers(1, 9, 256))[:len(X)]
    return fit_noise0_error(accumulation_steps, keras_dp.data.user_dataset, user_ids=ids,
                            expected_users_per_batch=8 * accumulation_steps,
                            max_examples_per_user=4)


def banded_fit_error(bands=2, accumulation_steps=2):
    """A noisy fit with correlated noise (`keras_dp.BandedMF`) on the replicas
    against one device: one optimizer seed and one Poisson seed, so the
    same cyclic batches and the same noise, which must go on the sum over
    replicas once, correlated through one buffer. Relative to the update."""
    runs = {}
    for name, make, replicas in (("single", build, 1),
                                 ("distributed", build_distributed,
                                  STRATEGY.num_replicas_in_sync)):
        private = make(SIGMA, seed=11, accumulation_steps=accumulation_steps,
                       noise_correlation=keras_dp.BandedMF(bands=bands, steps=16))
        start = weights(private)
        batches = keras_dp.data.poisson_dataset(
            X, Y, expected_batch_size=accumulation_steps * BATCH // 2, seed=7,
            accumulation_steps=accumulation_steps, num_replicas=replicas,
            participation_groups=bands)
        if replicas == 1:
            next(iter(batches))  # As the strategy's build does (`fit_noise0_error`).
        private.fit(batches, epochs=2, verbose=0)
        runs[name] = (weights(private), private.privacy_spent(DELTA)[0])
    return {"error": relative_error(runs["distributed"][0], runs["single"][0], start),
            "epsilons": [runs["single"][1], runs["distributed"][1]]}


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


def evaluate_error(distributed):
    """Relative error of the distributed `evaluate` against one device's,
    on the same weights and the same rows."""
    single = build(SIGMA)
    single.model.set_weights(weights(distributed))
    want = single.evaluate(X, Y, batch_size=BATCH, verbose=0, return_dict=True)
    got = distributed.evaluate(X, Y, batch_size=BATCH, verbose=0, return_dict=True)
    assert got.keys() == want.keys(), (got, want)
    return max(abs(float(got[name]) / float(want[name]) - 1) for name in want)


def fit_result(accumulation_steps=None, log_dir=None):
    """A Poisson fit (noise > 0) on the replicas, and the same on one device;
    with accumulation_steps=None also `evaluate_error` (which does not
    depend on accumulation)."""
    options = {"learning_rate": 0.5, "accumulation_steps": accumulation_steps}
    single = fit(build(SIGMA, **options), epochs=2)
    with counting_traces() as calls:
        distributed = fit(build_distributed(SIGMA, **options), epochs=2, log_dir=log_dir)
    result = {
        "privacy_steps": distributed.privacy_steps,
        "epsilon": distributed.privacy_spent(DELTA)[0],
        "history_epsilon": distributed.history.history["epsilon"],
        "single_privacy_steps": single.privacy_steps,
        "single_epsilon": single.privacy_spent(DELTA)[0],
        "traces": len(calls) / len(STRATEGY.extended.worker_devices),
        "replicas_agree": replicas_agree(distributed),
        "weights_digest": digest(weights(distributed)),
    }
    if accumulation_steps is None:
        result["evaluate_error"] = evaluate_error(distributed)
    return result


def per_replica_step(private, batches):
    """`private.train_step` in a custom loop, each replica on its batch of
    `batches` (a list: replica r's), on the replicas' own shapes."""
    values = STRATEGY.experimental_distribute_values_from_function(
        lambda context: tf.nest.map_structure(
            tf.constant, batches[context.replica_id_in_sync_group]))

    @tf.function
    def step(data):
        # The shapes of the replicas differ: each part is cut to its rows.
        return STRATEGY.run(lambda d: private.train_step(
            tf.nest.map_structure(lambda t, rows: t[:rows], d[0], d[1])), args=(data,))

    return step(values)


def replica_batches():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4, 4)).astype("float32"), np.zeros((4, 1), "float32")
    with STRATEGY.scope():
        first, second = keras.Input((4,)), keras.Input((4,))
        added = keras.layers.Add()([first, second])
        two_inputs = keras_dp.make_private(keras.Model(
            [first, second], keras.layers.Dense(1, use_bias=False)(added)))
        two_inputs.compile(optimizer=keras_dp.DPKerasSGD(
            l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=1.0), loss="mse")
    start = weights(two_inputs)
    one_row = np.full((4, 4), 100.0, "float32")  # Row 0 read: one row on replica 1.
    per_replica_step(two_inputs, [(((x, x), y), ((4, 4), 4)),
                                  (((x, one_row), y), ((4, 1), 4))])
    with STRATEGY.scope():
        grouped = keras_dp.make_private(
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
        grouped.compile(optimizer=keras_dp.DPKerasSGD(
            l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1.0, num_microbatches=4),
            loss="mse")
    eight = rng.normal(size=(8, 4)).astype("float32")
    per_replica_step(grouped, [((x, y), (4, 4)), ((eight, np.zeros((8, 1), "float32")), (8, 8))])
    return {"uneven_unchanged": all(np.array_equal(a, b)
                                    for a, b in zip(start, weights(two_inputs))),
            "uneven_steps": two_inputs.privacy_steps,
            "grouped_steps": grouped.privacy_steps,
            "grouped_refusals": sorted(r.name for r in grouped.step_mechanism.take_refusals())}


def made_private_outside_the_scope():
    """The error of a fit of a model built in the scope and made private and
    compiled outside it (review round 130: Keras' optimizer failed inside the
    step with a TypeError); "" if it trained."""
    with STRATEGY.scope():
        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(4)])
    private = keras_dp.make_private(model)
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=CLIP, noise_multiplier=SIGMA,
                                                  learning_rate=1.0), loss="mse")
    try:
        private.fit(X[:8], np.zeros((8, 4), "float32"), batch_size=4, verbose=0)
    except ValueError as error:
        return str(error)
    return ""


def distributed_dataset_fit():
    """Steps a fit records on a dataset the user distributed (its spec is
    per replica: keras-dp read its shape and crashed, session 27)."""
    private = build_distributed(SIGMA)
    dataset = STRATEGY.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.from_tensor_slices((X, Y)).batch(
            context.get_per_replica_batch_size(BATCH)))
    private.fit(dataset, epochs=1, steps_per_epoch=2, sampling="shuffle", verbose=0)
    return private.privacy_steps


def main():
    # The workers check what crosses processes: the clipped gradients summed
    # over them, from a Poisson dataset of which each takes its share (a
    # noise-free fit); the noise added once; the ledger, epsilon and weights
    # equal on both; the refusals. What the replicas of one process show as
    # well (each engine, adaptive clipping, accumulation, user-level and
    # correlated noise) the mirrored run alone checks.
    log_dir = os.path.join(LOG_DIR, f"task{TASK}")
    if MODE == "multiworker":
        result = {"noise_std_ratio": noise_std_ratio(), "fit": fit_result(log_dir=log_dir),
                  "fit_noise0_error": fit_noise0_error(), "refused": refusals()}
    else:
        result = mirrored_core()
    if MODE == "mirrored":
        result["noise0_error"]["vectorized"] = noise0_error("vectorized")
        result["noise_std_ratio"] = noise_std_ratio()
        result["replica_batches"].update(outside_the_scope=made_private_outside_the_scope(),
                                         distributed_dataset_steps=distributed_dataset_fit())
        result["fit"] = fit_result(log_dir=log_dir)
        result["accumulation"].update(fit=fit_result(accumulation_steps=2),
                                      fit_noise0_error=fit_noise0_error(accumulation_steps=2))
        result["adaptive"] = adaptive_clipping()
        result["user_fit_noise0_error"] = user_fit_noise0_error()
        result["banded"] = banded_fit_error()
    print("result " + json.dumps(result), flush=True)


def mirrored_core():
    """What make test checks on the replicas of one process ("mirrored-core",
    about 15 s): a ghost step, an accumulated step and its noise, every
    replica's batch; "mirrored" adds the vectorized engine, one step's noise,
    fits, adaptive clipping, user-level and correlated noise (make test-all)."""
    return {"noise0_error": {"ghost": noise0_error("ghost")},
            "replica_batches": replica_batches(),
            "accumulation": dict(accumulation_errors(),
                                 noise_std_ratio=noise_std_ratio(accumulation_steps=2))}


if __name__ == "__main__":
    main()
