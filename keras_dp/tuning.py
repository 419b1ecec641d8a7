"""Hyperparameter search whose privacy spending is accounted.

A search trains many models on the same private data and keeps the best:
each trial spends privacy, and the choice of the best reveals something of
all. Papernot & Steinke (ICLR 2022) bound a search that runs a RANDOM number
of trials, drawn from a truncated negative binomial of a given mean and
shape (`dp_accounting.RepeatAndSelectDpEvent`), and releases only the best
model: for 10 trials, well below the composition of 10 runs.

`RandomSearch` is Keras Tuner's random search with that number of trials.
It refuses a trial whose privacy settings differ from the first's, and the
best model it returns carries the search's spending in its privacy ledger
(`keras_dp.ledger.Selection`). Needs `pip install keras-dp[tuner]`.

What the validation data may be is in docs/privacy_accounting.md
("Hyperparameter search").
"""

import contextlib
import dataclasses
import math

import keras
import keras_tuner
import numpy as np
from scipy import optimize

from keras_dp import budget
from keras_dp import ledger
from keras_dp import optimizers
from keras_dp import preprocessing


class TrialCount:
    """The number of trials: a truncated negative binomial of `mean` and
    `shape` as `dp_accounting.RepeatAndSelectDpEvent` defines it.

    Shape 0 is the logarithmic distribution, 1 the geometric, inf the
    Poisson (which may draw 0 trials), and any other shape > 0 a negative
    binomial conditioned on at least one trial: P[K = k] is proportional
    to (1 - gamma)^k * Gamma(k + shape) / (k! Gamma(shape)), with gamma set
    by the mean.

    Args:
        mean: the mean number of trials, >= 1.
        shape: the shape, >= 0 (`math.inf` for Poisson).
    """

    def __init__(self, mean, shape):
        if not mean >= 1 or not shape >= 0:
            raise ValueError(f"mean_trials must be >= 1 and shape >= 0 (inf for Poisson); "
                             f"received mean_trials={mean!r}, shape={shape!r}.")
        self.mean, self.shape = float(mean), float(shape)
        self.gamma = None if math.isinf(shape) or mean == 1 else self._gamma()

    def sample(self, rng):
        """Draws a number of trials with the numpy Generator `rng`."""
        if math.isinf(self.shape):
            return int(rng.poisson(self.mean))
        if self.gamma is None:  # Mean 1: always one trial.
            return 1
        if self.shape == 0:
            return int(rng.logseries(1 - self.gamma))
        while True:  # Conditioned on at least one trial.
            trials = int(rng.negative_binomial(self.shape, self.gamma))
            if trials:
                return trials

    def mean_of(self, gamma):
        """The mean of the distribution of parameter `gamma` (0 < gamma < 1)."""
        if self.shape == 0:
            return (1 - gamma) / (gamma * -math.log(gamma))
        return self.shape * (1 - gamma) / (gamma * (1 - gamma ** self.shape))

    def _gamma(self):
        return optimize.brentq(lambda gamma: self.mean_of(gamma) - self.mean,
                               1e-12, 1 - 1e-12, xtol=1e-15, rtol=1e-13)


