"""The Fashion-MNIST example, its IDX loader, and the speed benchmark."""

import glob
import gzip
import importlib
import json
import os
import re
import struct
import subprocess
import sys
import types

import numpy as np
import pytest

# Does not depend on TensorFlow's CPU kernel set (IDX files, the example's model
# and data split; the whole-program tests run once anyway):
# `make test` runs it once, with oneDNN off (the marker in pytest.ini).
pytestmark = pytest.mark.once

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(REPO_ROOT, "examples")
DATA_DIR = "/usr/share/datasets/fashion-mnist"
HAVE_FASHION_MNIST = os.path.isdir(DATA_DIR)

sys.path.insert(0, EXAMPLES_DIR)
datasets = importlib.import_module("datasets")

# The demo's last line, exactly.
FINAL_LINE = re.compile(r"test accuracy ([0-9]\.[0-9]{4}) at epsilon ([0-9]+\.[0-9]{4}|inf) "
                        r"\(delta ([0-9.e-]+)\)\n?$")


def run_python(args, timeout):
    """`python ARGS` from the checkout, importing its keras_dp, with TensorFlow's
    C++ log quiet; returns the completed process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO_ROOT)


def run(script, *args, timeout=900):
    return run_python([os.path.join(REPO_ROOT, script), *args], timeout)


# Runs example programs one after the other in ONE fresh interpreter, each as
# `python SCRIPT ARGS` would (run as __main__, its own argv and absl flags, its
# own stdout, stderr and exit code): a fresh interpreter per program costs
# about 8 s of CPU importing TensorFlow and keras_dp. The flags a program
# defines (absl files them under the program's path) are deleted after it, so
# that the next can define its own.
PROGRAMS_IN_ONE_PROCESS = r"""
import contextlib, io, json, runpy, sys, traceback
from absl import flags

for script, args in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    sys.argv = [script, *args]
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit:
            code = exit.code or 0
        except BaseException:
            traceback.print_exc()
            code = 1
    for flag in list(flags.FLAGS.flags_by_module_dict().get(script, [])):
        delattr(flags.FLAGS, flag.name)
    print(json.dumps(dict(script=script, returncode=code, stdout=stdout.getvalue(),
                          stderr=stderr.getvalue())), flush=True)
