# keras-dp: `make demo` trains a private Fashion-MNIST CNN; `make test` runs the tests.
PYTHON ?= python3
# pip as root (the fresh machines here) warns on every install; nothing to fix.
PIP ?= PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip
DATA_DIR ?= /usr/share/datasets/fashion-mnist
PYTEST_ARGS ?=

# Run apt-get as root, through sudo when available, else as is (and fail clearly).
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || ! command -v sudo >/dev/null 2>&1 || echo sudo)

.PHONY: install install-python install-data link-keras-data demo test test-all lint bench clean fuzz

install: install-python install-data link-keras-data

install-python:
	$(PIP) install --quiet -e '.[test,hub,tuner]'

install-data:
	@if [ -d "$(DATA_DIR)" ]; then \
	  echo "Fashion-MNIST found in $(DATA_DIR)"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "warning: $(DATA_DIR) is missing and apt-get is unavailable; install the"; \
	  echo "package dataset-fashion-mnist or pass --data_dir to the example."; \
	elif [ "$$(id -u)" -ne 0 ] && [ -z "$(SUDO)" ]; then \
	  echo "warning: $(DATA_DIR) is missing; as root run:"; \
	  echo "  apt-get update && apt-get install -y dataset-fashion-mnist"; \
	else \
	  echo "Installing the Debian package dataset-fashion-mnist"; \
	  $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y dataset-fashion-mnist \
	  || echo "warning: could not install dataset-fashion-mnist; the dataset tests will skip."; \
	fi

# keras.datasets.fashion_mnist.load_data() reads its cache first: point it at
# the Debian files (the same files it would download), so it works offline.
KERAS_DATA = $${KERAS_HOME:-$$HOME/.keras}/datasets/fashion-mnist
link-keras-data: install-data
	@if [ -d "$(DATA_DIR)" ]; then \
	  mkdir -p "$(KERAS_DATA)" && ln -sf "$(DATA_DIR)"/*.gz "$(KERAS_DATA)"/; \
	fi

demo: install
	$(PYTHON) examples/fashion_mnist.py

# TensorFlow turns oneDNN on or off depending on the CPU: test both ways. The
# two runs go side by side (most tests keep one core busy, tracing small
# models), each into its own log, printed when both are done. Every
# kernel-level check (per-example gradients, clipping engines, noise,
# non-finite values, layers) runs in both, and so does any module not marked,
# so a new test file is checked both ways by default; the parametrized cases
# of such a test are shared between the runs (`--onednn-run`, in
# tests/conftest.py), so each value of each parameter runs under both
# settings and each case once, and the tests of modules marked `alternating`
# (whole private steps, whose kernel-level parts the others check) run in
# turns (in `make test`; `make test-all` runs every
# case in both). Two kinds of test run once, one kind in each
# run so that the two take about as long: tests marked `program` (whole
# examples, benchmarks, commands, the guides' code) with oneDNN on,
# TensorFlow's default on this CPU and on most servers, and tests marked
# `once` (accounting, the ledger, callbacks, data sampling, the command line,
# docs, checkpoints, distribution plumbing, and whole private steps whose
# kernel-level parts the other modules check both ways) with oneDNN off,
# except the modules also marked `with_onednn_on`, which run with it on so
# that the single process of the oneDNN-off run, slowed while the other's
# worker processes hold the cores, ends about when the other does. Each
# run's kernels take one thread (TF_NUM_INTRAOP_THREADS=1): two runs of two
# threads each would share the 2 cores by preemption. Each run keeps its
# temporary files apart (--basetemp): pytest deletes all but the newest
# three sessions' folders, so other sessions on the machine could delete a
# run's files while a test reads them.
# $(1): the marker expression of the tests to run; $(2): non-empty to share
# the parametrized cases between the runs (make test-all runs all in both).
TEST_LOGS = build/test-logs
PYTEST_WITH_AND_WITHOUT_ONEDNN = mkdir -p $(TEST_LOGS) build/test-tmp; \
	for onednn in 0 1; do \
	  if [ $$onednn = 0 ]; then markers="($(1)) and not (program or with_onednn_on)"; \
	  else markers="($(1)) and (program or with_onednn_on or not once)"; fi; \
	  (TF_ENABLE_ONEDNN_OPTS=$$onednn TF_NUM_INTRAOP_THREADS=1 $(PYTHON) -m pytest tests -p no:cacheprovider \
	     -m "$$markers" $(if $(2),--onednn-run=$$onednn) --basetemp=build/test-tmp/onednn-$$onednn \
	     $(PYTEST_ARGS) > $(TEST_LOGS)/onednn-$$onednn.log 2>&1; \
	   echo $$? > $(TEST_LOGS)/onednn-$$onednn.status) & \
	done; \
	wait; status=0; \
	for onednn in 0 1; do \
	  echo "== pytest with TF_ENABLE_ONEDNN_OPTS=$$onednn"; \
	  cat $(TEST_LOGS)/onednn-$$onednn.log; \
	  [ "$$(cat $(TEST_LOGS)/onednn-$$onednn.status)" = 0 ] || status=1; \
	done; \
	exit $$status

test: install
	@$(call PYTEST_WITH_AND_WITHOUT_ONEDNN,not slow,shared)

# Also the tests marked slow.
test-all: install
	@$(call PYTEST_WITH_AND_WITHOUT_ONEDNN,slow or not slow)

# The linter, configured in pyproject.toml: nobody tidies by hand.
LINTED = keras_dp tests benchmarks examples
lint: install-python
	$(PYTHON) -m ruff check $(LINTED)

bench: install-python
	$(PYTHON) benchmarks/speed.py

clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# A long fuzz campaign (issue 44): PROGRAMS random programs from SEED, or
# fewer if MINUTES (no limit by default) run out first.
fuzz: install
	cd tests && TF_CPP_MIN_LOG_LEVEL=3 TF_NUM_INTRAOP_THREADS=1 $(PYTHON) -m fuzz.campaign --programs $${PROGRAMS:-300} --seed $${SEED:-0} $${MINUTES:+--minutes $$MINUTES}
