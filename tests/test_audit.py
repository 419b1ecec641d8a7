"""keras_dp.audit: the statistics against independent computations, and audits
of keras-dp's own training (power without noise, soundness with it)."""

import ast
import math
import os
import re
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from absl.testing import flagsaver
from scipy import stats

import keras_dp
from keras_dp import audit
from keras_dp import cli
from keras_dp.audit import builtin_task

# The statistics and the audits' verdicts do not depend on TensorFlow's CPU
# kernel set: `make test` runs this module once, with oneDNN on (which
# balances its two runs: the oneDNN-off run was 28 s the longer).
pytestmark = [pytest.mark.once, pytest.mark.with_onednn_on]

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ------------------------------------------------ statistics, by hand


def exact_p_value(epsilon, v, r, m, delta):
    """The one-run p-value with exact binomial sums (math.comb), no scipy."""
    q = math.exp(epsilon) / (1 + math.exp(epsilon))
    pmf = [math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(r + 1)]
    beta = sum(pmf[v:])
    alpha = max((sum(pmf[v - i:v]) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, beta + alpha * 2 * m * delta)


@pytest.mark.parametrize("epsilon,v,r,m,delta", [
    (0.0, 12, 20, 100, 0.0),
    (0.5, 15, 20, 100, 1e-3),
    (1.0, 80, 100, 1000, 1e-5),
    (2.0, 95, 100, 1000, 1e-4),
    (3.0, 400, 400, 1000, 1e-5),
    (1.5, 0, 50, 50, 1e-3),
])
def test_p_value_matches_exact_binomial_sums(epsilon, v, r, m, delta):
    assert audit.one_run_p_value(epsilon, v, r, m, delta) == pytest.approx(
        exact_p_value(epsilon, v, r, m, delta), rel=1e-9, abs=1e-15)


def test_p_value_is_monotone_in_v_and_epsilon():
    for epsilon in (0.0, 0.5, 1.0, 2.0, 4.0):
        p = [audit.one_run_p_value(epsilon, v, 100, 1000, 1e-5) for v in range(101)]
        assert all(a >= b for a, b in zip(p, p[1:]))
        assert p[-1] < p[50]
    for v in (60, 90, 100):
        p = [audit.one_run_p_value(e, v, 100, 1000, 1e-5) for e in np.linspace(0, 6, 61)]
        assert all(a <= b for a, b in zip(p, p[1:]))


def test_bound_with_all_guesses_correct_has_a_closed_form():
    # delta = 0 and v = r: p = q^r, so the bound solves q = significance^(1/r).
    for r in (10, 100, 500):
        q = 0.05 ** (1 / r)
        assert audit.one_run_epsilon_lower_bound(r, r, 1000) == pytest.approx(
            math.log(q / (1 - q)), abs=2e-6)


@pytest.mark.parametrize("v,r,m,delta", [(70, 100, 1000, 1e-5), (180, 200, 500, 1e-4),
                                         (30, 40, 40, 0.0)])
def test_bound_is_where_the_exact_p_value_crosses_the_level(v, r, m, delta):
    bound = audit.one_run_epsilon_lower_bound(v, r, m, delta)
    assert bound > 0
    assert exact_p_value(bound, v, r, m, delta) <= 0.05
    assert exact_p_value(bound + 1e-4, v, r, m, delta) > 0.05


def test_bound_grows_with_correct_guesses_and_is_zero_at_chance():
    bounds = [audit.one_run_epsilon_lower_bound(v, 200, 1000, 1e-5)
              for v in range(100, 201, 10)]
    assert bounds[0] == 0.0
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    assert bounds[-1] > bounds[-2] > 0


def test_one_run_audit_uses_bonferroni_over_its_candidates():
    included = np.arange(100) % 2 == 0
    scores = included.astype(float)  # Perfect separation: every guess correct.
    result = audit.one_run_audit(scores, included, guess_fractions=(0.2, 1.0))
    # Candidates (10, 10), (20, 0), (50, 50), (100, 0), each at level 0.05 / 4;
    # (50, 50) is all correct with the most guesses.
    assert result.num_candidates == 4
    assert (result.num_guessed_in, result.num_guessed_out, result.num_correct) == (50, 50, 100)
    assert result.epsilon_lower_bound == pytest.approx(
        audit.one_run_epsilon_lower_bound(100, 100, 100, significance=0.05 / 4))


def test_one_run_audit_finds_nothing_in_random_scores():
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    result = audit.one_run_audit(rng.normal(size=1000), included, delta=1e-5)
    assert result.epsilon_lower_bound < 0.3


@pytest.mark.parametrize("call,match", [
    (lambda: audit.one_run_audit([1.0, 2.0], [True]), "same length"),
    (lambda: audit.one_run_audit([1.0, np.inf], [True, False]), "finite"),
    (lambda: audit.one_run_audit([1.0, 2.0], [1, 0]), "bool"),
    (lambda: audit.one_run_audit([1.0, 2.0], [True, False], significance=5), "significance"),
    (lambda: audit.one_run_p_value(1.0, 5, 4, 10), "num_correct <= num_guesses"),
    (lambda: audit.one_run_p_value(-1.0, 1, 4, 10), "epsilon must be >= 0"),
    (lambda: audit.clopper_pearson(3, 2), "successes <= trials"),
    (lambda: audit.GradientCanaries(0), "num_canaries"),
    (lambda: audit.audit_training(tiny_model(), *generated_data(), audit.GradientCanaries(10),
                                  loss=LOSS, optimizer=keras.optimizers.SGD(),
                                  batch_size=10, epochs=1), "DP optimizer"),
    (lambda: audit.audit_builtin_task(canary_kind="gradients"), "canary_kind"),
])
def test_bad_input_raises_a_clear_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_clopper_pearson_matches_beta_quantiles_and_exact_tails():
    n, confidence = 50, 0.9
    for k in (0, 1, 7, 25, 49, 50):
        low, high = audit.clopper_pearson(k, n, confidence)
        assert low == (0.0 if k == 0 else pytest.approx(stats.beta.ppf(0.05, k, n - k + 1)))
        assert high == (1.0 if k == n else pytest.approx(stats.beta.ppf(0.95, k + 1, n - k)))

        def tail(p, at_least):  # P[Binomial(n, p) >= at_least], by hand.
            return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j)
                       for j in range(at_least, n + 1))
        # The interval's ends are where the observed count becomes a 5% tail.
        if k > 0:
            assert tail(low, k) == pytest.approx(0.05, rel=1e-6)
        if k < n:
            assert 1 - tail(high, k + 1) == pytest.approx(0.05, rel=1e-6)
    lows, highs = audit.clopper_pearson(np.array([0, 7]), n, confidence)
    assert lows[0] == 0.0 and highs[1] == pytest.approx(audit.clopper_pearson(7, n, 0.9)[1])