class RandomSearch(keras_tuner.Tuner):
    """Keras Tuner's random search, over a random number of trials whose
    spending is accounted as `dp_accounting.RepeatAndSelectDpEvent`.

    The number of trials is drawn once, at construction, from `TrialCount
    (mean_trials, shape)`; hyperparameter values may repeat (the analysis
    needs every drawn trial to run). Each trial's model must be a private
    model, built fresh by the hypermodel, whose privacy settings (optimizer,
    noise multiplier, microbatches, sampling, steps, spending stated
    before training) equal the first trial's: the search refuses one that
    differs before it trains, or, if only its training differed (a tuned
    batch size or number of epochs), after it.

    Args:
        hypermodel: a `keras_tuner.HyperModel`, or a function of `hp`
            returning a compiled keras-dp private model.
        objective: Keras Tuner's objective (e.g. "val_accuracy"); see
            docs/privacy_accounting.md for what its data may be.
        mean_trials: the mean number of trials.
        shape: the shape of their distribution: 0 (logarithmic), 1
            (geometric), `math.inf` (Poisson), or any other value > 0.
        seed: an integer for the number of trials and the hyperparameter
            values (tests); None draws from OS entropy.
        secure_mode: refuse a seed.
        **kwargs: Keras Tuner's `Tuner` arguments (directory,
            project_name, overwrite, ...); `executions_per_trial` must be 1.
            A failed trial is not retried, and a project holding an earlier
            search's trials is refused (pass overwrite=True).

    Example:
    ```python
    tuner = keras_dp.tuning.RandomSearch(build, objective="val_accuracy",
                                         mean_trials=10, shape=1.0)
    tuner.search(x, y, epochs=3, batch_size=64, validation_data=(x_val, y_val))
    best = tuner.get_best_models(1)[0]
    epsilon, _ = best.privacy_spent(delta=1e-5)  # == tuner.privacy_spent(1e-5)[0]
    ```
    """

    def __init__(self, hypermodel, objective=None, mean_trials=10, shape=1.0, seed=None,
                 secure_mode=False, **kwargs):
        _check_tuner_options(kwargs, seed, secure_mode)
        _check_objective(objective)
        self.trial_count = TrialCount(mean_trials, shape)
        self.num_trials = self.trial_count.sample(np.random.default_rng(seed))
        oracle = RepeatingRandomOracle(objective=objective, max_trials=self.num_trials,
                                       seed=seed)
        # Each trial's ledger state at its end, by trial id.
        self._trial_states = {}
        # The segments of every training a trial ran, refused or retried
        # ones too: what the search spent when it is no selection.
        self._trainings = []
        # The first trial's settings and segments, which every trial must match.
        self._first_settings = None
        self._first_trial = None
        self._trial_id = None
        # Whether Keras Tuner is building a model (a trial's, or the best
        # trial's to load), not the user after the search.
        self._tuner_builds = False
        super().__init__(oracle, _AccountedHyperModel(hypermodel, self), **kwargs)
        _check_fresh_project(self.oracle.trials, self.project_dir)

    def search(self, *fit_args, **fit_kwargs):
        """Keras Tuner's `search`: runs `num_trials` trials (none if 0 was drawn).

        Raises:
            ValueError: without `validation_data` or `validation_split`: the
                objective, named val_..., would then be a training metric
                (review round 30: a metric named "val_accuracy" chose trials
                by the training batches' accuracy).
        """
        if fit_kwargs.get("validation_data") is None and not fit_kwargs.get("validation_split"):
            raise ValueError(
                "A private search chooses trials by a validation objective, which needs "
                "held-out data: give search(..., validation_data=...) or "
                "validation_split=.... Without them an objective named val_... could only be "
                "a metric of the training batches, computed without noise.")
        if self.oracle.trials:
            raise ValueError(
                f"This search already ran {len(self.oracle.trials)} trial(s) (or began to, "
                "and was interrupted): Keras Tuner would train an interrupted trial again, "
                "and the aborted training, which read the private data, is outside the "
                "search's accounting (review round 88: 48 steps ran for 2 trials of 12, 8.07 "
                "reported against 12.1). A search runs once: start a fresh one "
                "(keras_dp.tuning.RandomSearch(..., overwrite=True)).")
        if self.num_trials:
            with self._building_for_the_tuner():
                super().search(*fit_args, **fit_kwargs)

    def _is_a_selection(self):
        """Whether the trainings that ran are the search's repeat and select:
        each drawn trial trained once, all of one mechanism."""
        return (len(self._trial_states) == len(self._trainings) == self.num_trials
                and all(_mechanisms(t) == _mechanisms(self._first_trial)
                        for t in self._trainings))

    def _check_complete(self):
        """Refuses to release a search that ran fewer trials than it drew:
        the selection's accounting holds for all of them, and one stopped
        early (an interrupt) may have stopped by its scores; nor one whose
        trainings are not its selection (a trial refused after training, or
        trained again by Keras Tuner's retries: review round 156)."""
        if len(self._trial_states) == self.num_trials and not self._is_a_selection():
            raise ValueError(
                f"This search ran {len(self._trainings)} trainings for its "
                f"{self.num_trials} trials (a trial refused after it trained, or retried): "
                "they are no repeat and select, so no model of it is released. Its "
                "privacy_spent composes every training. Start a fresh search "
                "(keras_dp.tuning.RandomSearch(..., overwrite=True)).")
        if len(self._trial_states) < self.num_trials:
            raise ValueError(
                f"This search ran {len(self._trial_states)} of the {self.num_trials} trials "
                "it drew (it was interrupted): its accounting (repeat and select) holds "
                "for all of them, and a search stopped early may have stopped by its "
                "scores. Release no model of it; start a fresh search "
                "(keras_dp.tuning.RandomSearch(..., overwrite=True)).")

    def is_searching(self):
        """Whether Keras Tuner is running this search's trials (or loading
        its best), not the user building or fitting after it."""
        return self._tuner_builds

    @contextlib.contextmanager
    def _building_for_the_tuner(self):
        self._tuner_builds = True
        try:
            yield
        finally:
            self._tuner_builds = False

    def run_trial(self, trial, *args, **kwargs):
        self._trial_id = trial.trial_id
        return super().run_trial(trial, *args, **kwargs)

    def load_model(self, trial):
        """The model of `trial` at its best epoch, whose ledger holds the
        whole trial (all its epochs ran) marked as the search's kept trial."""
        self._check_complete()
        if trial.trial_id not in self._trial_states:
            raise ValueError(
                f"Trial {trial.trial_id} did not run in this process, so its privacy "
                "spending is unknown here. Load the best model in the process that ran "
                "the search (or search again with overwrite=True).")
        (best,) = self.oracle.get_best_trials(1)
        if trial.trial_id != best.trial_id:
            raise ValueError(
                f"Trial {trial.trial_id} is not the search's best, and the search's "
                "epsilon (repeat and select) covers releasing the best trial's model "
                "alone: use get_best_models(1). Releasing more models is outside the "
                "guarantee.")
        with self._building_for_the_tuner():
            model = super().load_model(trial)
        privacy_ledger = model.privacy_ledger
        start = len(self._first_settings[-1])
        privacy_ledger.restore(_with_noised_weights(self._trial_states[trial.trial_id], start,
                                                    _noised_weights(self._first_trial)))
        privacy_ledger.select(start, self.trial_count.mean, self.trial_count.shape)
        return model

    def privacy_spent(self, delta, accountant="rdp"):
        """The privacy the search spent, as released by its best model.

        Args:
            delta: the total delta.
            accountant: "rdp" (dp_accounting's PLD accountant does not
                compose RepeatAndSelectDpEvent).

        Returns:
            `(epsilon, event)`: the epsilon of the spending stated before
            training (a `keras_dp.adapt` release) composed with
            `RepeatAndSelectDpEvent(trial, mean_trials, shape)`, and that
            `dp_accounting` event; for a search whose trainings are not that
            selection (interrupted, a trial refused after training, or
            retried), the larger of it and every training composed. 0.0
            when no trial was drawn.

        Raises:
            ValueError: before the first trial ran.
        """
        if accountant != "rdp":
            raise ValueError(
                f'accountant={accountant!r}: only the "rdp" accountant of dp_accounting '
                "composes a search (RepeatAndSelectDpEvent). Use accountant=\"rdp\".")
        if not self.num_trials:
            return 0.0, None
        if self._first_trial is None and not self._trainings:
            raise ValueError("No trial has run yet, so the search's spending is not "
                             "known: call search(...) first.")
        before = list(self._first_settings[-1])
        if self._first_trial is not None:
            selection = ledger.Selection(tuple(self._first_trial), self.trial_count.mean,
                                         self.trial_count.shape)
            spent = budget.epsilon(before + [selection], delta, accountant)
            if self._is_a_selection():
                return spent
        # Interrupted, refused, failed or retried: every training ran,
        # composed, and never below the selection it was to be (review round
        # 156: a refused 20-epoch trial left out, 5.38 reported against 11.35).
        ran = budget.epsilon(before + [s for t in self._trainings for s in t], delta, accountant)
        return ran if self._first_trial is None else max(spent, ran, key=lambda pair: pair[0])

    def check_new_model(self, model):
        """Refuses, before training, a trial model whose privacy settings
        differ from the first trial's (see the class docstring)."""
        if not hasattr(model, "privacy_ledger") or not optimizers.is_dp_optimizer(
                model.optimizer):
            raise keras_tuner.errors.FatalValueError(
                "keras_dp.tuning.RandomSearch needs the hypermodel to return a keras-dp "
                "private model compiled with a DP optimizer (keras_dp.make_private(model) "
                "then compile(optimizer=keras_dp.DPKerasSGD(...)).")
        settings = _privacy_settings(model)
        if any(segment.num_weights for segment in settings[-1]):
            raise keras_tuner.errors.FatalValueError(
                "This trial's model already holds private training steps (it shares "
                "weights with an earlier model): the search would not account them. "
                "Build every layer with weights inside the hypermodel's build(hp).")
        if self._first_settings is None:
            self._first_settings = settings
        elif settings != self._first_settings:
            raise keras_tuner.errors.FatalValueError(
                f"This trial's privacy settings {settings[:4]} (or its layers' "
                "keras_dp.adapt releases, or spending stated before training) differ "
                f"from the first trial's {self._first_settings[:4]}: the search's "
                "accounting holds for trials of one mechanism. Tune other "
                "hyperparameters, run one search per setting, and adapt preprocessing "
                "layers once, before the search, outside build(hp).")

    def carry_search(self, model):
        """Puts the search's spending into the ledger of a model built after
        it (`tuner.hypermodel.build(tuner.get_best_hyperparameters()[0])`,
        to train again with the best values): those values are a release of
        every trial, so the model's training counts after the search's
        selection (review round 82: a model retrained so reported its own
        16 steps, 4.70, where the search and it compose to 8.37)."""
        if self.is_searching() or not self.oracle.trials:  # Before the search.
            return
        self._check_complete()
        privacy_ledger = model.privacy_ledger
        start = len(privacy_ledger.segments())
        noised = _noised_weights(self._first_trial)
        privacy_ledger.add([dataclasses.replace(segment, num_weights=noised)
                            for segment in self._first_trial])
        privacy_ledger.select(start, self.trial_count.mean, self.trial_count.shape)

    def record_failed_trial(self, model):
        """Keeps what a trial that failed trained (its model's segments): a
        search with one is no selection (`privacy_spent` composes it)."""
        self._trainings.append(self._training_of(model))

    def _training_of(self, model):
        return model.privacy_ledger.segments()[len(self._first_settings[-1]):]

    def record_trial(self, model):
        """Keeps a trained trial model's ledger; refuses training that
        differed from the first trial's."""
        trial = self._training_of(model)
        self._trainings.append(trial)  # Ran, whatever follows.
        if self._first_trial is not None and _mechanisms(trial) != _mechanisms(
                self._first_trial):
            raise keras_tuner.errors.FatalValueError(
                "This trial trained with another sampling, noise or number of steps "
                f"than the first ({trial} against {self._first_trial}): the search's "
                "accounting holds for trials of one mechanism. Keep batch_size, epochs "
                "and sampling fixed across trials.")
        # Trials may differ in their weights (a tuned architecture): the one
        # with the most noised weights bounds every trial's noise-tail delta.
        if self._first_trial is None or _noised_weights(trial) > _noised_weights(
                self._first_trial):
            self._first_trial = trial
        self._trial_states[self._trial_id] = model.privacy_ledger.state()


