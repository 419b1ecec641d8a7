"""Private training under tf.distribute: the single-device guarantee on R replicas.

MirroredStrategy runs over 2 logical CPU devices and MultiWorkerMirroredStrategy
over 2 worker processes on 127.0.0.1, each in subprocesses running
tests/distribute_worker.py (devices and clusters must be set up before
TensorFlow initializes), bounded in time and killed on timeout.
"""

import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp

# Does not depend on TensorFlow's CPU kernel set (the replicas are compared
# with one device in the same process, on the same kernels), and trains in
# worker subprocesses: `make test` runs it once, with oneDNN off, which
# balances its two runs (the whole programs run with oneDNN on).
pytestmark = pytest.mark.once

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distribute_worker.py")
TIMEOUT = 400  # Seconds for a worker; all three settle in 60-120 s on 2 busy cores.

# The noise check measures the std of one step's noise over 6,404 weights:
# relative standard error 1 / sqrt(2 * 6404) = 0.9%, so +-5% is 5.6 standard
# errors. Noise drawn on each replica and summed gives sqrt(2) = 1.41, the
# same noise on both replicas summed gives 2, a per-replica share of
# sigma C / sqrt(R) not summed gives 0.71: all fail.
NOISE_STD_TOLERANCE = 0.05


def _start_workers(mode, log_dir, envs):
    """Starts one worker per environment."""
    return [subprocess.Popen([sys.executable, WORKER, mode, str(log_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env) for env in envs]


def _results(processes):
    """Waits for the workers; returns each one's result dict."""
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=TIMEOUT))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    results = []
    for process, (stdout, stderr) in zip(processes, outputs):
        lines = [line for line in stdout.splitlines() if line.startswith("result ")]
        assert process.returncode == 0 and lines, stderr[-3000:]
        results.append(json.loads(lines[-1][len("result "):]))
    return results


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def mirrored_core(tmp_path_factory):
    """The MirroredStrategy worker's checks of every step (about 15 s)."""
    logs = tmp_path_factory.mktemp("mirrored_core_logs")
    return _results(_start_workers("mirrored-core", logs, [dict(os.environ)]))[0]


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    """The MirroredStrategy worker's results, with whole fits (about 60 s:
    make test-all, the tests marked slow)."""
    logs = tmp_path_factory.mktemp("mirrored_logs")
    return _results(_start_workers("mirrored", logs, [dict(os.environ)]))[0]


