"""A fuzz campaign: random programs from one seed, each finding reduced to a
minimal program and printed as runnable Python, then one summary line.

    python -m fuzz.campaign --programs 300 --seed 0      (from tests/; `make fuzz`)
"""

import argparse
import collections
import dataclasses
import os
import sys
import time
import traceback

from fuzz import grammar
from fuzz import oracles

# The reductions tried on a program with a finding, simplest first.
_OPTIONS = {"jit": False, "adaptive": False, "accumulation": 1, "microbatches": 0,
            "bands": 0, "subclass": "", "sigma": 1.0, "clip": 1.0, "n": 40}
_ACTION_OPTIONS = {"callback": (), "epochs": 1, "transforms": (), "batch_maps": (),
                   "reseed": False, "kind": "train_on_batch", "steps": 1}


def _reductions(program):
    actions = program.actions
    for i in range(len(actions)):
        if len(actions) > 1:
            yield dataclasses.replace(program, actions=actions[:i] + actions[i + 1:])
    for i in range(len(program.layers)):
        layers = program.layers[:i] + program.layers[i + 1:]
        yield dataclasses.replace(program, layers=layers,
                                  nan_rows=program.nan_rows if "impute_batch_mean" in layers
                                  else 0)
    for name, value in _OPTIONS.items():
        if getattr(program, name) != value:
            yield dataclasses.replace(program, **{name: value})
    for i, action in enumerate(actions):
        for name, value in _ACTION_OPTIONS.items():
            current = getattr(action, name, value)
            if current != value:
                yield _with_action(program, i, dataclasses.replace(action, **{name: value}))
            if name == "transforms" and len(current) > 1:
                for j in range(len(current)):
                    yield _with_action(program, i, dataclasses.replace(
                        action, transforms=current[:j] + current[j + 1:]))
        if isinstance(action, grammar.Loop) and len(action.z_steps) > 1:
            for j in range(len(action.z_steps)):
                yield _with_action(program, i, dataclasses.replace(
                    action, z_steps=action.z_steps[:j] + action.z_steps[j + 1:]))


def _with_action(program, i, action):
    return dataclasses.replace(program, actions=program.actions[:i] + (action,)
                               + program.actions[i + 1:])


def _still_finds(program, oracle):
    try:
        return any(f.oracle == oracle for f in oracles.check(program).findings)
    except Exception:  # noqa: BLE001  A reduction the harness cannot run is not kept.
        return False


def minimize(program, oracle, budget=30):
    """A smaller program with a finding of the same oracle (greedy, at most `budget` runs)."""
    changed = True
    while changed and budget > 0:
        changed = False
        for candidate in _reductions(program):
            if budget <= 0:
                break
            budget -= 1
            if _still_finds(candidate, oracle):
                program, changed = candidate, True
                break
    return program


def ingredients(program):
    """What a program is made of, in a few words: its family within an oracle."""
    words = set()
    for action in program.actions:
        name = type(action).__name__
        if isinstance(action, grammar.Fit):
            name += f"({action.sampling}" + (f", {action.callback[0]})" if action.callback
                                             else ")")
        elif isinstance(action, grammar.FitPipeline):
            kinds = ",".join(sorted({t.partition(":")[0] for t in action.transforms})
                             + [f"map {m}" for m in action.batch_maps])
            name += f"({'poisson' if action.poisson else 'batched'}" + (
                ", reseed" if action.reseed else "") + (f", {kinds})" if kinds else ")")
        elif isinstance(action, grammar.Loop):
            name += f"({action.kind})"
        words.add(name)
    for option in ("adaptive", "subclass", "jit"):
        if getattr(program, option):
            words.add(option)
    if program.accumulation > 1:
        words.add("accumulation")
    if program.microbatches:
        words.add("microbatches")
    if program.bands:
        words.add("BandedMF")
    words |= {layer for layer in program.layers if layer in ("batch_mean_mix",
                                                             "impute_batch_mean")}
    return " + ".join(sorted(words))


def run(programs, seed, budget, out=sys.stdout, minutes=None):
    """Checks up to `programs` programs (none started after `minutes`), prints
    a line per program, each new family's minimal program, and a summary."""
    families = collections.Counter()
    minimized = {}  # (oracle, ingredients of the raw program) -> minimal program
    counts = collections.Counter()
    start = time.perf_counter()
    for number in range(programs):
        if minutes is not None and time.perf_counter() - start > 60 * minutes:
            break
        program = grammar.generate((seed * 1_000_003 + number) % 2 ** 32)  # numpy seeds: 32 bits.
        began = time.perf_counter()
        counts["run"] += 1
        try:
            result = oracles.check(program)
        except Exception:  # noqa: BLE001  The harness's own failure: print and go on.
            counts["harness errors"] += 1
            print(f"# harness error on {program!r}\n{traceback.format_exc()}", file=out)
            continue
        counts["with a refusal"] += bool(result.refusals)
        counts["with a finding" if result.findings else "without finding"] += 1
        print(f"# program {number} (seed {program.seed}): "
              f"{','.join(f.oracle for f in result.findings) or 'no finding'}, "
              f"{len(result.refusals)} refusals, {time.perf_counter() - began:.0f} s: "
              f"{ingredients(program)}", file=out, flush=True)
        for finding in result.findings:
            key = (finding.oracle, ingredients(program))
            if key not in minimized:
                small = minimize(program, finding.oracle, budget)
                minimized[key] = small
                print(f"# finding: {finding.oracle}: {finding.detail}\n"
                      f"# family: {finding.oracle}: {ingredients(small)}\n"
                      f"{grammar.source(small)}", file=out, flush=True)
            families[f"{finding.oracle}: {ingredients(minimized[key])}"] += 1
    by_family = "; ".join(f"{name} x{count}" for name, count in families.most_common())
    tally = ", ".join(f"{name} {counts[name]}" for name in (
        "with a refusal", "without finding", "with a finding", "harness errors"))
    print(f"programs {counts['run']} ({tally}), findings {sum(families.values())} by family: "
          f"{by_family or 'none'} ({time.perf_counter() - start:.0f} s)", file=out, flush=True)
    return families


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=int(os.environ.get("PROGRAMS", 50)))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minimize_budget", type=int, default=30,
                        help="runs tried to reduce each new family's first program")
    parser.add_argument("--minutes", type=float, default=None,
                        help="start no program after this many minutes")
    args = parser.parse_args(argv)
    run(args.programs, args.seed, args.minimize_budget, minutes=args.minutes)


if __name__ == "__main__":
    main()
