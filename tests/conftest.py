"""Test setup: quiet TensorFlow logs, import keras_dp from this checkout, and
the shared helpers of this folder (small_models, brute_force) from any subfolder,
collect garbage after each test, and list the tests over 10 s with their wall
and CPU times."""

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
