"""The privacy budget of a private model: what its ledger spent, and what is left.

Every rule that turns a privacy ledger into a guarantee lives here: the
epsilon of its segments (composed by `dp_accounting`), the delta it is
stated at (given, or the default for the number of examples, and never
used up by the truncation of padded batches), and, against a
`target_epsilon`, how many more steps fit. `PrivacyBudget` asks these of
one model; `privacy_spent`, `PrivacyCallback`, fit's step guard,
`train_on_batch` and the command line all ask it, so each rule has one
home.
"""

import dataclasses
import functools
import math
import warnings

import dp_accounting

from keras_dp import accounting
from keras_dp import ledger
from keras_dp import noise


class PrivacyBudget:
    """The (epsilon, delta) a private model has spent, and the steps a target allows.

    The budget reads the model's privacy ledger at every question (it
    grows with every step, whichever fit, loop or `train_on_batch` ran it),
    and asks the model's `step_mechanism` what the next steps would record:
    a callback may change the noise or sampling at any time.

    The delta is fixed when the budget is made: `delta` if given (checked
    below 1 / N), else `keras_dp.accounting.default_delta(N)`, for N the
    largest number of examples (or users) the ledger and `upcoming` record,
    or else `num_examples`.

    Args:
        model: a keras-dp private model (`privacy_ledger`, `step_mechanism`).
        delta: the total delta of the guarantee, or None for the default.
            The truncation deltas of padded Poisson batches are taken from
            it (`delta_left`).
        num_examples: the number of training examples, for the default
            delta when the ledger does not record it.
        target_epsilon: the epsilon not to exceed, or None for no limit.
        accountant: `"rdp"` or `"pld"`.
        upcoming: the `keras_dp.ledger.Segment` of the steps about to run
            (a fit's, before its first step is recorded), whose number of
            examples the default delta counts too.

    Raises:
        ValueError: on invalid settings (`check_settings`), or when no
            delta is given and the number of examples is unknown
            (`resolve_delta`).

    Example:
    ```python
    budget = keras_dp.budget.PrivacyBudget(private, delta=1e-5, target_epsilon=3.0)
    epsilon, event = budget.spent()
    budget.next_steps_exceed(100)  # Would 100 more steps exceed epsilon 3?
    ```
    """

    def __init__(self, model, delta=None, num_examples=None, target_epsilon=None,
                 accountant="rdp", upcoming=None):
        check_settings(delta, num_examples, target_epsilon, accountant)
        self._model = model
        self.target_epsilon = target_epsilon
        self.accountant = accountant
        segments = self._segments() + ([upcoming] if upcoming is not None else [])
        self.delta = resolve_delta(delta, _examples_of(segments, num_examples))
        # Set by a look-ahead check, good for the next question only.
        self._next_execution_fits = False

    def spent(self):
        """The privacy spent so far: `(epsilon, event)`, as `epsilon` gives it;
        warns when it is infinite although every step was noised."""
        self._next_execution_fits = False
        segments = self._segments()
        spent = epsilon(segments, self.delta, self.accountant)
        reason = infinite_because(segments, self.delta)
        if math.isinf(spent[0]) and reason and not _unnoised(segments):
            warnings.warn(f"epsilon is infinite: {reason}", stacklevel=3)
        return spent

    def check_fit(self, epochs, steps_per_epoch=None):
        """Refuses, before a fit runs, a fit that would surely break the budget.

        Args:
            epochs: the fit's epochs.
            steps_per_epoch: private steps in one epoch, or None if unknown
                (then the first execution stands for the first epoch).

        Raises:
            ValueError: the truncation deltas of the fit's steps use up
                delta, or its first epoch would exceed `target_epsilon`.
        """
        self._next_execution_fits = False
        upcoming = self._model.step_mechanism.next_segment()
        delta_left(self._after(upcoming, epochs * (steps_per_epoch or 1)), self.delta)
        steps = steps_per_epoch or self.steps_per_execution()
        if self.next_steps_exceed(steps, new_pass=True):
            reached = self._epsilon(self._after(upcoming, steps))
            raise ValueError(
                f"target_epsilon={self.target_epsilon} would be exceeded by the "
                f"first epoch: epsilon would reach {reached:.4g}. Increase the "
                f"noise_multiplier (see keras_dp.calibrate_noise_multiplier), "
                f"reduce the batch_size, or raise target_epsilon.")

    def check_next_steps(self, steps=None, look_ahead=False, stepping=None, row=None):
        """Refuses the next steps if they could exceed `target_epsilon`.

        Fit's step guard asks before every execution, after every other
        callback's `on_train_batch_begin` (Keras runs an execution whatever
        stop_training says); `train_on_batch` asks for its one step.

        Args:
            steps: the private steps about to run; default: an execution's
                (`steps_per_execution`).
            look_ahead: True when nothing but the execution runs between
                this call and the next question (fit puts PrivacyCallback's
                batch hooks first). The check then also asks whether a
                second execution would fit; if it does,
                `next_execution_exceeds` answers without reading the
                ledger (the execution in between took at most an
                execution's steps of the mechanism checked).
            stepping: the private model whose steps these are, if not this
                budget's (another private model of the same variables, whose
                mechanism, a train_on_batch's full release, is not the
                fit's: review round 123, 8.09 against a target of 6.0).
            row: the table row the steps will record, as the caller permits
                them (`keras_dp.ledger.table.PrivacyLedger.permit`); default:
                the stepping model's next row, read now. Checking and
                permitting one row read once leaves a setting changed in
                between (by another thread) to the step, which refuses a row
                it was not permitted.

        Raises:
            RuntimeError: before the steps run; no weight or ledger changes.
        """
        self._next_execution_fits = False
        if self.target_epsilon is None:
            return
        execution = steps or self.steps_per_execution()
        counts = [execution, 2 * execution] if look_ahead and steps is None else [execution]
        exceeds = self._exceed(counts, stepping=stepping, row=row)
        if exceeds[0]:
            raise RuntimeError(
                f"target_epsilon={self.target_epsilon} would be exceeded by the next "
                "steps: a callback changed the noise multiplier or sampling after "
                "PrivacyCallback's last check, and Keras runs the next "
                "steps_per_execution batches whatever stop_training says. Training "
                "stopped before them; change such settings between fit() calls, or "
                "raise target_epsilon.")
        self._next_execution_fits = len(exceeds) > 1 and not exceeds[1]

    def next_execution_exceeds(self):
        """Whether the next execution could exceed `target_epsilon` (answered
        from the last look-ahead check when it could tell)."""
        fits, self._next_execution_fits = self._next_execution_fits, False
        return not fits and self.next_steps_exceed()  # Nothing read without a target.

    def next_steps_exceed(self, steps=None, new_pass=False):
        """Whether `steps` more steps of the next mechanism could exceed
        `target_epsilon` (never without a target).

        Args:
            steps: a number of private steps; default (or None, an epoch of
                unknown length): an execution's.
            new_pass: whether the steps open a new pass over the data (fit
                starts one each epoch); else they continue the open pass.

        Returns:
            A bool.
        """
        self._next_execution_fits = False
        if self.target_epsilon is None:
            return False
        return self._exceed([steps or self.steps_per_execution()], new_pass)[0]

    def allowance(self):
        """How many more Poisson-sampled steps of the next mechanism stay
        within `target_epsilon`: the largest count k whose epsilon is at
        most the target (k + 1 exceeds it).

        Returns:
            An int >= 0; `math.inf` without a target; None when the next steps
            are not each a release (their epsilon grows by passes, not
            steps: `next_steps_exceed` composes the counts asked).
        """
        self._next_execution_fits = False
        if self.target_epsilon is None:
            return math.inf
        segment = self._model.step_mechanism.next_segment()
        if not segment.scheme.releases_every_step:
            return None
        return self._per_step_allowance(segment, self._segments())

    def steps_per_execution(self):
        """Private (logical) steps Keras runs between two batch callbacks."""
        return steps_per_execution(self._model)

    def _exceed(self, counts, new_pass=False, stepping=None, row=None):
        """For each count of private steps, whether that many more steps
        could exceed the target (the ledger is read once for all); with
        `new_pass`, they start a pass over the data. `stepping`: the model
        taking them (default: this budget's); `row`: what they record
        (default: its next row)."""
        mechanism = (stepping or self._model).step_mechanism
        segment = mechanism.next_segment() if row is None else ledger.segment_of_row(row)
        segments = self._segments()
        if segment.scheme.releases_every_step:
            allowance = self._per_step_allowance(segment, segments)
            return [allowance < steps for steps in counts]
        left = 0.0  # An execution stays within its epoch, and so in its pass.
        if not new_pass and segments and segments[-1].same_mechanism(segment):
            left = self._model.privacy_ledger.steps_left_in_open_pass()
        return [self._epsilon(self._after(segment, steps, left, segments)) > self.target_epsilon
                for steps in counts]

    def _per_step_allowance(self, segment, segments):
        """How many more steps of `segment`'s mechanism, each a release
        (Poisson or unknown batches), stay in budget after `segments`."""
        done = 0
        if segments and segments[-1].same_mechanism(segment):
            done = segments[-1].steps
            segments = segments[:-1]
        return max(_max_steps(tuple(segments), segment, self.delta, self.accountant,
                              self.target_epsilon) - done, 0)

    def _after(self, segment, steps, left_in_pass=0.0, segments=None):
        """The ledger (`segments`, default: read now) after `steps` more
        steps of `segment`'s mechanism."""
        segments = self._segments() if segments is None else segments
        return ledger.extended(segments, segment, steps,
                               ledger.releases_of(segment, steps, left_in_pass))

    def _epsilon(self, segments):
        return epsilon(segments, self.delta, self.accountant)[0]

    def _segments(self):
        return self._model.privacy_ledger.segments()