def test_loss_threshold_attack_auc_and_tpr_match_brute_force():
    rng = np.random.default_rng(1)
    members = rng.exponential(0.5, 300)
    nonmembers = rng.exponential(1.0, 400)
    result = audit.loss_threshold_attack(members, nonmembers, fprs=(0.01, 0.1))
    pairs = members[:, None] < nonmembers[None, :]
    assert result.auc == pytest.approx(pairs.mean())
    for fpr in (0.01, 0.1):
        best = max(np.mean(members < t) for t in np.concatenate([members, nonmembers, [0.0]])
                   if np.mean(nonmembers < t) <= fpr)
        assert result.tpr_at_fpr[fpr] == pytest.approx(best)


def test_loss_threshold_attack_bounds_epsilon_only_with_evidence():
    rng = np.random.default_rng(2)
    same = audit.loss_threshold_attack(rng.normal(size=2000), rng.normal(size=2000))
    assert 0.4 < same.auc < 0.6 and same.epsilon_lower_bound < 0.5
    # Members always have lower loss: TPR 1 at FPR 0 on 1000 test pairs.
    apart = audit.loss_threshold_attack(rng.normal(size=2000), rng.normal(size=2000) + 100)
    assert apart.auc == 1.0
    # Its bound is log(TPR_low / FPR_high) with the exact one-sided 2.5% ends.
    expected = math.log(0.025 ** (1 / 1000) / (1 - 0.025 ** (1 / 1000)))
    assert apart.epsilon_lower_bound == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------- audits of real training


def generated_data(num_examples=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, 10)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def tiny_model():
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(2)])


