"""Test setup: quiet TensorFlow logs, import keras_dp from this checkout, and
the shared helpers of this folder (small_models, brute_force) from any subfolder,
share the parametrized cases of the tests that run in both of `make test`'s
runs between them, collect garbage after each test, and list the tests over
10 s with their wall and CPU times."""

import collections
import gc
import os
import sys
import time

import pytest

# Must be set before TensorFlow is first imported.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
for path in (TESTS_DIR, REPO_ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)



def pytest_addoption(parser):
    parser.addoption(
        "--onednn-run", choices=["0", "1"], default=None,
        help="make test's run (TF_ENABLE_ONEDNN_OPTS of this run): of the parametrized "
             "cases of each test that runs in both runs (not marked once or program), "
             "run every other one")


# The tests that run in both of `make test`'s runs check kernels under either
# oneDNN setting; their parametrized cases are shared between the runs as a
# checkerboard (by the parity of the sum of the cases' parameter indices), so
# each case runs once and each value of each parameter, of two or more, runs
# under both settings (a grid of engines by XLA: ghost without XLA and
# vectorized with XLA in one run, the other two in the other). Tests without
# parameters run in both, but in modules marked `alternating` (whole private
# steps, whose kernel-level parts the others check), which the runs take in
# turns.
def pytest_collection_modifyitems(config, items):
    run = config.getoption("--onednn-run")
    if run is None:
        return
    turns = collections.Counter()  # Unparametrized alternating tests, per module.
    others = [item for item in items if _in_the_other_run(item, int(run), turns)]
    if others:
        config.hook.pytest_deselected(items=others)
        dropped = set(others)
        items[:] = [item for item in items if item not in dropped]


def _in_the_other_run(item, run, turns):
    if item.get_closest_marker("once") or item.get_closest_marker("program"):
        return False
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        return sum(callspec.indices.values()) % 2 != run
    if not item.get_closest_marker("alternating"):
        return False
    turn = turns[item.module.__name__]
    turns[item.module.__name__] += 1
    return turn % 2 != run


# A test that takes much longer than usual is either working (its CPU time
# grew too) or waiting (on a lock, a thread, the other `make test` run): the
# summary lists each test over 10 s with both times, so that a stall in a
# slow run can be told apart from work. Process CPU counts every thread.
_LONG_SECONDS = 10.0
_long_tests = []


def _timed(phase):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item):
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if wall > _LONG_SECONDS:
            _long_tests.append((f"{item.nodeid} ({phase})", wall, cpu))
    return hook


# A tf.data iterator that dies in Python's cyclic garbage collector, long
# after its test, can hold the interpreter for up to a minute: its destructor
# joins the pipeline's autotuning thread, which, seen under make test, waits
# out its period instead of waking (stalls of 13-62 s of wall time with no
# CPU time, in a later test). Collecting at each test's end frees such an
# iterator while it is young; freezing what survives keeps each collection
# to the objects of one test (about 7 s in all per run, against 60-100 s of
# stalls and of full collections over an ever larger heap).
@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    gc.collect()
    gc.freeze()


pytest_runtest_setup = _timed("setup")  # Module fixtures: the distributed workers.
pytest_runtest_call = _timed("call")


def pytest_terminal_summary(terminalreporter):
    for nodeid, wall, cpu in _long_tests:
        terminalreporter.write_line(f"over {_LONG_SECONDS:.0f} s: {nodeid}: "
                                    f"{wall:.1f} s wall, {cpu:.1f} s CPU")