class RepeatingRandomOracle(keras_tuner.oracles.RandomSearchOracle):
    """Keras Tuner's random search oracle that runs all `max_trials`: when
    the space holds no untried values it draws values again, because the
    accounting needs every drawn trial to run."""

    def populate_space(self, trial_id):
        proposal = super().populate_space(trial_id)
        if proposal["values"] is not None:
            return proposal
        rng = np.random.default_rng(self.seed + len(self.trials) if self.seed else None)
        values = keras_tuner.HyperParameters()
        for hyperparameter in self.hyperparameters.space:
            values.merge([hyperparameter])
            if values.is_active(hyperparameter):
                values.values[hyperparameter.name] = hyperparameter.random_sample(
                    int(rng.integers(2 ** 31)))
        return {"status": keras_tuner.engine.trial.TrialStatus.RUNNING,
                "values": values.values}


class _AccountedHyperModel(keras_tuner.HyperModel):
    """The user's hypermodel, with the search's checks around build and fit."""

    def __init__(self, hypermodel, tuner):
        super().__init__()
        self._hypermodel = hypermodel
        self._tuner = tuner

    def build(self, hp):
        if isinstance(self._hypermodel, keras_tuner.HyperModel):
            model = self._hypermodel.build(hp)
        else:
            model = self._hypermodel(hp)
        self._tuner.check_new_model(model)
        self._tuner.carry_search(model)
        return model

    def fit(self, hp, model, *args, **kwargs):
        try:
            if isinstance(self._hypermodel, keras_tuner.HyperModel):
                result = self._hypermodel.fit(hp, model, *args, **kwargs)
            else:
                result = model.fit(*args, **kwargs)
        except BaseException:
            # What trained before the failure ran (review round 157: a
            # callback raising at the end of training, 8.41 reported
            # against 9.62), and Keras Tuner goes on to the next trial.
            if self._tuner.is_searching():
                self._tuner.record_failed_trial(model)
            raise
        if self._tuner.is_searching():  # Not a model trained again after the search.
            # Whatever the hypermodel's fit returns (a History, or a dict of
            # the logs: review round 160, a metric named "val_score" chose
            # trials by the training batches through a dict).
            _check_logged_objective(self._tuner.oracle.objective, _training_log_names(
                model, result.history if isinstance(result, keras.callbacks.History) else {}))
            self._tuner.record_trial(model)
        return result