@pytest.fixture(scope="module")
def multiworker(tmp_path_factory):
    """The two MultiWorkerMirroredStrategy workers' logs and results."""
    logs = tmp_path_factory.mktemp("multiworker_logs")
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    envs = [dict(os.environ, TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": index}}))
        for index in range(2)]
    return logs, _results(_start_workers("multiworker", logs, envs))


def _check_noise_std(ratio):
    assert abs(ratio - 1) < NOISE_STD_TOLERANCE, ratio


def _check_fit(fit, logical_steps=2 * 8):
    assert fit["traces"] == 1
    assert fit["privacy_steps"] == fit["single_privacy_steps"] == logical_steps
    assert fit["epsilon"] == pytest.approx(fit["single_epsilon"], rel=1e-12)
    assert fit["history_epsilon"][-1] == pytest.approx(fit["epsilon"], rel=1e-12)
    assert fit["replicas_agree"]


def _check_evaluate(fit):
    assert fit["evaluate_error"] < 1e-5  # evaluate() as on one device.


def _check_noise_free_fit(result):
    assert result["fit_noise0_error"] < 1e-4  # The divisor is the global expected batch.


@pytest.mark.slow  # The whole mirrored worker (60 s): make test-all.
def test_mirrored_correlated_noise_equals_one_device(mirrored):
    # Same seeds, so the same cyclic batches and noise: noise drawn or
    # correlated per replica, or added before the sum over replicas, would
    # move the update by about the noise itself (sigma C / B per weight).
    banded = mirrored["banded"]
    assert banded["error"] < 1e-4, banded
    # Equal but for the truncation delta: the cap of a batch split over two
    # replicas is a multiple of 2 rows.
    assert banded["epsilons"][0] == pytest.approx(banded["epsilons"][1], rel=1e-6)


@pytest.mark.slow
def test_mirrored_adaptive_clipping_moves_c_as_one_device(mirrored):
    """Adaptive clipping's C moves as on one device: the count is the sum of
    every replica's (in the all-reduce of the gradients, which the
    multiworker tests check across processes), noised once from the shared
    stream."""
    adaptive = mirrored["adaptive"]
    assert adaptive["single"][0] != 1.0  # C moved.
    np.testing.assert_allclose(adaptive["distributed"], adaptive["single"], rtol=1e-6)
    assert adaptive["error"] < 1e-4


def test_mirrored_step_equals_one_device(mirrored_core):
    # Its noise, added once per logical step, is measured in the accumulation
    # test below (k = 2); one step's in the slow test after this one.
    assert mirrored_core["noise0_error"]["ghost"] < 1e-4


@pytest.mark.slow
def test_mirrored_vectorized_step_equals_one_device_and_noise_is_added_once(mirrored):
    assert sorted(mirrored["noise0_error"]) == ["ghost", "vectorized"]
    for engine, error in mirrored["noise0_error"].items():
        assert error < 1e-4, engine
    _check_noise_std(mirrored["noise_std_ratio"])


@pytest.mark.slow
def test_mirrored_poisson_fit_matches_one_device(mirrored):
    # Its noise-free counterpart, with accumulation, is in the accumulation
    # test below; without, in the multiworker step test.
    _check_fit(mirrored["fit"])
    _check_evaluate(mirrored["fit"])


@pytest.mark.slow
def test_mirrored_user_level_fit_matches_one_device(mirrored):
    # Users whole on each replica and physical batch, padding included: the
    # noise-free update of two accumulated batches over two replicas equals
    # one device's, whose sensitivity tests/test_users.py checks.
    assert mirrored["user_fit_noise0_error"] < 1e-4


def test_mirrored_checks_every_replicas_batch(mirrored_core):
    # Review round 27: a custom loop giving replica 1 an input of one row
    # (broadcast over its examples: 15 C at 16 rows), and microbatches of two
    # examples on replica 1 only (recorded at replica 0's sensitivity 1:
    # 4.73 reported against 10.7). Review round 148: microbatches of batches
    # keras-dp did not lay out, split over replicas by position, moved by
    # 4 C with 2 C recorded: such a step applies nothing.
    found = mirrored_core["replica_batches"]
    assert found["uneven_unchanged"] and found["uneven_steps"] == 0
    assert found["grouped_steps"] == 0
    assert found["grouped_refusals"] == ["SPLIT_MICROBATCHES"]


@pytest.mark.slow
def test_mirrored_fits_a_distributed_dataset_and_refuses_a_model_made_private_outside(mirrored):
    found = mirrored["replica_batches"]
    assert found["distributed_dataset_steps"] == 2  # A dataset the user distributed.
    assert "created in a tf.distribute strategy's scope" in found["outside_the_scope"]


def test_mirrored_accumulation_applies_once_per_logical_batch(mirrored_core):
    """k = 2 batches per logical step: one apply on k B examples.

    Accumulation is per replica, the same whether the replicas share a
    process or not, so only the mirrored run checks it. It also measures
    the noise of one logical step: noise added at each batch would measure
    sqrt(2) = 1.41 (and a moved first batch), noise on each replica 1.41, a
    division by B instead of k B 2: all fail NOISE_STD_TOLERANCE.
    """
    accumulation = mirrored_core["accumulation"]
    assert accumulation["vs_single"] < 1e-4
    assert accumulation["vs_combined"] < 1e-4
    assert accumulation["first_batch_unchanged"]
    assert accumulation["privacy_steps"] == accumulation["iterations"] == 2
    _check_noise_std(accumulation["noise_std_ratio"])


@pytest.mark.slow
def test_mirrored_accumulated_fits_match_one_device(mirrored):
    accumulation = mirrored["accumulation"]
    _check_fit(accumulation["fit"], logical_steps=2 * 4)
    _check_noise_free_fit(accumulation)


@pytest.mark.slow  # Two worker processes take both cores: make test-all.
def test_multiworker_step_equals_one_device_and_noise_is_added_once(multiworker):
    # The noise-free fit on a Poisson dataset equals one device's: each
    # worker takes its share of every batch, and the clipped gradients are
    # summed over both processes.
    _, results = multiworker
    for result in results:
        _check_noise_free_fit(result)
        _check_noise_std(result["noise_std_ratio"])


@pytest.mark.slow  # Two worker processes take both cores: make test-all.
def test_multiworker_workers_agree(multiworker):
    log_dir, results = multiworker
    for result in results:
        _check_fit(result["fit"])
        _check_evaluate(result["fit"])
    first, second = (result["fit"] for result in results)
    assert first["weights_digest"] == second["weights_digest"]
    assert first["privacy_steps"] == second["privacy_steps"]
    assert first["epsilon"] == second["epsilon"]
    assert os.listdir(log_dir / "task0")  # The chief writes TensorBoard logs,
    assert not (log_dir / "task1").exists()  # the other worker does not.


@pytest.mark.slow  # Two worker processes take both cores: make test-all.
def test_multiworker_refuses_data_workers_cannot_share(multiworker):
    _, results = multiworker
    for result in results:
        refused = result["refused"]
        assert "Poisson batches only" in refused["shuffle"]
        assert "different seeds" in refused["seeds"]
        assert refused["unchanged"] and refused["privacy_steps"] == 0


def _private_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    private = keras_dp.make_private(model)
    private.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                    loss="mse")
    return private