def check_settings(delta=None, num_examples=None, target_epsilon=None, accountant="rdp"):
    """Refuses invalid budget settings, before any model is known.

    Args:
        delta: None, or a delta to check below 1 / `num_examples` (when given).
        num_examples: None, or an integer > 0.
        target_epsilon: None, or a finite number > 0.
        accountant: `"rdp"` or `"pld"`.

    Raises:
        ValueError: naming the setting that is invalid.
    """
    accounting.check_choice("accountant", accountant, accounting.ACCOUNTANTS)
    if num_examples is not None:
        accounting.check_positive_int("num_examples", num_examples)
    if delta is not None and num_examples is not None:
        accounting.check_delta(delta, num_examples)
    if target_epsilon is not None:
        accounting.check_target_epsilon(target_epsilon)


def resolve_delta(delta, num_examples):
    """The delta of a guarantee over `num_examples` examples (or users).

    Args:
        delta: the stated delta, or None for
            `keras_dp.accounting.default_delta(num_examples)`.
        num_examples: N, or None (0) when unknown; a stated delta is then
            taken as it is (below 1 / N is the user's to check).

    Returns:
        The delta: `delta`, checked to be below 1 / N, or the default.

    Raises:
        ValueError: when `delta` is not in (0, 1 / N), or is None while N is
            unknown.
    """
    if not num_examples and delta is None:
        raise ValueError(
            "The number of training examples is unknown (the privacy ledger records "
            "it for data drawn by keras_dp.data.poisson_dataset or from arrays), so "
            "there is no default delta: pass delta=..., below 1 / num_examples, or "
            "PrivacyCallback(num_examples=...).")
    if not num_examples:
        return delta
    if delta is None:
        return accounting.default_delta(num_examples)
    accounting.check_delta(delta, num_examples)
    return delta