def _privacy_settings(model):
    """What a trial's mechanism depends on before it trains; the spending
    stated before (releases of keras_dp.adapt: the same objects, adapted once
    before the search, since one adapted per trial would be a part of it)."""
    optimizer = model.optimizer
    return (type(optimizer).__name__, float(optimizer.noise_multiplier),
            optimizer.num_microbatches, optimizer.accumulation_steps,
            tuple(preprocessing.releases_of(model)), tuple(model.privacy_ledger.segments()))


def _mechanisms(segments):
    """`segments` without the number of weights each noised, which the
    architecture sets and only the noise tail's delta reads."""
    return [dataclasses.replace(s, num_weights=0) for s in segments]


def _noised_weights(segments):
    return max((s.num_weights for s in segments), default=0)


def _with_noised_weights(state, start, num_weights):
    """A trial's ledger `state` whose segments from `start` on count
    `num_weights` noised weights, the most of any trial: the selection's
    noise-tail delta then holds for every trial it stands for."""
    table = np.array(state["table"])
    table[start:, ledger.COLUMN["num_weights"]] = num_weights
    return dict(state, table=table)


def _check_objective(objective):
    """Refuses an objective fit computes from the training data without noise:
    choosing trials by it would reveal the training data beyond the
    guarantee of the search (review round 12: objective="loss" ran)."""
    objectives = objective if isinstance(objective, (list, tuple)) else [objective]
    for name in (getattr(o, "name", o) for o in objectives):
        if name is not None and not str(name).startswith("val_"):
            raise ValueError(
                f"objective={name!r} is computed by fit from the training data without "
                "noise, so choosing trials by it reveals that data beyond the search's "
                'epsilon. Use a validation objective on held-out data (e.g. "val_accuracy", '
                "with validation_data=...).")


