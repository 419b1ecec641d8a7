"""The keras-dp command line: in process, and as `python -m keras_dp.cli`."""

import inspect
import math
import os
import re
import subprocess
import sys
import typing

import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver

from keras_dp import accounting
from keras_dp import cli

# Does not depend on TensorFlow's CPU kernel set (the command line's arguments,
# messages and exit codes):
# `make test` runs it once, with oneDNN off (the marker in pytest.ini).
pytestmark = pytest.mark.once

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
    # 2.600343 and 2.385211: rounded up, never printing less than the bound.
    assert "RDP epsilon: 2.6004" in out
    assert "PLD epsilon: 2.3853" in out
    assert "(2.601, 1e-05)-differentially private" in out
    assert "one training example" in out


def test_epsilon_over_users_is_poisson_sampling_of_users(run):
    code, out, _ = run("epsilon", "--num_users", "5000", "--batch_size", "100",
                       "--epochs", "30", "--noise_multiplier", "1.0")
    assert code == 0
    delta = accounting.default_delta(5000)  # Below 1 / (number of users).
    expected = accounting.compute_epsilon(5000, 100, 1.0, delta, epochs=30)
    assert f"RDP user-level epsilon: {accounting.format_upper(expected, 4)}" in out
    assert "one user (all of that user's examples) as the unit" in out
    assert "a person with several examples is protected less" not in out
    for args, message in [(("--num_examples", "5000"), "exactly one of --num_examples"),
                          (("--sampling", "shuffle"), "Poisson sampling over users")]:
        code, _, err = run("epsilon", "--num_users", "5000", "--batch_size", "100",
                           "--epochs", "30", "--noise_multiplier", "1.0", *args)
        assert code == 2 and message in err


def test_epsilon_by_steps_with_shuffling_and_default_delta(run):
    code, out, _ = run("epsilon", "--num_examples", "60000", "--batch_size", "256",
                       "--steps", "470", "--noise_multiplier", "1.1",
                       "--sampling", "shuffle")
    assert code == 0
    delta = accounting.default_delta(60000)
    expected = accounting.compute_epsilon(60000, 256, 1.1, delta, steps=470,
                                          sampling="shuffle")
    assert f"RDP epsilon: {accounting.format_upper(expected, 4)}" in out
    assert f"delta: {accounting.format_upper(delta, 4, 'g')}" in out
    assert "unamplified" in out


def test_calibrate_prints_a_noise_multiplier_meeting_the_target(run):
    code, out, _ = run("calibrate", "--target_epsilon", "3", *MNIST, "--epochs", "60")
    assert code == 0
    sigma = float(re.search(r"noise_multiplier: ([0-9.]+)", out).group(1))
    # The printed sigma is rounded up, so it is within budget as printed.
    assert 0.99 * 3 <= accounting.compute_epsilon(60000, 256, sigma, 1e-5, epochs=60) <= 3
    assert accounting.compute_epsilon(60000, 256, sigma - 1e-4, 1e-5, epochs=60) <= 3.001


@pytest.mark.parametrize("args,message", [
    ([], "Give one command"),
    (["train"], "Give one command"),
    (["epsilon", *MNIST, "--epochs", "60"], "--noise_multiplier is required"),
    (["epsilon", *MNIST, "--noise_multiplier", "1"],
     "Give exactly one of --epochs and --steps, got neither."),
    (["epsilon", "--num_examples", "60000", "--batch_size", "256", "--delta", "1e-3",
      "--epochs", "1", "--noise_multiplier", "1"], "delta"),
    (["epsilon", "--num_examples", "60000", "--batch_size", "0", "--epochs", "1",
      "--noise_multiplier", "1"], "batch_size"),
    (["epsilon", *MNIST, "--epochs", "1", "--noise_multiplier", "-1"], "noise_multiplier"),
    (["calibrate", "--target_epsilon", "-1", *MNIST, "--epochs", "60"], "target_epsilon"),
    (["epsilon", *MNIST, "--sampling", "uniform"], "sampling"),
    (["epsilon", *MNIST, "--epochs", "many"], "--epochs=many"),
    (["epsilon", "-x"], "Unknown command line flag 'x'. Run keras-dp --help"),
])
def test_bad_input_is_a_message_and_nonzero_exit(run, args, message):
    code, _, err = run(*args)
    assert code != 0
    assert message in err
    assert "Traceback" not in err


# `python -m keras_dp` starts the same main() the in-process tests call.
@pytest.mark.slow
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
    assert "RDP epsilon: 0.7243" in result.stdout  # 0.724223, rounded up.


def test_calibrate_for_exactly_the_steps_fit_runs(run):
    # 1,000 examples in batches of 300 for 10 epochs: fit runs 40 steps.
    common = ["calibrate", "--target_epsilon", "2", "--num_examples", "1000",
              "--batch_size", "300", "--delta", "1e-4"]
    by_epochs, by_steps = run(*common, "--epochs", "10"), run(*common, "--steps", "40")
    assert by_epochs[0] == by_steps[0] == 0
    sigma = float(re.search(r"noise_multiplier: ([0-9.]+)", by_steps[1]).group(1))
    assert by_epochs[1] == by_steps[1]
    assert accounting.compute_epsilon(1000, 300, sigma, 1e-4, steps=40) <= 2
    code, _, err = run(*common, "--epochs", "10", "--steps", "40")
    assert code == 2 and "Give exactly one of --epochs and --steps, got both." in err


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
    assert "private steps: 10" in out and "1. Poisson sampling q = 0.1" in out
    epsilon = accounting.format_upper(model.privacy_spent(1e-3)[0], 4)
    assert f"epsilon: {epsilon} (delta 0.001), RDP accountant" in out
    # The same report as the model's, but for the optimizer, which is not loaded.
    loaded = model.privacy_report(1e-3).replace(
        "clipping norm C (now): 1; sigma", "clipping norm: unknown (no DP optimizer loaded); sigma")
    assert out.strip().endswith(loaded.split("\n", 1)[1])


