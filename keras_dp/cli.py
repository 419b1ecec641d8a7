"""keras-dp: DP-SGD privacy accounting from the command line.

  keras-dp epsilon --num_examples 60000 --batch_size 256 --epochs 60 \\
      --noise_multiplier 1.1
  keras-dp epsilon --num_users 5000 --batch_size 100 --epochs 30 \\
      --noise_multiplier 1.0
  keras-dp calibrate --target_epsilon 3 --num_examples 60000 --batch_size 256 \\
      --epochs 60
  keras-dp plan --target_epsilon 3 --num_examples 2000 --num_weights 2757761 \\
      --batch_size 32 --epochs 2
  keras-dp spent --model model.keras
  keras-dp audit --noise_multiplier 1.0

`keras-dp --help` (or -h, or `keras-dp help`) lists the commands with their
flags, `keras-dp COMMAND --help` one command's. Printed epsilons, deltas and
noise multipliers are rounded up, the audit's empirical lower bound down.
"""

import dataclasses
import sys
import textwrap
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from absl import flags

from keras_dp import accounting
from keras_dp import budget
from keras_dp import sampling_schemes

_NUM_EXAMPLES = flags.DEFINE_integer(
    "num_examples", None, "Number of training examples.")
_NUM_USERS = flags.DEFINE_integer(
    "num_users", None, "Number of users, for user-level privacy (instead of "
    "--num_examples; --batch_size then counts users).")
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", None, "Expected (Poisson) or fixed (shuffle) batch size.")
_EPOCHS = flags.DEFINE_float(
    "epochs", None, "Passes over the data, each of ceil(num_examples / batch_size) "
    "steps as fit runs them.")
_STEPS = flags.DEFINE_integer("steps", None, "Private steps, instead of --epochs.")
_NOISE_MULTIPLIER = flags.DEFINE_float(
    "noise_multiplier", None, "Noise standard deviation / clipping norm.")
_TARGET_EPSILON = flags.DEFINE_float(
    "target_epsilon", None, "Privacy budget to calibrate for.")
_DELTA = flags.DEFINE_float(
    "delta", None, "Delta of the guarantee, below 1 / num_examples (or num_users); "
    "default 1 / num_examples ** 1.1.")
_SAMPLING = flags.DEFINE_enum(
    "sampling", "poisson", list(accounting.SAMPLINGS), "How batches are drawn.")
_BANDS = flags.DEFINE_integer(
    "bands", 1, "Bands b of keras_dp.BandedMF correlated noise (cyclic Poisson sampling "
    "of b groups); 1 is DP-SGD.")
_MODEL = flags.DEFINE_string("model", None, "A saved private model (.keras).")
_NUM_WEIGHTS = flags.DEFINE_integer(
    "num_weights", None, "Trainable weights d of the model to plan for.")
_MAX_EPOCHS = flags.DEFINE_float(
    "max_epochs", None, "Compute the plan may use, in passes over the data; default 10 "
    "times --epochs.")
_L2_NORM_CLIP = flags.DEFINE_float(
    "l2_norm_clip", 1.0, "Clipping norm C of the audited training.")
_NUM_CANARIES = flags.DEFINE_integer("num_canaries", 1000, "Canaries m.")
_CANARY_KIND = flags.DEFINE_enum(
    "canary_kind", "gradient", ["gradient", "mislabeled", "input"],
    "White-box gradient canaries, or black-box mislabeled / random-input ones.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of data, canaries, weights, noise.")
_ACCOUNTANT = flags.DEFINE_enum(
    "accountant", "rdp", list(accounting.ACCOUNTANTS),
    "Renyi DP, or privacy loss distributions (tighter, slower).")

# Words that ask for usage instead of running a command.
_HELP_FLAGS = ("--help", "-h", "--helpshort")
_HELP_COMMAND = "help"