def _training_log_names(model, history):
    """The names fit logs for the training batches: the model's metrics'
    (which name their validation values val_...), and those of `history`
    (a History's) whose validation value it holds too."""
    names = set(model.get_metrics_result())
    return names | {name for name in history if f"val_{name}" in history}


def _check_logged_objective(objective, training_log_names):
    """Refuses an objective that fit logged for the training batches: a
    compiled metric (or output) named val_... logs its training value under
    that name and its validation value as val_val_... (review round 128: a
    metric named "val_score" chose trials by the training batches, one
    example deciding the best learning rate, with validation data given)."""
    for name in (o.name for o in getattr(objective, "objectives", [objective])):
        if name in training_log_names:
            raise keras_tuner.errors.FatalValueError(
                f"The objective {name!r} is what fit logs for the training batches (a "
                f"compiled metric or output named {name!r}, whose validation value is "
                f"'val_{name}'), computed without noise: choosing trials by it reveals "
                "the training data beyond the search's epsilon. Name no metric or output "
                "val_..., and choose by the validation value of a metric.")


def _check_fresh_project(trials, project_dir):
    """Refuses a search that Keras Tuner reloaded from an earlier one's
    project (overwrite=False): its trials would compete with this search's
    and its interrupted trial be trained again, outside the one trial count
    this search draws and accounts (review round 75: 67 steps of 8 trials
    over two processes, reported as one search of 8.59 against 16.4
    composed)."""
    if trials:
        raise ValueError(
            f"The project {project_dir} holds {len(trials)} trial(s) of an earlier "
            "search, which Keras Tuner reloads with overwrite=False: they would compete "
            "with this search's trials outside its accounting (one draw of the number "
            "of trials). Start a fresh search with overwrite=True or another "
            "project_name (the earlier search's models stay unreleased).")


def _check_tuner_options(kwargs, seed, secure_mode):
    if secure_mode and seed is not None:
        raise ValueError(
            "secure_mode=True draws the number of trials from OS entropy and refuses a "
            f"user seed; received seed={seed!r}. Drop the seed or set secure_mode=False.")
    if kwargs.get("executions_per_trial", 1) != 1:
        raise ValueError(
            "keras_dp.tuning.RandomSearch needs executions_per_trial=1: each execution "
            "trains on the private data again, which the search's accounting (one "
            "training per trial) does not cover; received "
            f"executions_per_trial={kwargs['executions_per_trial']!r}.")
