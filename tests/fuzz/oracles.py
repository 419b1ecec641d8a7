"""The two oracles, independent of keras-dp's accounting.

Sensitivity: with noise 0, SGD at learning rate 1 and momentum 0, every
applied update of D + z is compared with D's from the same weights: the
clipped sums (update times the divisor the noise is divided by) differ by
at most the sensitivity the ledger recorded for the step times C. An update
the ledger did not record is a finding.

Accounting: from what the program did (each applied update, seen in the
weights of the run with noise; which batches made it; how they were drawn;
how often z was in them; the noise multiplier set), the true epsilon is
composed directly with dp_accounting's events and RDP accountant; the
released model's privacy_spent must not be below it.

Refusal: what the program knows keras-dp cannot do exactly (a compute_loss
override, a map mixing rows after poisson_dataset, a layer keeping the batch
in a weight) must change no weight.
"""

import dataclasses
import math
import tempfile

import dp_accounting
import numpy as np

import keras_dp
from fuzz import builders
from fuzz import runner

SENSITIVITY_TOLERANCE = 1e-3  # Relative, plus the same absolute (in units of C).
EPSILON_TOLERANCE = 1e-3  # Relative.


@dataclasses.dataclass(frozen=True)
class Finding:
    oracle: str  # "sensitivity", "unrecorded", "accounting", "nonfinite", "fidelity",
    # "unrefused"
    detail: str


def _changed(probe, unit_filter=None):
    return any(not np.array_equal(probe.before[u], probe.weights[u])
               for u in probe.before if unit_filter is None or u in unit_filter)


def _applied(probe):
    """Whether the batch ended a logical step: an update, or a step recorded
    (at noise 0 an empty Poisson batch moves nothing)."""
    return _changed(probe) or probe.ledger_steps != probe.ledger_before


def _groups(trace, boundaries):
    """{probe index: the probes of its logical step} for the boundary probes:
    the physical batches its optimizer took since its last boundary, but
    for those a traced step refused and that changed nothing, or that were
    discarded (they joined no logical step)."""
    closed = {}  # probe index -> optimizers with no open logical step before it
    for kind, index, detail in trace.events:
        if kind == "closed":
            closed.setdefault(index, set()).add(detail)
    pending, groups = {}, {}
    for i, probe in enumerate(trace.probes):
        for optimizer in closed.get(i, ()):
            pending.pop(optimizer, None)
        if probe.refused and i not in boundaries:
            continue
        pending.setdefault(probe.optimizer, []).append(i)
        if i in boundaries:
            groups[i] = pending.pop(probe.optimizer)
    return groups


def _divisor(program, trace, parts):
    first, last = trace.probes[parts[0]].tag, trace.probes[parts[-1]].tag
    k = program.accumulation
    if "expected" in first:  # Sampled: the expected batch, never the realised one.
        return k * first["expected"]
    if program.microbatches:
        return k * program.microbatches
    # Fixed batches: k times the last physical batch's rows (a step opened
    # outside fit and closed by a sampled batch: the opener's rows).
    return k * last.get("rows", first["rows"])


def _delta(probe):
    return np.concatenate([probe.weights[u] - probe.before[u] for u in sorted(probe.before)])


def sensitivity_findings(program, d, dz):
    if len(d.probes) != len(dz.probes):
        return []  # The runs took different paths (a refusal in one): nothing to compare.
    # The noise-0 runs' own steps: the run with noise may refuse what they
    # do not (adaptive clipping's count noise), and take another path.
    boundaries = {i for i, (a, b) in enumerate(zip(d.probes, dz.probes))
                  if _applied(a) or _applied(b)}
    findings = []
    for i, parts in sorted(_groups(dz, boundaries).items()):
        a, b = d.probes[i], dz.probes[i]
        if not (_changed(a) or _changed(b)):
            continue
        if b.ledger_steps == b.ledger_before:
            findings.append(Finding("unrecorded", f"probe {i}: an update the ledger did not "
                                                  "record (noise 0, D + z)"))
            continue
        clip_d, clip_dz = d.probes[parts[0]].clip, dz.probes[parts[0]].clip
        if not math.isclose(clip_d, clip_dz, rel_tol=1e-6):
            break  # Adaptive C diverged: later steps are not neighbours.
        moved = (_delta(b) * _divisor(program, dz, parts)
                 - _delta(a) * _divisor(program, d, parts))
        moved = float(np.linalg.norm(moved))
        bound = b.sensitivity * clip_dz
        if moved > bound * (1 + SENSITIVITY_TOLERANCE) + SENSITIVITY_TOLERANCE * clip_dz:
            findings.append(Finding("sensitivity", f"probe {i}: z moved the clipped sum by "
                                    f"{moved / clip_dz:.3f} C; recorded {b.sensitivity:g} C"))
    return findings


def _gaussian(sigma, sensitivity=1.0):
    return dp_accounting.GaussianDpEvent(sigma / sensitivity)


def _banded_sensitivity(bands, participation):
    """Sensitivity of C x for a banded Toeplitz strategy C, z in step t
    `participation[t]` times: the larger of z's gradients all aligned or
    alternating in sign (each a lower bound of the worst case)."""
    c = np.asarray(keras_dp.BandedMF(bands=bands).coefficients, np.float64)
    steps = len(participation)
    matrix = np.zeros((steps, steps))
    for j, value in enumerate(c[:steps]):
        matrix += np.diag(np.full(steps - j, value), -j)
    u = np.asarray(participation, np.float64)
    signs = np.where(np.arange(steps) % 2 == 0, 1.0, -1.0)
    return max(np.linalg.norm(matrix @ u), np.linalg.norm(matrix @ (u * signs)))