"""


def run_in_one_process(programs, timeout=1800):
    """Runs each (script, args) of `programs` as above; returns {script: result}
    with `returncode`, `stdout` and `stderr` (the interpreter's own C++ log
    lines and crash, if any, are in the last result's `stderr`)."""
    done = run_python(["-c", PROGRAMS_IN_ONE_PROCESS, json.dumps(programs)], timeout)
    results = {}
    for line in done.stdout.splitlines():
        if not line.startswith('{"script": '):
            continue  # Written around Python's sys.stdout, e.g. by C++ code.
        result = json.loads(line)
        results[result.pop("script")] = types.SimpleNamespace(**result)
    for script, _ in programs:  # Those a crash of the interpreter left out.
        results.setdefault(script, types.SimpleNamespace(
            returncode=done.returncode, stdout="", stderr=done.stderr))
    return results


def idx_bytes(array, type_code=0x08):
    """An IDX file written by hand: magic 0x0000<type><ndim>, big-endian dims, data."""
    header = struct.pack(">BBBB", 0, 0, type_code, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


# ---------------------------------------------------------------- IDX loader


@pytest.mark.parametrize("compressed", [True, False])
def test_read_idx_images_and_labels(tmp_path, compressed):
    images = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    labels = np.array([7, 0, 9], np.uint8)
    suffix = ".gz" if compressed else ""
    opener = gzip.open if compressed else open
    for name, array in (("images", images), ("labels", labels)):
        with opener(tmp_path / f"{name}{suffix}", "wb") as f:
            f.write(idx_bytes(array))
    read_images = datasets.read_idx(str(tmp_path / f"images{suffix}"), expected_ndim=3)
    read_labels = datasets.read_idx(str(tmp_path / f"labels{suffix}"), expected_ndim=1)
    np.testing.assert_array_equal(read_images, images)
    np.testing.assert_array_equal(read_labels, labels)
    assert read_images.dtype == np.uint8 and read_labels.shape == (3,)


def test_read_idx_big_endian_int32(tmp_path):
    values = np.array([[1, -2], [70000, 3]], ">i4")
    (tmp_path / "ints").write_bytes(idx_bytes(values, type_code=0x0C))
    read = datasets.read_idx(str(tmp_path / "ints"))
    np.testing.assert_array_equal(read, [[1, -2], [70000, 3]])
    assert read.dtype == np.int32 and read.dtype.isnative


def test_write_idx_round_trip(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (6, 28, 28)).astype(np.uint8)
    path = str(tmp_path / "images.gz")
    datasets.write_idx(path, images)
    with gzip.open(path, "rb") as f:
        assert f.read(4) == bytes([0, 0, 0x08, 3])  # The images' magic, 0x00000803.
    np.testing.assert_array_equal(datasets.read_idx(path, expected_ndim=3), images)


@pytest.mark.parametrize("content, message", [
    (b"\x01\x02\x08\x01\x00\x00\x00\x01\x05", "bad magic"),
    (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "type code"),
    (b"\x00\x00\x08\x01\x00\x00\x00\x03\x05", "holds 1 bytes"),
    (b"\x00\x00\x08\x02\x00\x00", "truncated"),
])
def test_read_idx_refuses_malformed_files(tmp_path, content, message):
    (tmp_path / "bad").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        datasets.read_idx(str(tmp_path / "bad"))


def test_read_idx_checks_dimensions(tmp_path):
    (tmp_path / "labels").write_bytes(idx_bytes(np.zeros(4, np.uint8)))
    with pytest.raises(ValueError, match="expected an IDX file with 3 dimensions"):
        datasets.read_idx(str(tmp_path / "labels"), expected_ndim=3)


def write_fake_fashion_mnist(directory, num_train=20, num_test=10):
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (num_train, 28, 28)).astype(np.uint8),
        "train_labels": rng.integers(0, 10, num_train).astype(np.uint8),
        "test_images": rng.integers(0, 256, (num_test, 28, 28)).astype(np.uint8),
        "test_labels": rng.integers(0, 10, num_test).astype(np.uint8),
    }
    for key, name in datasets.FILES.items():
        with gzip.open(os.path.join(directory, name), "wb") as f:
            f.write(idx_bytes(arrays[key]))
    return arrays


def test_load_fashion_mnist_from_files(tmp_path):
    arrays = write_fake_fashion_mnist(str(tmp_path))
    (x_train, y_train), (x_test, y_test) = datasets.load_fashion_mnist(str(tmp_path))
    np.testing.assert_array_equal(x_train, arrays["train_images"])
    np.testing.assert_array_equal(y_train, arrays["train_labels"])
    np.testing.assert_array_equal(x_test, arrays["test_images"])
    np.testing.assert_array_equal(y_test, arrays["test_labels"])


def test_load_fashion_mnist_refuses_mismatched_counts(tmp_path):
    write_fake_fashion_mnist(str(tmp_path))
    with gzip.open(tmp_path / datasets.FILES["train_labels"], "wb") as f:
        f.write(idx_bytes(np.zeros(19, np.uint8)))
    with pytest.raises(ValueError, match="20 train images but 19 train labels"):
        datasets.load_fashion_mnist(str(tmp_path))


def test_missing_dataset_names_the_debian_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        datasets.load_fashion_mnist(str(tmp_path))


# ---------------------------------------------------------------- the example


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, REPO_ROOT)
    return importlib.import_module("fashion_mnist")


def test_example_model_is_the_reference_cnn(example):
    import keras

    model = example.build_cnn()
    assert model.output_shape == (None, 10)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds.count("Conv2D") == 2 and kinds.count("Dense") == 2
    assert "BatchNormalization" not in kinds
    conv1, conv2 = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)]
    assert (conv1.filters, conv1.kernel_size, conv1.strides) == (16, (8, 8), (2, 2))
    assert (conv2.filters, conv2.kernel_size, conv2.strides) == (32, (4, 4), (2, 2))
    with_norm = example.build_cnn(group_norm=True)
    kinds = [type(layer).__name__ for layer in with_norm.layers]
    assert kinds.count("GroupNormalization") == 2
    assert "BatchNormalization" not in kinds