def test_plan_prints_keras_dp_plan(run):
    from keras_dp import planning

    code, out, _ = run("plan", "--target_epsilon", "3", "--num_examples", "2000",
                       "--num_weights", "2757761", "--batch_size", "32", "--epochs", "2")
    assert code == 0
    expected = planning.plan(num_weights=2757761, num_examples=2000, target_epsilon=3.0,
                             batch_size=32, epochs=2)
    assert out.strip() == str(expected)
    assert f"noise-to-signal: {expected.noise_to_signal:.2f} (yours: 36.92)" in out
    code, _, err = run("plan", "--target_epsilon", "3", "--num_examples", "2000",
                       "--num_weights", "1000")
    assert code == 2 and "pass batch_size and epochs" in err


def test_printed_bounds_round_outwards():
    # Rounding to nearest printed 2.6003 for 2.600339: less than the bound.
    assert accounting.format_upper(2.600339, 4) == "2.6004"
    assert accounting.format_lower(2.600339, 4) == "2.6003"
    assert accounting.format_upper(2.600339, 2) == "2.61"
    assert accounting.format_lower(2.609, 2) == "2.60"
    assert accounting.format_upper(2.6, 4) == "2.6000"  # Exact values stay.
    assert accounting.format_upper(2.600339, 4, "g") == "2.601"
    assert accounting.format_upper(5.54701e-06, 3, "g") == "5.55e-06"
    assert accounting.format_lower(9.9996, 3, "g") == "9.99"
    assert accounting.format_upper(9.9991, 4, "g") == "10"
    assert accounting.format_upper(math.inf, 2) == "inf"


def test_audit_prints_the_claim_up_and_the_lower_bound_down(run, monkeypatch):
    from keras_dp import audit

    one_run = audit.OneRunResult(1.234567, 10, 10, 19, 100, 14, 0.05)
    membership = audit.MembershipInferenceResult(0.5, {0.01: 0.01}, 0.0)
    result = audit.AuditResult(2.600339, 1e-5, 1.239, one_run, 1050,
                               np.zeros(100), np.ones(100, bool), membership)
    monkeypatch.setattr(audit, "audit_builtin_task", lambda **kwargs: result)
    code, out, _ = run("audit")
    assert code == 0
    assert out.strip().splitlines()[-1] == (
        "claimed epsilon 2.61, empirical epsilon lower bound 1.23 (95% confidence)")


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["help"]])
def test_help_lists_every_command_and_its_flags(run, args):
    code, out, err = run(*args)
    assert code == 0 and not err
    text = " ".join(out.split())  # Lines are wrapped at 80 columns.
    for name, command in cli._COMMANDS.items():
        assert f"keras-dp {name}: {command.summary}" in text
        for holder in command.required + command.optional:
            assert f"--{holder.name}: {flags.FLAGS[holder.name].help}" in text
    assert "(required)" in out and "(default 10000)" in out  # audit's --num_examples
    assert "tpu" not in out.lower() and "Try --helpfull" not in out
    assert len(out.splitlines()) < 100  # Five commands.


@pytest.mark.parametrize("args", [["calibrate", "--help"], ["help", "calibrate"],
                                  ["calibrate", "-h", "--epochs", "3"]])
def test_command_help_lists_that_command_only(run, args):
    code, out, _ = run(*args)
    assert code == 0
    assert "keras-dp calibrate: " in out and "--target_epsilon: " in out
    assert "keras-dp epsilon: " not in out and "--model" not in out


def test_public_functions_are_annotated():
    for function in (cli.main, accounting.compute_epsilon,
                     accounting.calibrate_noise_multiplier, accounting.default_delta,
                     accounting.check_delta, accounting.privacy_statement,
                     accounting.format_upper, accounting.format_lower):
        hints = typing.get_type_hints(function)
        parameters = inspect.signature(function).parameters
        assert set(hints) == set(parameters) | {"return"}, function.__name__


# A fresh interpreter (10 s): make test-all; make test calibrates in-process
# (tests/test_accounting.py).
@pytest.mark.slow
@pytest.mark.program
def test_calibrate_prints_no_library_noise():
    # The fashion_mnist example's calibration: sigma = 1 is tried, where
    # dp_accounting's RDP series of orders 1.1 to 1.6 do not converge.
    result = subprocess.run(
        [sys.executable, "-m", "keras_dp.cli", "calibrate", "--target_epsilon", "3",
         "--num_examples", "58800", "--batch_size", "8192", "--epochs", "40",
         "--delta", "1e-5"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "noise_multiplier: 3.8812" in result.stdout  # 3.881152, rounded up.
    assert "failed to converge" not in result.stderr
    assert "cuInit" not in result.stderr and "E0000" not in result.stderr