@dataclasses.dataclass(frozen=True)
class _Command:
    """A command: what it prints, its flags, and the function that runs it.

    Attributes:
        run: runs the command from the parsed flags.
        summary: one sentence for the usage.
        required: flags it cannot run without.
        optional: its other flags.
        defaults: {flag name: value} used when a flag without an absl default
            is not given.
    """

    run: Callable[[], None]
    summary: str
    required: tuple = ()
    optional: tuple = ()
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def value(self, holder):
        """The flag's value, or this command's default for it."""
        return self.defaults.get(holder.name) if holder.value is None else holder.value


def _require(command):
    for holder in command.required:
        if holder.value is None:
            raise ValueError(f"--{holder.name} is required.")


def _require_epochs_or_steps():
    if (_EPOCHS.value is None) == (_STEPS.value is None):
        given = "neither" if _EPOCHS.value is None else "both"
        raise ValueError(f"Give exactly one of --epochs and --steps, got {given}.")


def _units():
    """`(number of units, unit)`: --num_examples, or --num_users (user-level
    privacy: Poisson sampling over users)."""
    if (_NUM_EXAMPLES.value is None) == (_NUM_USERS.value is None):
        given = "neither" if _NUM_USERS.value is None else "both"
        raise ValueError("Give exactly one of --num_examples and --num_users "
                         f"(user-level privacy), got {given}.")
    if _NUM_USERS.value is None:
        return _NUM_EXAMPLES.value, "example"
    if sampling_schemes.scheme_type(_SAMPLING.value) is not sampling_schemes.PoissonSampling:
        raise ValueError("--num_users accounts Poisson sampling over users; drop "
                         f"--sampling={_SAMPLING.value}.")
    return _NUM_USERS.value, "user"


def _epsilon_line(epsilon, accountant, unit="example"):
    level = "user-level " if unit == "user" else ""
    return f"{accountant.upper()} {level}epsilon: {accounting.format_upper(epsilon, 4)}"


def _epsilon_command():
    _require_epochs_or_steps()
    num_units, unit = _units()
    delta = budget.resolve_delta(_DELTA.value, num_units)
    epsilons = {
        name: accounting.compute_epsilon(
            num_units, _BATCH_SIZE.value, _NOISE_MULTIPLIER.value,
            delta, epochs=_EPOCHS.value, steps=_STEPS.value, accountant=name,
            sampling=_SAMPLING.value, bands=_BANDS.value)
        for name in accounting.ACCOUNTANTS
    }
    print(f"delta: {accounting.format_upper(delta, 4, 'g')}")
    for name, epsilon in epsilons.items():
        print(_epsilon_line(epsilon, name, unit))
    print()
    print(accounting.privacy_statement(epsilons[_ACCOUNTANT.value], delta,
                                       _ACCOUNTANT.value, _SAMPLING.value, unit))


def _calibrate_command():
    _require_epochs_or_steps()
    num_units, unit = _units()
    delta = budget.resolve_delta(_DELTA.value, num_units)
    noise_multiplier = accounting.calibrate_noise_multiplier(
        _TARGET_EPSILON.value, num_units, _BATCH_SIZE.value,
        _EPOCHS.value, delta, accountant=_ACCOUNTANT.value,
        sampling=_SAMPLING.value, steps=_STEPS.value, bands=_BANDS.value)
    epsilon = accounting.compute_epsilon(
        num_units, _BATCH_SIZE.value, noise_multiplier, delta,
        epochs=_EPOCHS.value, steps=_STEPS.value, accountant=_ACCOUNTANT.value,
        sampling=_SAMPLING.value, bands=_BANDS.value)
    # Rounded up: more noise than calibrated only lowers the epsilon.
    print(f"noise_multiplier: {accounting.format_upper(noise_multiplier, 4)}")
    print(f"{_epsilon_line(epsilon, _ACCOUNTANT.value, unit)} (target "
          f"{_TARGET_EPSILON.value:g}, delta {accounting.format_upper(delta, 4, 'g')})")