def test_example_validation_split_is_disjoint(example):
    x = np.arange(1000)
    y = np.arange(1000) % 10
    (x_train, y_train), (x_val, y_val) = example.split_data(x, y, 500, 0.1, seed=0)
    assert len(x_train) == 450 and len(x_val) == 50
    assert not set(x_train) & set(x_val)
    np.testing.assert_array_equal(y_train, x_train % 10)  # Pairs stay together.


# The program's exit (5 s, mostly importing TensorFlow) beside the loader's own
# message, checked in process above.
@pytest.mark.slow
@pytest.mark.program
def test_example_reports_missing_dataset(tmp_path):
    result = run("examples/fashion_mnist.py", f"--data_dir={tmp_path}", timeout=300)
    assert result.returncode != 0
    assert "apt-get install dataset-fashion-mnist" in result.stderr


@pytest.fixture(scope="module")
def subset_dir(tmp_path_factory):
    """Where the run on a subset writes its results and TensorBoard logs."""
    return tmp_path_factory.mktemp("subset")


# benchmarks/speed.py, small.
BENCHMARK_ARGS = ["--steps=2", "--warmup_steps=1", "--repeats=1", "--batch_size=32",
                  "--fit_examples=320", "--memory_batch_size=32"]


@pytest.fixture(scope="module")
def example_runs(request, subset_dir):
    """{test name: result} of the example programs (and the speed benchmark)
    that the selected tests below check, run in one process (run_in_one_process)."""
    programs = {
        # Its smoke test: tracing its step is most of the time, one epoch suffices.
        "test_text_example_trains_offline": ("examples/text_classification.py", [
            "--num_examples=1024", "--epochs=1", "--batch_size=256"]),
        "test_user_level_example_prints_both_epsilons": ("examples/user_level.py", [
            "--num_users=400", "--heavy_users=4", "--epochs=2", "--users_per_batch=64"]),
        "test_the_private_vocabulary_example_reports_one_epsilon": (
            "examples/private_vocabulary.py", ["--num_examples=1000", "--epochs=1",
                                               "--mean_trials=2"]),
        "test_lstm_example_trains_offline_on_the_ghost_engine": ("examples/private_lstm.py", [
            "--num_examples=1024", "--epochs=1", "--batch_size=256", "--units=8"]),
        "test_benchmark_times_private_and_keras_side_by_side": ("benchmarks/speed.py", [
            "--models=cnn", *BENCHMARK_ARGS, "--configs=keras,private", "--modes=step,fit",
            "--memory=false"]),
    }
    if HAVE_FASHION_MNIST:
        programs["test_quickstart_runs"] = ("examples/quickstart.py", [])
        # Its scattering transform takes time in proportion to the images: 600
        # (588 train, 12 validation) and 300 test images, not 70,000; seed 0
        # reaches about 0.65 test accuracy at epsilon 3.
        programs["test_example_trains_on_a_subset"] = ("examples/fashion_mnist.py", [
            "--num_examples=600", "--num_test_examples=300", "--epochs=2",
            "--batch_size=256", f"--results={subset_dir / 'results.json'}",
            f"--log_dir={subset_dir / 'logs'}"])
    selected = [programs[item.originalname] for item in request.session.items
                if item.originalname in programs]
    results = run_in_one_process(selected)
    return {name: results[script] for name, (script, _) in programs.items()
            if script in results}


@pytest.mark.skipif(not HAVE_FASHION_MNIST,
                    reason=f"Fashion-MNIST not installed in {DATA_DIR} "
                           "(apt-get install dataset-fashion-mnist)")