def _examples_of(segments, stated=None):
    """The number of examples the guarantee is over: the largest that
    `segments` record, else the `stated` one; the recorded number wins
    over a different stated one (with a warning)."""
    recorded = max([s.num_examples for s in segments], default=0)
    if stated and recorded and stated != recorded:
        warnings.warn(
            f"PrivacyCallback(num_examples={stated}) differs from the {recorded} "
            f"examples the model trains on; accounting uses {recorded}.", stacklevel=4)
    return recorded or stated


@functools.lru_cache(maxsize=64)
def _max_steps(segments, segment, delta, accountant, target):
    """The most steps of `segment` after `segments` (a tuple) within `target`
    (a search of a few compositions, asked again after every execution)."""
    def epsilon_after(steps):
        grown = list(segments) + [dataclasses.replace(segment, steps=steps, releases=steps)]
        if steps and _extra_delta(grown) >= delta:
            return math.inf  # So many steps' truncation deltas use up delta.
        return epsilon(grown, delta, accountant)[0]

    return max_steps_within(epsilon_after, target)


def epsilon_key(unit):
    """The name epsilon is reported under for a ledger of `unit`: `"epsilon"`
    for examples, `"user_epsilon"` for users (History, progress bar,
    TensorBoard), so a user-level guarantee is never read as another."""
    return "user_epsilon" if unit == "user" else "epsilon"


def epsilon(segments, delta, accountant="rdp"):
    """Epsilon of a sequence of segments, composed with `dp_accounting`.

    Args:
        segments: list of `keras_dp.ledger.Segment`.
        delta: the total delta; the segments' per-step deltas
            (`step_delta() * steps`) are taken from it first.
        accountant: `"rdp"` or `"pld"`.

    Returns:
        `(epsilon, event)`: a float (0.0 without steps, inf when a step had
        no noise, or so little that the noise sampler's tail cap uses up
        delta) and the `dp_accounting.ComposedDpEvent`.

    Raises:
        ValueError: when the truncation deltas use up `delta`, the
            segments mix example-level and user-level steps
            (`keras_dp.ledger.unit_of`), or a segment's scheme cannot be
            composed by `accountant`.
    """
    accounting.check_choice("accountant", accountant, accounting.ACCOUNTANTS)
    segments = [s for s in segments if s.steps]
    ledger.unit_of(segments)
    for segment in segments:
        segment.accountant_refusal(accountant)
    event = dp_accounting.ComposedDpEvent(tuple(s.dp_event() for s in segments))
    delta_left(segments, delta)
    if not segments:
        return 0.0, event
    left = delta - sum(s.step_delta() * s.steps for s in segments)
    if any(s.noise_multiplier == 0 for s in segments) or left <= 0:
        return math.inf, event
    return accounting.epsilon_of_event(event, left, accountant), event


