"""keras-dp: DP-SGD privacy accounting from the command line.

Commands:

  keras-dp epsilon --num_examples 60000 --batch_size 256 --epochs 60 \\
      --noise_multiplier 1.1 [--delta 1e-5] [--sampling poisson|shuffle]
    Prints the RDP and PLD epsilons of a training run and what they guarantee
    (use --steps instead of --epochs to count private steps).

  keras-dp calibrate --target_epsilon 3 --num_examples 60000 --batch_size 256 \\
      --epochs 60 [--delta 1e-5] [--accountant rdp|pld] [--sampling ...]
    Prints the smallest noise multiplier that meets the target epsilon for
    the steps fit(epochs=...) runs (or exactly --steps private steps).

  keras-dp spent --model model.keras [--delta 1e-5] [--accountant rdp|pld]
    Prints the privacy ledger of a saved private model (every run of steps
    with its mechanism) and the epsilon they spent.

--epochs are fit's: ceil(num_examples / batch_size) steps each.

--delta defaults to 1 / num_examples ** 1.1 and must be below 1 / num_examples.
"""

import sys

from absl import app
from absl import flags

from keras_dp import accounting

_NUM_EXAMPLES = flags.DEFINE_integer(
    "num_examples", None, "Number of training examples.")
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", None, "Expected (Poisson) or fixed (shuffle) batch size.")
_EPOCHS = flags.DEFINE_float("epochs", None, "Passes over the data.")
_STEPS = flags.DEFINE_integer("steps", None, "Private steps, instead of --epochs.")
_NOISE_MULTIPLIER = flags.DEFINE_float(
    "noise_multiplier", None, "Noise standard deviation / clipping norm.")
_TARGET_EPSILON = flags.DEFINE_float(
    "target_epsilon", None, "Privacy budget to calibrate for.")
_DELTA = flags.DEFINE_float(
    "delta", None, "Delta of the guarantee; default 1 / num_examples ** 1.1.")
_SAMPLING = flags.DEFINE_enum(
    "sampling", "poisson", list(accounting.SAMPLINGS), "How batches are drawn.")
_MODEL = flags.DEFINE_string("model", None, "A saved private model (.keras), for spent.")
_ACCOUNTANT = flags.DEFINE_enum(
    "accountant", "rdp", list(accounting.ACCOUNTANTS),
    "Accountant for calibrate and for the printed statement.")


def _require(*flag_holders):
    for holder in flag_holders:
        if holder.value is None:
            raise ValueError(f"--{holder.name} is required.")


def _delta():
    """The --delta value, or the default for --num_examples."""
    if _DELTA.value is None:
        return accounting.default_delta(_NUM_EXAMPLES.value)
    accounting.check_delta(_DELTA.value, _NUM_EXAMPLES.value)
    return _DELTA.value


def _epsilon_command():
    _require(_NUM_EXAMPLES, _BATCH_SIZE, _NOISE_MULTIPLIER)
    delta = _delta()
    epsilons = {
        name: accounting.compute_epsilon(
            _NUM_EXAMPLES.value, _BATCH_SIZE.value, _NOISE_MULTIPLIER.value,
            delta, epochs=_EPOCHS.value, steps=_STEPS.value, accountant=name,
            sampling=_SAMPLING.value)
        for name in accounting.ACCOUNTANTS
    }
    print(f"delta: {delta:.4g}")
    for name, epsilon in epsilons.items():
        print(f"{name.upper()} epsilon: {epsilon:.4f}")
    print()
    print(accounting.privacy_statement(epsilons[_ACCOUNTANT.value], delta,
                                       _ACCOUNTANT.value, _SAMPLING.value))


def _calibrate_command():
    _require(_TARGET_EPSILON, _NUM_EXAMPLES, _BATCH_SIZE)
    if (_EPOCHS.value is None) == (_STEPS.value is None):
        raise ValueError("give exactly one of --epochs and --steps.")
    delta = _delta()
    noise_multiplier = accounting.calibrate_noise_multiplier(
        _TARGET_EPSILON.value, _NUM_EXAMPLES.value, _BATCH_SIZE.value,
        _EPOCHS.value, delta, accountant=_ACCOUNTANT.value,
        sampling=_SAMPLING.value, steps=_STEPS.value)
    epsilon = accounting.compute_epsilon(
        _NUM_EXAMPLES.value, _BATCH_SIZE.value, noise_multiplier, delta,
        epochs=_EPOCHS.value, steps=_STEPS.value, accountant=_ACCOUNTANT.value,
        sampling=_SAMPLING.value)
    print(f"noise_multiplier: {noise_multiplier:.4f}")
    print(f"{_ACCOUNTANT.value.upper()} epsilon: {epsilon:.4f} "
          f"(target {_TARGET_EPSILON.value:g}, delta {delta:.4g})")


def _spent_command():
    _require(_MODEL)
    import keras  # Only this command needs Keras and TensorFlow.

    import keras_dp  # noqa: F401  (registers the private model classes)

    model = keras.models.load_model(_MODEL.value, compile=False)
    if not hasattr(model, "privacy_spent"):
        raise ValueError(f"{_MODEL.value} is not a keras-dp private model; it has "
                         "no privacy ledger.")
    for segment in model.privacy_ledger.segments():
        print(segment)
    epsilon, _ = model.privacy_spent(_DELTA.value, _ACCOUNTANT.value)
    print(f"private steps: {model.privacy_steps}")
    print(f"{_ACCOUNTANT.value.upper()} epsilon: {epsilon:.4f}"
          + (f" (delta {_DELTA.value:.4g})" if _DELTA.value else " (default delta)"))


_COMMANDS = {"epsilon": _epsilon_command, "calibrate": _calibrate_command,
             "spent": _spent_command}


def _run(argv):
    """Runs the command named in `argv`; returns the process exit code."""
    try:
        if len(argv) != 2 or argv[1] not in _COMMANDS:
            raise ValueError(
                f"give one command, {' or '.join(_COMMANDS)}; got "
                f"{' '.join(argv[1:]) or 'none'}. Run with --help for usage.")
        _COMMANDS[argv[1]]()
    except ValueError as error:
        # Bad input is the user's to fix: say what and how, no traceback.
        print(f"keras-dp: error: {error}", file=sys.stderr)
        return 2
    return 0


def main():
    """Entry point of the `keras-dp` console script."""
    app.run(_run)


if __name__ == "__main__":
    main()