@pytest.mark.program
def test_example_trains_on_a_subset(example_runs, subset_dir):
    result, results = example_runs["test_example_trains_on_a_subset"], subset_dir / "results.json"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    match = FINAL_LINE.search(result.stdout)
    assert match, result.stdout[-3000:]
    accuracy, epsilon, delta = (float(g) for g in match.groups())
    assert 0.3 < accuracy <= 1.0  # Ten classes: chance is 0.1.
    assert epsilon == pytest.approx(3.0, rel=0.01) and delta == 1e-5
    assert re.search(r"epoch 2/2, loss [0-9.]+, train accuracy [0-9.]+, validation accuracy "
                     r"[0-9.]+, epsilon [0-9.]+", result.stdout), result.stdout[-3000:]
    summary = json.loads(results.read_text())
    assert summary["test_accuracy"] == pytest.approx(accuracy, abs=1e-4)
    assert summary["epsilon"] == pytest.approx(epsilon, abs=1e-4)
    assert summary["hyperparameters"]["model"] == "scatter_linear"
    assert glob.glob(str(subset_dir / "logs" / "**" / "events.out.tfevents*"), recursive=True)


# ------------------------------------------------- quickstart, text, utility


def marked_section(path, begin, end):
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        text = f.read()
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def test_the_readme_quickstart_is_the_quickstart_example():
    readme = marked_section("README.md", "```python", "```")  # Its first code block.
    assert readme == marked_section("examples/quickstart.py", "# --- README: quickstart ---",
                                    "# --- end ---")


