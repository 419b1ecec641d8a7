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

  keras-dp audit [--noise_multiplier 1.0] [--l2_norm_clip 1.0] [--epochs 5] \\
      [--num_canaries 1000] [--canary_kind gradient|mislabeled|input] [--seed 0]
    Trains a small private model on a built-in task (Fashion-MNIST when
    installed, generated data otherwise) with canaries, and prints the
    claimed epsilon and an empirical lower bound on it (keras_dp.audit).

--epochs are fit's: ceil(num_examples / batch_size) steps each.
--delta defaults to 1 / num_examples ** 1.1 and must be below 1 / num_examples.
"""

import math
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
_L2_NORM_CLIP = flags.DEFINE_float(
    "l2_norm_clip", 1.0, "audit: clipping norm C of the audited training.")
_NUM_CANARIES = flags.DEFINE_integer("num_canaries", 1000, "audit: canaries m.")
_CANARY_KIND = flags.DEFINE_enum(
    "canary_kind", "gradient", ["gradient", "mislabeled", "input"],
    "audit: white-box gradient canaries, or black-box mislabeled / random-input ones.")
_SEED = flags.DEFINE_integer("seed", 0, "audit: seed of data, canaries, weights, noise.")
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


def _audit_command():
    from keras_dp import audit  # Imports TensorFlow: only for this command.

    epochs = 5 if _EPOCHS.value is None else _EPOCHS.value
    if epochs != int(epochs) or epochs < 1:
        raise ValueError(f"--epochs must be a whole number >= 1 for audit; got {epochs:g}.")
    noise = 1.0 if _NOISE_MULTIPLIER.value is None else _NOISE_MULTIPLIER.value
    result = audit.audit_builtin_task(
        noise_multiplier=noise, l2_norm_clip=_L2_NORM_CLIP.value, epochs=int(epochs),
        num_canaries=_NUM_CANARIES.value, canary_kind=_CANARY_KIND.value,
        num_examples=_NUM_EXAMPLES.value or 10000, batch_size=_BATCH_SIZE.value or 500,
        seed=_SEED.value)
    one_run, membership = result.one_run, result.membership
    print(f"trained on {result.num_examples} examples ({int(result.included.sum())} "
          f"of {one_run.num_canaries} {_CANARY_KIND.value} canaries), delta "
          f"{result.delta:.3g}")
    print(f"best guesses: {one_run.num_correct} of {one_run.num_guessed_in} in + "
          f"{one_run.num_guessed_out} out correct ({one_run.num_candidates} "
          "candidates, Bonferroni)")
    print(f"loss-threshold membership inference: AUC {membership.auc:.3f}, "
          f"TPR {membership.tpr_at_fpr[0.01]:.3f} at 1% FPR")
    # Rounded outwards: the claim (an upper bound) up, the lower bound down.
    claimed = _hundredths(result.claimed_epsilon, math.ceil)
    bound = _hundredths(result.epsilon_lower_bound, math.floor)
    print(f"claimed epsilon {claimed}, empirical epsilon lower bound {bound} "
          "(95% confidence)")


def _hundredths(value, rounding):
    return f"{value:.2f}" if math.isinf(value) else f"{rounding(value * 100) / 100:.2f}"


_COMMANDS = {"epsilon": _epsilon_command, "calibrate": _calibrate_command,
             "spent": _spent_command, "audit": _audit_command}


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