def run_audit(canaries, noise_multiplier, batch_size, epochs, seed=0, momentum=0.0, **kwargs):
    keras.utils.set_random_seed(seed)
    x, y = generated_data(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0 warns, rightly.
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
                                        learning_rate=1.0, momentum=momentum)
        return audit.audit_training(tiny_model(), x, y, canaries, loss=LOSS,
                                    optimizer=optimizer, batch_size=batch_size,
                                    epochs=epochs, delta=1e-5, **kwargs)


@pytest.mark.slow  # 4 s; the canaries' path is checked below, the bound's soundness after.
def test_power_without_noise_gradient_canaries():
    # 1000 canaries (the default), no noise: every sampled canary moves its
    # coordinate, every excluded one stays at 0. Measured bound: 4.53.
    canaries = audit.GradientCanaries(1000, seed=0)
    result = run_audit(canaries, 0.0, batch_size=100, epochs=10)
    assert result.claimed_epsilon == math.inf
    assert result.epsilon_lower_bound > 3


def test_canaries_go_through_the_private_step_only():
    canaries = audit.GradientCanaries(300, seed=3)
    result = run_audit(canaries, 0.0, batch_size=50, epochs=2)
    num_included = int(canaries.included.sum())
    # They are part of the private, accounted training set...
    assert result.num_examples == 200 + num_included
    # ...an excluded canary's coordinate never moves (no noise)...
    assert np.all(result.scores[~canaries.included] == 0.0)
    # ...and each step that samples an included canary moves its coordinate by
    # lr * C / B: its gradient (norm 2C) is clipped to C like any example's.
    steps = result.scores[canaries.included] * 50 / 1.0
    assert np.allclose(steps, np.round(steps), atol=1e-3)
    assert steps.max() <= 2 * math.ceil(result.num_examples / 50)
    assert steps.sum() > 0


def test_claimed_epsilon_accounts_for_the_canaries():
    canaries = audit.GradientCanaries(100, seed=4)
    result = run_audit(canaries, 1.0, batch_size=50, epochs=1)
    n = result.num_examples
    assert n == 200 + int(canaries.included.sum())
    assert result.claimed_epsilon == pytest.approx(keras_dp.compute_epsilon(
        n, 50, 1.0, 1e-5, steps=math.ceil(n / 50)), rel=1e-3)


def soundness_audit(seed, target_epsilon=2.0):
    """Full-batch DP-SGD (q = 1) calibrated to target_epsilon; 1000 canaries."""
    canaries = audit.GradientCanaries(1000, seed=seed)
    num_examples, steps = 200 + int(canaries.included.sum()), 10
    noise = keras_dp.calibrate_noise_multiplier(
        target_epsilon, num_examples, num_examples, None, 1e-5, steps=steps)
    return run_audit(canaries, noise, batch_size=num_examples, epochs=steps, seed=seed,
                     momentum=0.9)


def test_soundness_at_epsilon_2():
    # Measured bound with seed 0: 0.83 (claimed 1.99); seeds 1-9 (slow) gave
    # 0.25 to 0.56. With half the noise (a bug) it reaches 1.77, a quarter 2.93.
    result = soundness_audit(seed=0)
    assert result.claimed_epsilon <= 2.0
    assert 0 < result.epsilon_lower_bound <= result.claimed_epsilon


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_soundness_at_epsilon_2_more_seeds(seed):
    assert soundness_audit(seed).epsilon_lower_bound <= 2.0


def test_mislabeled_canaries_are_appended_when_included_and_scored_by_loss():
    x, y = generated_data(100, seed=5)
    canaries = audit.ExampleCanaries.mislabeled(x, y, num_classes=2, seed=5)
    assert np.all(canaries.y != y)
    model = tiny_model()
    _, _, x_train, y_train = canaries.prepare(model, LOSS, x, y, 1.0)
    assert len(x_train) == 100 + canaries.included.sum()
    np.testing.assert_array_equal(x_train[100:], x[canaries.included])
    losses = LOSS.call(canaries.y, model.predict(canaries.x, verbose=0)).numpy()
    np.testing.assert_allclose(canaries.scores(model, LOSS), -losses, rtol=1e-6)


def test_input_canaries_audit_end_to_end():
    canaries = audit.ExampleCanaries.random_inputs(200, (10,), 2, low=-3, high=3, seed=6)
    x, y = generated_data(seed=6)
    result = run_audit(canaries, 1.0, batch_size=50, epochs=1, holdout=(x[:100], y[:100]))
    assert result.num_examples == 200 + canaries.included.sum()
    assert 0 <= result.epsilon_lower_bound <= result.claimed_epsilon
    assert 0 <= result.membership.auc <= 1