def test_refuses_a_strategy_without_synchronous_replicas():
    with tf.distribute.experimental.CentralStorageStrategy().scope():
        private = _private_model()
    before = private.get_weights()
    with pytest.raises(ValueError, match="MirroredStrategy"):
        private.train_on_batch(np.ones((4, 3), "float32"), np.ones((4, 2), "float32"))
    for old, new in zip(before, private.get_weights()):
        np.testing.assert_array_equal(old, new)
    assert private.privacy_steps == 0


def test_a_mirrored_strategy_of_one_device_trains():
    """Review round 149 (LOW): a model built, made private and compiled in a
    one-device MirroredStrategy's scope was refused as made outside it."""
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        private = _private_model()
    private.fit(np.ones((8, 3), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0)
    assert private.privacy_steps > 0


def test_refuses_a_poisson_dataset_split_for_other_replicas():
    private = _private_model()
    dataset = keras_dp.data.poisson_dataset(np.ones((40, 3), "float32"),
                                            np.ones((40, 2), "float32"),
                                            expected_batch_size=8, num_replicas=2)
    with pytest.raises(ValueError, match="num_replicas=1"):
        private.fit(dataset, verbose=0)
    assert private.privacy_steps == 0


def test_poisson_batches_split_evenly_over_replicas_with_whole_groups():
    dataset = keras_dp.data.poisson_dataset(
        np.arange(100, dtype="float32")[:, None], expected_batch_size=10, seed=3,
        num_microbatches=2, num_replicas=3)
    info = keras_dp.data.sampling_info_of(dataset)
    x, _, weights = next(iter(dataset))
    rows = x.numpy()[:, 0][weights.numpy() > 0].astype(int)
    slots = info.physical_batch_size // 6  # 2 microbatches x 3 replicas.
    assert info.physical_batch_size % 3 == 0
    # Row r holds group r // slots (drawn at random per example and step):
    # each group's examples in index order, then its padding.
    real = (weights.numpy() > 0).reshape(6, slots)
    for group, block in enumerate(x.numpy()[:, 0].reshape(6, slots)):
        members = block[real[group]]
        assert np.all(real[group][:len(members)]) and np.all(np.diff(members) > 0)
    assert len(rows) > 0


def test_bucketed_poisson_batches_split_evenly_over_replicas_and_accumulation_steps():
    dataset = keras_dp.data.poisson_dataset(
        np.arange(1000, dtype="float32")[:, None], expected_batch_size=90, seed=3,
        num_replicas=3, accumulation_steps=2)
    bucket = keras_dp.data.sampling_info_of(dataset).padding_multiple
    assert bucket == 24  # B / 16 = 5.6, but at least lcm(8, 2 x 3) rows.
    sizes = [int(x.shape[0]) for x, _, _ in dataset]
    # Each physical batch is half a logical one padded to a multiple of 24,
    # so each of the 3 replicas takes an equal share.
    assert all(size % 12 == 0 for size in sizes)
    assert sizes[0::2] == sizes[1::2] and len(set(sizes)) > 1


# The example as a program (10 s): make test-all; make test checks its steps on two
# devices in the mirrored worker's core mode.
@pytest.mark.slow
@pytest.mark.program
def test_example_runs_on_two_logical_devices(tmp_path):
    repo = os.path.dirname(os.path.dirname(WORKER))
    result = subprocess.run(
        [sys.executable, os.path.join(repo, "examples", "distributed.py"),
         f"--data_dir={tmp_path / 'missing'}", "--num_examples=512", "--batch_size=64",
         "--epochs=1"],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=repo,
        env=dict(os.environ, PYTHONPATH=repo, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 replicas, 8 private steps, epsilon" in result.stdout