def infinite_because(segments, delta):
    """Why `epsilon(segments, delta)` is infinite, in words (None when no
    step made it so): a step without noise, or noise so small that the
    sampler's tail cap uses up delta."""
    segments = [s for s in segments if s.steps]
    if _unnoised(segments):
        return "a step added no noise (noise_multiplier 0)."
    capped = sum((s.step_delta() - s.extra_delta) * s.steps for s in segments)
    if not segments or delta - sum(s.step_delta() * s.steps for s in segments) > 0:
        return None
    sigma = min(s.noise_multiplier / s.sensitivity for s in segments)
    return (f"no noise value beyond {noise.MAX_NOISE_STDDEVS:.2f} sigma C is drawn, and "
            f"the chance that this cap shows an example ({capped:.3g} over the steps, "
            f"growing as e^({noise.MAX_NOISE_STDDEVS:.2f} / sigma) for the smallest noise "
            f"multiplier per C of sensitivity, {sigma:g}) uses up delta={delta:.3g}. Train "
            "with a larger noise_multiplier, or state a larger delta.")


def _unnoised(segments):
    return any(s.steps and s.noise_multiplier == 0 for s in segments)


def delta_left(segments, delta):
    """The delta left once the extra deltas of the segments are paid: the
    truncation probability of padded Poisson batches, and the thresholds of
    vocabularies `keras_dp.adapt` released.

    Raises:
        ValueError: when they use up `delta` (fix: a larger delta, or a
            larger max_batch_size).
    """
    extra = _extra_delta(segments)
    if extra >= delta:
        raise ValueError(
            f"delta={delta:.3g} is used up by the extra deltas of what ran ({extra:.3g}: "
            "the truncation probability of padded Poisson batches, extra_delta per step, "
            "and the threshold of each vocabulary keras_dp.adapt released). Use a larger "
            "delta, or a larger max_batch_size for the batches.")
    return float(delta - extra)


def _extra_delta(segments):
    return sum(s.extra_delta * s.steps for s in segments)


def max_steps_within(epsilon_after, target):
    """The most steps k with `epsilon_after(k) <= target`, for an epsilon that
    grows with k (a budget's allowance).

    The answer is a bisection's: the search ends on a k that fits next to a
    k + 1 that does not. It only probes less, each probe being a composition
    in dp_accounting: RDP epsilon is a minimum of functions affine in k, so
    concave, and the line through the last two fitting probes meets the
    target no later than the curve. Its crossing is probed next (at most 4
    times the last k that fits); once a k exceeds the target, the bracket is
    narrowed by interpolation, halved after any probe that halved it less.

    Args:
        epsilon_after: `k -> epsilon` after k more steps, nondecreasing.
        target: the epsilon not to exceed.

    Returns:
        The largest such k (0 when `epsilon_after(0)` already exceeds `target`).
    """
    low, eps_low = 0, epsilon_after(0)
    if eps_low > target:
        return 0
    previous_fit, high, eps_high = (low, eps_low), None, None
    steps, halved = 1, False
    while True:
        eps, width = epsilon_after(steps), None if high is None else high - low
        if eps <= target:
            previous_fit, (low, eps_low) = (low, eps_low), (steps, eps)
        else:
            high, eps_high = steps, eps
        if high is None:
            k0, eps0 = previous_fit
            line = (low + (target - eps_low) * (low - k0) / (eps_low - eps0)
                    if eps_low > eps0 else 2 * low)
            steps = max(low + 1, min(math.floor(line) + 1, 4 * low))
            continue
        if high - low <= 1:
            return low
        halved = ((width is not None and 2 * (high - low) > width and not halved)
                  or not math.isfinite(eps_high))  # No line to an infinite epsilon.
        if halved:
            steps = (low + high) // 2
        else:
            guess = low + (target - eps_low) * (high - low) / (eps_high - eps_low)
            steps = min(high - 1, max(low + 1, round(guess)))


def steps_per_execution(model):
    """The most private (logical) steps the private `model` records between
    two of Keras' batch callbacks: its executions' batches, over the
    physical batches of one logical step, rounded up (a logical step may
    open in one execution and record in the next)."""
    steps = max(getattr(model, "steps_per_execution", 1),
                getattr(model, "train_steps_per_execution", 1))
    return math.ceil(steps / model.optimizer.dp_settings.accumulation_steps)