def test_builtin_data_falls_back_to_generated_images(tmp_path):
    train, spare, held_out = builtin_task._builtin_data(500, 100, str(tmp_path),
                                                        np.random.default_rng(0))
    assert train[0].shape == (500, 784) and spare[0].shape == (100, 784)
    assert held_out[0].shape == (1000, 784)
    assert train[0].min() >= 0 and train[0].max() <= 1


# The command's whole audit (5 s): make test-all; its printing is in
# tests/test_cli.py, the audit itself in the tests above.
@pytest.mark.slow
def test_cli_audit_last_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [
        "keras-dp", "audit", "--noise_multiplier", "0", "--num_examples", "1000",
        "--batch_size", "100", "--epochs", "2", "--num_canaries", "200"])
    with flagsaver.flagsaver(), pytest.raises(SystemExit) as exit_info, \
            pytest.warns(UserWarning, match="NOT differentially private"):
        cli.main()
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"claimed epsilon inf, empirical epsilon lower bound "
                         r"(\d+\.\d\d) \(95% confidence\)", last)
    assert match and float(match.group(1)) > 1


# ------------------------------------------------------- the package

# keras_dp.audit's public names before it became a package of four modules.
PUBLIC_NAMES = {
    "AuditResult", "CANARY_KINDS", "DEFAULT_GUESS_FRACTIONS", "ExampleCanaries",
    "FASHION_MNIST_DIR", "GradientCanaries", "MembershipInferenceResult", "OneRunResult",
    "audit_builtin_task", "audit_training", "clopper_pearson", "loss_threshold_attack",
    "one_run_audit", "one_run_epsilon_lower_bound", "one_run_p_value",
}


def test_the_package_exports_the_public_names_of_the_module_it_was():
    assert set(audit.__all__) == PUBLIC_NAMES
    modules = {name for name in dir(audit) if not name.startswith("_")} - PUBLIC_NAMES
    assert modules == {"audits", "builtin_task", "canaries", "statistics"}
    assert keras_dp.audit.one_run_audit is audit.statistics.one_run_audit


def modules_run_on_import(name):
    """The keras_dp modules that `import name` runs, from the source: the
    closure of the imports outside functions (and of the packages above)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(keras_dp.__file__)))

    def source(module):
        path = os.path.join(root, *module.split("."))
        for candidate in (path + ".py", os.path.join(path, "__init__.py")):
            if os.path.exists(candidate):
                return candidate
        return None  # A name imported from a module, not a module.

    def imports(tree):
        for node in ast.iter_child_nodes(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue  # Runs when called, not on import.
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                yield node.module
                yield from (f"{node.module}.{alias.name}" for alias in node.names)
            yield from imports(node)

    found, todo = set(), [name]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for end in range(1, len(parts) + 1):  # A module's packages run first.
            module = ".".join(parts[:end])
            if module in found or not module.startswith("keras_dp") or not source(module):
                continue
            found.add(module)
            with open(source(module), encoding="utf-8") as f:
                todo += imports(ast.parse(f.read()))
    return found


def test_import_keras_dp_leaves_the_audit_unloaded_by_its_source():
    # The fresh-interpreter test below, from the source: 8 s less of CPU.
    loaded = modules_run_on_import("keras_dp")
    assert {"keras_dp.models", "keras_dp.ledger", "keras_dp.clipping.ghost"} <= loaded
    assert not {m for m in loaded if m.startswith("keras_dp.audit")}
    assert "keras_dp.audit.statistics" in modules_run_on_import("keras_dp.audit")
    assert keras_dp.__getattr__("audit") is audit  # Loaded on first use.


@pytest.mark.slow
@pytest.mark.program
def test_import_keras_dp_leaves_the_audit_unloaded():
    # A fresh interpreter: this one has imported keras_dp.audit above.
    code = ("import sys, keras_dp; loaded = sorted(m for m in sys.modules "
            "if m.startswith('keras_dp.audit')); print(loaded); "
            "keras_dp.audit.clopper_pearson(5, 100); print('keras_dp.audit' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "True"]