def true_events(program, trace):
    """dp_accounting events of every applied update that z could influence
    and that the released weights depend on, and the updates seen."""
    probes, release = trace.probes, set(trace.release_units)
    updates = {i for i, p in enumerate(probes) if _changed(p)}
    dead = set()
    starts = {}
    for kind, index, slot in trace.events:
        if kind == "checkpoint":
            starts[slot] = index
        elif kind == "restored" and slot in starts:
            dead |= set(range(starts.pop(slot), index))
    draws, passes, cyclic, banded, events = {}, {}, {}, {}, []
    for i, parts in sorted(_groups(trace, updates).items()):
        if i in dead or not release & set(probes[i].before):
            continue
        tags = [probes[j].tag for j in parts]
        sigma = probes[parts[0]].sigma
        kinds = {t["kind"] for t in tags}
        z = sum(t.get("z", 0) for t in tags)
        if kinds == {"cyclic"}:
            key = (tags[0]["segment"], sigma, tags[0]["q"], tags[0]["bands"])
            cyclic[key] = cyclic.get(key, 0) + 1
        elif kinds == {"pass"}:
            passes.setdefault(tags[0]["pass"], []).extend(
                (probes[j].sigma, t["batch"], t["batches"]) for j, t in zip(parts, tags))
        elif program.bands and kinds == {"arbitrary"}:
            banded.setdefault((tags[0].get("action"), sigma), []).append(z)
        elif z:
            events.append(_gaussian(sigma, z))  # z surely in: a full release, z times.
        elif "poisson" in kinds:
            tag = next(t for t in tags if t["kind"] == "poisson")
            draws.setdefault(tag["draw"], (tag["q"], []))[1].append(sigma)
    for (q, sigmas) in draws.values():
        # One draw used by several steps: one sampled release of all their noise.
        combined = sum(s ** -2 for s in sigmas) ** -0.5
        events.append(dp_accounting.PoissonSampledDpEvent(q, _gaussian(combined)))
    for batches in passes.values():
        seen = {b for _, b, _ in batches}
        if len(seen) == batches[0][2]:  # A whole pass: z was in one of its steps.
            events.append(_gaussian(max(s for s, _, _ in batches)))
    for (_, sigma, q, bands), steps in cyclic.items():
        events.append(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, _gaussian(sigma)), math.ceil(steps / bands)))
    for (_, sigma), participation in banded.items():
        if any(participation):
            events.append(_gaussian(sigma, _banded_sensitivity(program.bands, participation)))
    return events, len(updates)


def epsilon_of(events, delta=runner.DELTA):
    if not events:
        return 0.0
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(events))
    return accountant.get_epsilon(delta)


def accounting_findings(program, trace):
    findings = []
    for i, probe in enumerate(trace.probes):
        if not all(np.all(np.isfinite(w)) for w in probe.weights.values()):
            findings.append(Finding("nonfinite", f"probe {i}: weights are not finite and "
                                                 "training went on"))
            break
    for i, probe in enumerate(trace.probes):
        if _changed(probe) and probe.ledger_steps == probe.ledger_before:
            findings.append(Finding("unrecorded", f"probe {i}: an update the ledger did not "
                                                  "record"))
            break
    if math.isnan(trace.reported):
        return findings
    events, _ = true_events(program, trace)
    truth = epsilon_of(events)
    if trace.reported < truth * (1 - EPSILON_TOLERANCE):
        findings.append(Finding("accounting", f"reported epsilon {trace.reported:.4f} < "
                                              f"{truth:.4f} from what ran"))
    return findings


def refusal_findings(program, trace):
    """A step applied that keras-dp must have refused before any weight changed."""
    for i, probe in enumerate(trace.probes):
        reason = probe.tag.get("must_refuse") or (
            program.subclass == "compute_loss" and "a compute_loss override") or (
            set(program.layers) & set(builders.KEEPING_LAYERS) and (
                "a layer keeping the batch in a weight"))
        if reason and _applied(probe):
            return [Finding("unrefused", f"probe {i}: applied despite {reason}")]
    return []


@dataclasses.dataclass
class Result:
    findings: list
    refusals: list
    probes: int
    reported: float
    truth: float

    def __str__(self):
        lines = [f"{f.oracle}: {f.detail}" for f in self.findings] or ["no finding"]
        return "\n".join(lines)


def check(program):
    """Runs `program` three times (noise: D + z; noise 0: D, then D + z) and
    returns the oracles' `Result`."""
    with tempfile.TemporaryDirectory() as directory:
        noisy = runner.Run(program, True, True, directory).run()
        d = runner.Run(program, False, False, directory).run()
        dz = runner.Run(program, True, False, directory, reference=d).run()
    findings = accounting_findings(program, noisy) + refusal_findings(program, noisy)
    from fuzz import fidelity  # It reports Findings of this module.
    findings += fidelity.findings(program)
    findings += sensitivity_findings(program, d, dz)
    seen, unique = set(), []
    for finding in findings:
        if finding.oracle not in seen:
            seen.add(finding.oracle)
            unique.append(finding)
    events, _ = true_events(program, noisy)
    return Result(unique, [e[2] for e in noisy.events if e[0] == "refused"],
                  len(noisy.probes), noisy.reported, epsilon_of(events))
