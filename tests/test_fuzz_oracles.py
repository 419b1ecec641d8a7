"""The fuzzer's oracles fail when they must (a test that cannot fail is a defect).

Fake traces, built from the runner's own `Probe` and `Trace`, show each
oracle flags what it exists for: an epsilon below what ran (fewer steps, a
smaller sampling rate, a larger noise multiplier, chosen batches or
correlated noise accounted as sampled or independent releases), an update
moving the clipped sum further than the ledger's sensitivity, an update
the ledger did not record, weights gone non-finite, a step applied that
keras-dp must refuse. One real run with clipping loosened inside the test
shows the sensitivity oracle catches it end to end. The fakes need no
training: they take milliseconds.
"""

import tempfile

import dp_accounting
import numpy as np
import pytest

from fuzz import grammar
from fuzz import oracles
from fuzz import pipelines
from fuzz import runner

# What is checked is the oracles' arithmetic, which no CPU kernel changes.
pytestmark = pytest.mark.once

WEIGHTS = 3  # Fake models have three weights.
ROWS = 10  # The rows of a fake fixed batch (its divisor).
CLIPPED_SUM = np.array([2.0, 0.0, 0.0])  # D's clipped sum in a fake step, C = 1.


def _probe(step, update, tag, recorded=True, sensitivity=1.0, sigma=1.0, refused=False):
    """A physical batch of optimizer 1 on slot "a" that moved the weights by `update`."""
    before = np.full(WEIGHTS, float(step))
    return runner.Probe("a", 1, tag, sigma, 1.0, {"a": before}, {"a": before + update},
                        step, step + int(recorded), sensitivity, refused)


def _fixed(z=0):
    return {"kind": "arbitrary", "z": z, "rows": ROWS, "action": 1}


def _trace(probes, reported=float("nan")):
    return runner.Trace(probes, [], reported, ("a",), 41)


# ------------------------------------------------------------- sensitivity


def _neighbours(moved, recorded=1.0, accumulation=1, ledger_records=True):
    """D's and D + z's traces of one logical step of `accumulation` physical
    batches, z moving the clipped sum by `moved` C (in one coordinate)."""
    program = grammar.Program(accumulation=accumulation)
    divisor = accumulation * ROWS
    traces = []
    for clipped_sum in (CLIPPED_SUM, CLIPPED_SUM + [0.0, moved, 0.0]):
        open_batches = [_probe(0, np.zeros(WEIGHTS), _fixed(), recorded=False)
                        for _ in range(accumulation - 1)]
        last = _probe(0, -clipped_sum / divisor, _fixed(), recorded=ledger_records,
                      sensitivity=recorded)
        traces.append(_trace(open_batches + [last]))
    return program, traces[0], traces[1]


def _oracles_of(findings):
    return {finding.oracle for finding in findings}


@pytest.mark.parametrize("moved, recorded, accumulation, flagged", [
    pytest.param(1.0, 1.0, 1, False, id="moved_C_recorded_C"),
    pytest.param(3.0, 1.0, 1, True, id="not_clipped_3C_recorded_C"),
    pytest.param(2.0, 1.0, 2, True, id="k2_z_in_both_2C_recorded_C"),
    pytest.param(2.0, 2.0, 2, False, id="k2_z_in_both_2C_recorded_2C"),
])
def test_sensitivity_oracle_flags_a_sum_moved_beyond_the_recorded_sensitivity(
        moved, recorded, accumulation, flagged):
    program, d, dz = _neighbours(moved, recorded, accumulation)
    findings = oracles.sensitivity_findings(program, d, dz)
    assert ("sensitivity" in _oracles_of(findings)) == flagged, findings


def test_sensitivity_oracle_flags_an_update_the_ledger_did_not_record():
    program, d, dz = _neighbours(1.0, ledger_records=False)
    assert _oracles_of(oracles.sensitivity_findings(program, d, dz)) == {"unrecorded"}


def test_a_refused_traced_step_joins_no_logical_step():
    """Regression (campaign seed 100, programs 0 and 4): a custom loop's step
    refused in the graph before a fit's sampled step was grouped with it,
    and the divisor looked for the loop's rows in the sampled batch's tag
    (KeyError: 'rows')."""
    sampled = {"kind": "poisson", "q": 0.25, "expected": ROWS, "draw": ("fit", 1, 0, 0)}
    traces = [_trace([_probe(0, np.zeros(WEIGHTS), _fixed(1), recorded=False, refused=True),
                      _probe(0, -(CLIPPED_SUM + [0.0, z, 0.0]) / ROWS, sampled)])
              for z in (0.0, 1.0)]
    assert oracles.sensitivity_findings(grammar.Program(), *traces) == []
    assert oracles.true_events(grammar.Program(), traces[1]) == (
        oracles.true_events(grammar.Program(), _trace(traces[1].probes[1:])))


@pytest.mark.parametrize("discarded", [True, False])
def test_a_batch_discarded_with_its_open_logical_step_joins_no_later_step(discarded):
    """Regression (seed 337 on main): a fit stopped inside a logical step of
    k = 2 discards its batch; grouped with the next train_on_batch step, the
    oracle divided that step by the fit's expected batch size, and z's 2 C
    (in both batches, recorded 2 C) looked like 3.8 C."""
    sampled = {"kind": "poisson", "q": 0.25, "expected": 16, "draw": ("fit", 0, 0, 0)}
    traces = []
    for moved in (0.0, 2.0):
        stopped_fit = _probe(0, np.zeros(WEIGHTS), sampled, recorded=False)
        loop = [_probe(0, np.zeros(WEIGHTS), _fixed(1), recorded=False),
                _probe(0, -(CLIPPED_SUM + [0.0, moved, 0.0]) / (2 * ROWS), _fixed(1),
                       sensitivity=2.0)]
        trace = _trace([stopped_fit] + loop)
        trace.events = [("closed", 1, 1)] if discarded else []
        traces.append(trace)
    findings = oracles.sensitivity_findings(grammar.Program(accumulation=2), *traces)
    assert ("sensitivity" in _oracles_of(findings)) != discarded, findings