def _plan_command():
    from keras_dp import planning  # Imports Keras and TensorFlow: only this command.

    num_units, unit = _units()
    print(planning.plan(num_examples=num_units, target_epsilon=_TARGET_EPSILON.value,
                        delta=_DELTA.value, batch_size=_BATCH_SIZE.value,
                        epochs=_EPOCHS.value, steps=_STEPS.value,
                        max_epochs=_MAX_EPOCHS.value, num_weights=_NUM_WEIGHTS.value,
                        unit=unit, accountant=_ACCOUNTANT.value))


def _spent_command():
    import keras  # Only this command needs Keras and TensorFlow.

    model = keras.models.load_model(_MODEL.value, compile=False)
    if not hasattr(model, "privacy_report"):
        raise ValueError(f"{_MODEL.value} is not a keras-dp private model; it has "
                         "no privacy ledger.")
    print(model.privacy_report(_DELTA.value, _ACCOUNTANT.value))


def _audit_command():
    from keras_dp import audit  # Imports scipy.stats: only for this command.

    command = _COMMANDS["audit"]
    epochs = command.value(_EPOCHS)
    if epochs != int(epochs) or epochs < 1:
        raise ValueError(f"--epochs must be a whole number >= 1 for audit; got {epochs:g}.")
    result = audit.audit_builtin_task(
        noise_multiplier=command.value(_NOISE_MULTIPLIER), l2_norm_clip=_L2_NORM_CLIP.value,
        epochs=int(epochs), num_canaries=_NUM_CANARIES.value, canary_kind=_CANARY_KIND.value,
        num_examples=command.value(_NUM_EXAMPLES), batch_size=command.value(_BATCH_SIZE),
        seed=_SEED.value)
    one_run, membership = result.one_run, result.membership
    print(f"trained on {result.num_examples} examples ({int(result.included.sum())} "
          f"of {one_run.num_canaries} {_CANARY_KIND.value} canaries), delta "
          f"{accounting.format_upper(result.delta, 3, 'g')}")
    print(f"best guesses: {one_run.num_correct} of {one_run.num_guessed_in} in + "
          f"{one_run.num_guessed_out} out correct ({one_run.num_candidates} "
          "candidates, Bonferroni)")
    print(f"loss-threshold membership inference: AUC {membership.auc:.3f}, "
          f"TPR {membership.tpr_at_fpr[0.01]:.3f} at 1% FPR")
    # Rounded outwards: the claim (an upper bound) up, the lower bound down.
    claimed = accounting.format_upper(result.claimed_epsilon, 2)
    bound = accounting.format_lower(result.epsilon_lower_bound, 2)
    print(f"claimed epsilon {claimed}, empirical epsilon lower bound {bound} "
          "(95% confidence)")


_COMMANDS = {
    "epsilon": _Command(
        _epsilon_command,
        "Prints the RDP and PLD epsilons of a training run and what they guarantee. "
        "Give exactly one of --num_examples and --num_users (privacy per user), and of "
        "--epochs and --steps.",
        required=(_BATCH_SIZE, _NOISE_MULTIPLIER),
        optional=(_NUM_EXAMPLES, _NUM_USERS, _EPOCHS, _STEPS, _DELTA, _SAMPLING,
                  _ACCOUNTANT, _BANDS)),
    "calibrate": _Command(
        _calibrate_command,
        "Prints the smallest noise multiplier that meets the target epsilon for the "
        "steps fit(epochs=...) runs, or exactly --steps private steps. Give exactly "
        "one of --num_examples and --num_users (privacy per user), and of --epochs and "
        "--steps.",
        required=(_TARGET_EPSILON, _BATCH_SIZE),
        optional=(_NUM_EXAMPLES, _NUM_USERS, _EPOCHS, _STEPS, _DELTA, _ACCOUNTANT,
                  _SAMPLING, _BANDS)),
    "plan": _Command(
        _plan_command,
        "Prints the batch size, epochs and noise multiplier that lower the noise on the "
        "averaged gradient at the target epsilon (keras_dp.plan), keeping the private "
        "steps of --batch_size and --epochs (or --steps). Give exactly one of "
        "--num_examples and --num_users.",
        required=(_TARGET_EPSILON, _NUM_WEIGHTS),
        optional=(_NUM_EXAMPLES, _NUM_USERS, _BATCH_SIZE, _EPOCHS, _STEPS, _MAX_EPOCHS,
                  _DELTA, _ACCOUNTANT)),
    "spent": _Command(
        _spent_command,
        "Prints the privacy report of a saved private model (model.privacy_report): "
        "epsilon, every run of steps with its mechanism, and what the guarantee covers.",
        required=(_MODEL,), optional=(_DELTA, _ACCOUNTANT)),
    "audit": _Command(
        _audit_command,
        "Trains a small private model on a built-in task (Fashion-MNIST when "
        "installed, generated data otherwise) with canaries, and prints the claimed "
        "epsilon and an empirical lower bound on it (keras_dp.audit).",
        optional=(_NOISE_MULTIPLIER, _L2_NORM_CLIP, _EPOCHS, _NUM_CANARIES,
                  _CANARY_KIND, _NUM_EXAMPLES, _BATCH_SIZE, _SEED),
        defaults={"noise_multiplier": 1.0, "epochs": 5, "num_examples": 10000,
                  "batch_size": 500}),
}