# Three epochs of Fashion-MNIST (14 s): make test-all; make test checks the
# README's code is this program's, and trains the example on a subset.
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_FASHION_MNIST, reason="Fashion-MNIST not installed")
@pytest.mark.program
def test_quickstart_runs(example_runs):
    result = example_runs["test_quickstart_runs"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    match = FINAL_LINE.search(result.stdout)
    assert match, result.stdout[-3000:]
    accuracy, epsilon, _ = (float(g) for g in match.groups())
    assert accuracy > 0.7 and 0 < epsilon < 3


# Its tokenization, sampling and accounting are tested in make test
# (TextVectorization pipelines in tests/test_pipelines.py and
# test_preprocessing.py): the run, 10 s, in make test-all.
@pytest.mark.slow
@pytest.mark.program
def test_text_example_trains_offline(example_runs):
    result = example_runs["test_text_example_trains_offline"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    match = FINAL_LINE.search(result.stdout)
    assert match, result.stdout[-3000:]
    assert float(match.group(2)) == pytest.approx(3.0, rel=0.01)


# The examples below run in make test-all: their mechanisms are tested in
# make test (tests/test_users.py, test_preprocessing.py and test_tuning.py,
# clipping/test_recurrent.py), and each program takes 4-6 s of its budget.
@pytest.mark.slow
@pytest.mark.program
def test_user_level_example_prints_both_epsilons(example_runs):
    result = example_runs["test_user_level_example_prints_both_epsilons"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "user_epsilon" in result.stdout  # The progress bar names the unit.
    claimed = re.search(r"example-level epsilon the same run would claim: ([0-9.]+)",
                        result.stdout)
    final = re.search(r"test accuracy ([0-9.]+) at user-level epsilon ([0-9.]+) ",
                      result.stdout)
    assert claimed and final, result.stdout[-3000:]
    assert float(final.group(1)) > 0.7
    # Calibrated for user-level epsilon 3; the example-level reading claims less.
    assert float(final.group(2)) == pytest.approx(3.0, rel=0.01)
    assert 0 < float(claimed.group(1)) < float(final.group(2))


@pytest.mark.slow
@pytest.mark.program
def test_the_private_vocabulary_example_reports_one_epsilon(example_runs):
    """No writer's name in the vocabulary, and the served model's epsilon
    covers vocabulary and search."""
    pytest.importorskip("keras_tuner")
    result = example_runs["test_the_private_vocabulary_example_reports_one_epsilon"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert re.search(r"vocabulary: \d+ tokens, 0 of \d+ writers' names", result.stdout)
    search_epsilon = float(re.search(r"best learning rate .*: epsilon ([\d.]+)",
                                     result.stdout).group(1))
    total = float(re.search(r"everything: epsilon ([\d.]+)", result.stdout).group(1))
    assert 1.0 < search_epsilon < total  # One trial is epsilon 1; the vocabulary adds.


@pytest.mark.slow
@pytest.mark.program
def test_lstm_example_trains_offline_on_the_ghost_engine(example_runs):
    result = example_runs["test_lstm_example_trains_offline_on_the_ghost_engine"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "clipping engine: ghost" in result.stdout
    match = FINAL_LINE.search(result.stdout)
    assert match, result.stdout[-3000:]
    assert float(match.group(2)) == pytest.approx(3.0, rel=0.01)


@pytest.mark.slow  # Two demo runs on a subset: about two minutes.
@pytest.mark.program
def test_privacy_utility_benchmark_prints_a_row_per_epsilon():
    result = run("benchmarks/privacy_utility.py", "--epsilons=3,inf",
                 "--extra_flags=--num_examples=2000,--epochs=1,--batch_size=256")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = re.findall(r"^\| (3|inf) \| ([0-9.]+) \| ([0-9.]+|inf) \|", result.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["3", "inf"], result.stdout
    assert float(rows[0][2]) <= 3.0 and rows[1][2] == "inf"


@pytest.mark.slow  # A tiny BERT, traced four times: about half a minute.
@pytest.mark.program
def test_ghost_bert_benchmark_runs_ghost_clipping_and_adds_no_op():
    pytest.importorskip("keras_hub")
    result = run("benchmarks/ghost_bert.py", "--vocabulary=50", "--layers=1", "--hidden=8",
                 "--sequence_length=8", "--batch_size=4", "--steps=1", "--rounds=1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert 'clipping_engine="auto" runs: ghost\n' in result.stdout, result.stdout
    assert re.search(r"with the analysis, \d+ without \(the same\)", result.stdout)
    assert re.search(r"vectorized / ghost \(cpu\): median [0-9.]+", result.stdout)


# ---------------------------------------------------------------- the benchmark


BENCHMARK_ROW = re.compile(
    r"^(non-private Keras|keras-dp private), jit_compile=(?:True|False)\s+(.+)$", re.MULTILINE)


def run_benchmark(model_name, *flags):
    """Runs benchmarks/speed.py small; returns each row's name and numbers."""
    return benchmark_rows(run("benchmarks/speed.py", f"--models={model_name}",
                              *BENCHMARK_ARGS, *flags))


def benchmark_rows(result):
    """Each row's name and numbers from a run of benchmarks/speed.py."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "failed" not in result.stdout + result.stderr, result.stdout + result.stderr[-5000:]
    assert re.search(r"^default private \(keras-dp private, jit_compile=False\) / best "
                     r"non-private: step speed [0-9.]+", result.stdout, re.MULTILINE), result.stdout
    rows = [(name, [float(v.replace(",", "")) if v != "-" else None for v in rest.split()])
            for name, rest in BENCHMARK_ROW.findall(result.stdout)]
    return rows, result.stdout


# Beside test_distribute.py's run of examples/distributed.py on the same two
# logical devices: this only times it.
@pytest.mark.slow
@pytest.mark.program
def test_distributed_benchmark_times_one_and_two_replicas():
    result = run("benchmarks/distributed_speed.py", "--num_examples=640", "--batch_size=64",
                 "--rounds=1", "--warmup_steps=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    speeds = re.findall(r"^  (1 device|2 replicas): ([0-9,]+) examples/s", result.stdout,
                        re.MULTILINE)
    assert [name for name, _ in speeds] == ["1 device", "2 replicas"], result.stdout
    assert all(float(speed.replace(",", "")) > 0 for _, speed in speeds)


# Its ratios' arithmetic is tested in make test (the two tests below it);
# the run, 8 s, in make test-all.
@pytest.mark.slow
@pytest.mark.program
def test_benchmark_times_private_and_keras_side_by_side(example_runs):
    result = example_runs["test_benchmark_times_private_and_keras_side_by_side"]
    rows, stdout = benchmark_rows(result)
    assert [name for name, _ in rows] == ["non-private Keras", "keras-dp private"], stdout
    for name, (step, step_ratio, fit, fit_ratio, *_) in rows:
        assert step > 0 and fit > 0, stdout
        if name == "non-private Keras":  # Ratios are to the best of these.
            assert step_ratio <= 1.0 and fit_ratio <= 1.0, stdout
    assert "fit: one epoch of 320 examples" in stdout
    # fit() / step also as CPU time per step, which other processes' load moves less.
    assert re.search(r"^default private fit\(\) / its own step: [0-9.]+ \(CPU [0-9.]+\)$",
                     stdout, re.MULTILINE), stdout
    # And within each round, which this machine's drift moves less still.
    assert re.search(r"^  fit, CPU within each of \d+ rounds, median \(range\): fit\(\) / step "
                     r"[0-9.]+ \([0-9.]+-[0-9.]+\), private / non-private [0-9.]+ ",
                     stdout, re.MULTILINE), stdout


# Half a minute on 2 cores: each configuration's memory runs in fresh processes.
@pytest.mark.slow
@pytest.mark.program
def test_benchmark_times_and_measures_memory_side_by_side():
    rows, stdout = run_benchmark("cnn", "--configs=keras,private")
    assert len(rows) == 2, stdout
    for _name, (step, _, fit, _, peak, _, growth, _, tensors, _) in rows:
        assert step > 0 and fit > 0, stdout
        assert peak > growth > 0 and tensors > 0, stdout
    assert rows[0][1][5::2] == [1.0, 1.0, 1.0], stdout  # Its own memory reference.


def test_benchmark_fit_counts_only_the_steps_an_epoch_ran(monkeypatch):
    # Keras reports the last execution of 20 batches at 8 per execution as
    # ending at batch 23; counting to it would time 16 steps where 12 ran.
    import keras
    monkeypatch.syspath_prepend(REPO_ROOT)
    # benchmarks.timing defines no absl flags, which keras_dp.cli's would clash with.
    timing = importlib.import_module("benchmarks.timing")
    seconds, cpu_ms = iter(range(1, 100)), iter(range(1, 100))

    class Clock:  # From one hook's call to the next: a second, and 1 ms of CPU.
        perf_counter = staticmethod(lambda: float(next(seconds)))
        process_time = staticmethod(lambda: next(cpu_ms) / 1000)

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    data = (np.zeros((20 * 8, 4), "float32"), np.zeros((20 * 8, 2), "float32"))
    monkeypatch.setattr(timing, "time", Clock)
    examples_per_second, cpu_ms_per_step = timing.timed_fit(model, data, batch_size=8,
                                                            warmup_steps=3)
    # Hooks after batches 7, 15 and 19 (reported 23): 12 steps in 2 ticks.
    assert examples_per_second == pytest.approx(12 * 8 / 2)
    assert cpu_ms_per_step == pytest.approx(2 / 12)


def test_benchmark_ratios_pair_each_round(monkeypatch):
    monkeypatch.syspath_prepend(REPO_ROOT)
    timing = importlib.import_module("benchmarks.timing")
    # fit() costs 1.05 steps, but the machine slowed by 40% in round 1
    # between its step and its fit(), and stayed slow.
    step, fit = [10.0, 14.0, 14.2], [14.7, 14.7, 14.7]
    median, least, largest = timing.round_ratios(step, fit)
    assert (least, median, largest) == pytest.approx((10 / 14.7, 14 / 14.7, 14.2 / 14.7))
    # The ratio of the bests pairs the fast step with a slow fit(): 0.68.
    assert min(step) / min(fit) == pytest.approx(least)
    assert timing.round_ratios([], fit) is None and timing.round_ratios(None, None) is None


@pytest.mark.slow  # About a minute on 2 cores: mostly tracing the private step.
@pytest.mark.program
def test_benchmark_transformer_smoke():
    rows, stdout = run_benchmark("transformer", "--memory=false")
    assert len(rows) == 4, stdout


@pytest.mark.slow  # Two speed.py runs of three configurations each.
@pytest.mark.program
def test_scaling_benchmark_prints_both_sweeps_and_writes_the_plot(tmp_path):
    svg = tmp_path / "scaling.svg"
    result = run("benchmarks/scaling.py", "--batch_sizes=8", "--sequence_lengths=8",
                 "--sequence_length=8", "--sequence_batch_size=8", "--tokens_per_round=64",
                 "--repeats=1", f"--svg={svg}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ratios = re.findall(r"^\| 8 \| ([0-9.]+) \|$", result.stdout, re.MULTILINE)
    assert len(ratios) == 2 and all(float(r) > 0 for r in ratios), result.stdout
    assert svg.read_text().count("<circle") == 2
