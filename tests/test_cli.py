"""The keras-dp command line: in process, and as `python -m keras_dp.cli`."""

import os
import re
import subprocess
import sys

import pytest
from absl.testing import flagsaver

from keras_dp import accounting
from keras_dp import cli

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