def _usage(names):
    """The usage of the commands `names`: each one's summary and flags."""
    lines = ["Usage: keras-dp COMMAND --flag=value ...; keras-dp COMMAND --help for "
             "one command.", ""]
    for name in names:
        command = _COMMANDS[name]
        lines += textwrap.wrap(f"keras-dp {name}: {command.summary}", 80,
                               subsequent_indent="  ")
        for holder in command.required + command.optional:
            lines += textwrap.wrap(f"--{holder.name}: {_flag_help(command, holder)}", 80,
                                   initial_indent="  ", subsequent_indent="      ")
        lines.append("")
    return "\n".join(lines)


def _flag_help(command, holder):
    """A flag's help, with "(required)" or its default for `command`."""
    flag = flags.FLAGS[holder.name]
    if any(holder is required for required in command.required):  # Holders refuse ==.
        return f"{flag.help} (required)"
    default = command.defaults.get(holder.name, flag.default)
    return flag.help if default is None else f"{flag.help} (default {default})"


def _parse_flags(argv):
    """Parses `argv`'s flags; prints usage (exit 0) or a flag error (exit 2) instead.

    Args:
        argv: the command line, program name first.

    Returns:
        The arguments that are not flags, program name first.
    """
    words = argv[1:]
    if words[:1] == [_HELP_COMMAND] or any(word in _HELP_FLAGS for word in words):
        named = [word for word in words if word in _COMMANDS]
        print(_usage(named or _COMMANDS))
        sys.exit(0)
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        _print_error(f"{error}. Run keras-dp --help for the flags of each command.")
        sys.exit(2)


def _print_error(message):
    print(f"keras-dp: error: {message}", file=sys.stderr)


def _run(argv):
    """Runs the command named in `argv`; returns the process exit code."""
    try:
        if len(argv) != 2 or argv[1] not in _COMMANDS:
            raise ValueError(
                f"Give one command, {' or '.join(_COMMANDS)}; got "
                f"{' '.join(argv[1:]) or 'none'}. Run keras-dp --help for usage.")
        command = _COMMANDS[argv[1]]
        _require(command)
        command.run()
    except ValueError as error:
        # Bad input is the user's to fix: say what and how, no traceback.
        _print_error(error)
        return 2
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `keras-dp` console script: runs one command and exits.

    absl's app.run is not used: it would run TensorFlow's start-up hook, whose
    GPU probe prints a CUDA error on machines without one, for commands that
    need no TensorFlow at all.

    Args:
        argv: the command line, program name first; default `sys.argv`.
    """
    sys.exit(_run(_parse_flags(sys.argv if argv is None else argv)))


if __name__ == "__main__":
    main()