# -------------------------------------------------------------- accounting

SIGMA, Q, STEPS = 1.0, 0.25, 3


def _epsilon(*events):
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(list(events)))
    return accountant.get_epsilon(runner.DELTA)


def _sampled(q=Q, sigma=SIGMA, steps=STEPS):
    """A ledger's epsilon of `steps` Poisson-sampled Gaussian releases."""
    return _epsilon(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))


def _poisson_trace(reported):
    """STEPS updates from fresh Poisson draws at rate Q, noise SIGMA."""
    return _trace([_probe(step, -CLIPPED_SUM, {"kind": "poisson", "q": Q, "expected": ROWS,
                                               "draw": ("fit", 0, 0, step)})
                   for step in range(STEPS)], reported)


@pytest.mark.parametrize("reported, flagged", [
    pytest.param(_sampled(), False, id="what_ran"),
    pytest.param(_sampled(steps=STEPS - 1), True, id="a_step_not_recorded"),
    pytest.param(_sampled(q=Q / 2), True, id="a_smaller_sampling_rate"),
    pytest.param(_sampled(sigma=2 * SIGMA), True, id="a_larger_noise_multiplier"),
])
def test_accounting_oracle_flags_an_epsilon_below_what_ran(reported, flagged):
    findings = oracles.accounting_findings(grammar.Program(), _poisson_trace(reported))
    assert ("accounting" in _oracles_of(findings)) == flagged, findings


def _loop_trace(reported, z_steps):
    """A loop of chosen batches (no sampling), z in the steps `z_steps`."""
    return _trace([_probe(step, -CLIPPED_SUM, _fixed(int(step in z_steps)))
                   for step in range(STEPS)], reported)


def test_accounting_oracle_flags_chosen_batches_accounted_as_sampled():
    full = dp_accounting.GaussianDpEvent(SIGMA)
    honest = oracles.accounting_findings(grammar.Program(),
                                         _loop_trace(_epsilon(full, full), (0, 2)))
    sampled = oracles.accounting_findings(grammar.Program(), _loop_trace(_sampled(), (0, 2)))
    assert "accounting" not in _oracles_of(honest)
    assert "accounting" in _oracles_of(sampled)


def test_accounting_oracle_flags_correlated_noise_accounted_as_independent_releases():
    """BandedMF's noise in a custom loop, z in two consecutive steps: its
    strategy adds z's two gradients up, a larger sensitivity than two
    independent releases'."""
    independent = _epsilon(*[dp_accounting.GaussianDpEvent(SIGMA)] * 2)
    findings = oracles.accounting_findings(grammar.Program(bands=2),
                                           _loop_trace(independent, (0, 1)))
    assert "accounting" in _oracles_of(findings)


def test_accounting_oracle_flags_an_unrecorded_update_and_nonfinite_weights():
    trace = _poisson_trace(_sampled())
    trace.probes[1].ledger_steps = trace.probes[1].ledger_before
    trace.probes[2].weights["a"][0] = np.nan
    findings = oracles.accounting_findings(grammar.Program(), trace)
    assert {"unrecorded", "nonfinite"} <= _oracles_of(findings)


# ---------------------------------------------------------------- refusal


@pytest.mark.parametrize("program, tag", [
    pytest.param(grammar.Program(), dict(_fixed(), must_refuse="a map mixing rows"),
                 id="a_map_mixing_rows"),
    pytest.param(grammar.Program(subclass="compute_loss"), _fixed(),
                 id="a_compute_loss_override"),
])
def test_refusal_oracle_flags_a_step_keras_dp_must_refuse(program, tag):
    applied = _trace([_probe(0, -CLIPPED_SUM, tag)])
    refused = _trace([_probe(0, np.zeros(WEIGHTS), tag, recorded=False, refused=True)])
    assert _oracles_of(oracles.refusal_findings(program, applied)) == {"unrefused"}
    assert oracles.refusal_findings(program, refused) == []


# -------------------------------------------------------------- end to end


def test_sensitivity_oracle_catches_a_real_step_clipped_to_3c(monkeypatch):
    """One train_on_batch step with z, every example clipped to 3 C (keras-dp's
    clipping scales tripled, in this test only) while the ledger records C."""
    from keras_dp.clipping import bounds

    scales = bounds.Bound.scales

    def loose(self, group_sq_norms):
        factors, finite, within = scales(self, group_sq_norms)
        return 3.0 * factors, finite, within

    monkeypatch.setattr(bounds.Bound, "scales", loose)
    program = grammar.Program(n=20, actions=(grammar.Loop(steps=1, z_steps=(0,)),))
    with tempfile.TemporaryDirectory() as directory:
        d = runner.Run(program, False, False, directory).run()
        dz = runner.Run(program, True, False, directory, reference=d).run()
    assert "sensitivity" in _oracles_of(oracles.sensitivity_findings(program, d, dz))


@pytest.mark.parametrize("kind", ["take", "skip", "shard", "batch_unbatch_dropping",
                                  "enumerate", "concatenate_filtered", "repeat", "zip_shifted"])
def test_the_pipeline_oracle_finds_what_a_copy_without_checks_lets_through(kind):
    case = pipelines.PipelineCase(0, 12, (f"{kind}:5",), 2)
    assert pipelines.check(case, read=pipelines.unchecked_copy)
    assert pipelines.copy(pipelines.pipeline(range(12), case.transforms)).refusal
