"""The keras-dp command line: in process, and as `python -m keras_dp.cli`."""

import os
import re
import subprocess
import sys

import pytest
from absl.testing import flagsaver

from keras_dp import accounting
from keras_dp import cli

# Does not depend on TensorFlow's CPU kernel set (the command line's arguments,
# messages and exit codes):
# `make test` runs it once, with oneDNN off (the marker in pytest.ini).
pytestmark = pytest.mark.kernel_independent

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST = ["--num_examples", "60000", "--batch_size", "256", "--delta", "1e-5"]


@pytest.fixture
def run(monkeypatch, capsys):
    """Runs `keras-dp ARGS` in process; returns (exit code, stdout, stderr)."""

    def run_cli(*args):
        monkeypatch.setattr(sys, "argv", ["keras-dp", *args])
        # absl keeps parsed flag values; restore them for the next run.
        with flagsaver.flagsaver(), pytest.raises(SystemExit) as exit_info:
            cli.main()
        captured = capsys.readouterr()
        return exit_info.value.code, captured.out, captured.err

    return run_cli


def test_epsilon_prints_both_accountants_and_statement(run):
    code, out, _ = run("epsilon", *MNIST, "--epochs", "60", "--noise_multiplier", "1.1")
    assert code == 0
    assert "RDP epsilon: 2.6003" in out
    assert "PLD epsilon: 2.3852" in out
    assert "(2.6, 1e-05)-differentially private" in out
    assert "one training example" in out


def test_epsilon_by_steps_with_shuffling_and_default_delta(run):
    code, out, _ = run("epsilon", "--num_examples", "60000", "--batch_size", "256",
                       "--steps", "470", "--noise_multiplier", "1.1",
                       "--sampling", "shuffle")
    assert code == 0
    delta = accounting.default_delta(60000)
    expected = accounting.compute_epsilon(60000, 256, 1.1, delta, steps=470,
                                          sampling="shuffle")
    assert f"RDP epsilon: {expected:.4f}" in out
    assert "unamplified" in out


def test_calibrate_prints_a_noise_multiplier_meeting_the_target(run):
    code, out, _ = run("calibrate", "--target_epsilon", "3", *MNIST, "--epochs", "60")
    assert code == 0
    sigma = float(re.search(r"noise_multiplier: ([0-9.]+)", out).group(1))
    # The printed value is rounded to 4 decimals; round up to stay in budget.
    epsilon = accounting.compute_epsilon(60000, 256, sigma + 1e-4, 1e-5, epochs=60)
    assert 0.99 * 3 <= epsilon <= 3


@pytest.mark.parametrize("args,message", [
    ([], "give one command"),
    (["train"], "give one command"),
    (["epsilon", *MNIST, "--epochs", "60"], "--noise_multiplier is required"),
    (["epsilon", *MNIST, "--noise_multiplier", "1"], "epochs and steps"),
    (["epsilon", "--num_examples", "60000", "--batch_size", "256", "--delta", "1e-3",
      "--epochs", "1", "--noise_multiplier", "1"], "delta"),
    (["epsilon", "--num_examples", "60000", "--batch_size", "0", "--epochs", "1",
      "--noise_multiplier", "1"], "batch_size"),
    (["epsilon", *MNIST, "--epochs", "1", "--noise_multiplier", "-1"], "noise_multiplier"),
    (["calibrate", "--target_epsilon", "-1", *MNIST, "--epochs", "60"], "target_epsilon"),
    (["epsilon", *MNIST, "--sampling", "uniform"], "sampling"),
    (["epsilon", *MNIST, "--epochs", "many"], "epochs"),
])
def test_bad_input_is_a_message_and_nonzero_exit(run, args, message):
    code, _, err = run(*args)
    assert code != 0
    assert message in err
    assert "Traceback" not in err


@pytest.mark.program
def test_python_dash_m_entry_point():
    # One subprocess only: most of its time is importing TensorFlow. Bad input
    # takes the same main() path, tested in process above.
    result = subprocess.run(
        [sys.executable, "-m", "keras_dp.cli", "epsilon", "--num_examples", "60000",
         "--batch_size", "150", "--delta", "1e-5", "--epochs", "15",
         "--noise_multiplier", "1.3"],
        cwd=REPO_ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "RDP epsilon: 0.7242" in result.stdout


def test_calibrate_for_exactly_the_steps_fit_runs(run):
    # 1,000 examples in batches of 300 for 10 epochs: fit runs 40 steps.
    common = ["calibrate", "--target_epsilon", "2", "--num_examples", "1000",
              "--batch_size", "300", "--delta", "1e-4"]
    by_epochs, by_steps = run(*common, "--epochs", "10"), run(*common, "--steps", "40")
    assert by_epochs[0] == by_steps[0] == 0
    sigma = float(re.search(r"noise_multiplier: ([0-9.]+)", by_steps[1]).group(1))
    assert by_epochs[1] == by_steps[1]
    assert accounting.compute_epsilon(1000, 300, sigma + 1e-4, 1e-4, steps=40) <= 2
    code, _, err = run(*common, "--epochs", "10", "--steps", "40")
    assert code != 0 and "--epochs and --steps" in err


def test_spent_prints_the_ledger_of_a_saved_model(run, tmp_path):
    import keras
    import numpy as np

    import keras_dp

    model = keras_dp.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    model.fit(np.zeros((100, 4)), np.zeros((100, 1)), batch_size=10, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    code, out, _ = run("spent", "--model", path, "--delta", "1e-3")
    assert code == 0
    assert "private steps: 10" in out and "sampling='poisson'" in out
    assert f"RDP epsilon: {model.privacy_spent(1e-3)[0]:.4f}" in out
