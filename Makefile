# keras-dp: `make demo` trains a private Fashion-MNIST CNN; `make test` runs the tests.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
DATA_DIR ?= /usr/share/datasets/fashion-mnist
PYTEST_ARGS ?=

# Run apt-get as root, through sudo when available, else as is (and fail clearly).
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || ! command -v sudo >/dev/null 2>&1 || echo sudo)

.PHONY: install install-python install-data link-keras-data demo test test-all bench clean

install: install-python install-data link-keras-data

install-python:
	$(PIP) install --quiet -e '.[test,hub]'

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

# TensorFlow turns oneDNN on or off depending on the CPU: test both ways.
PYTEST_WITH_AND_WITHOUT_ONEDNN = for onednn in 0 1; do \
	  echo "== pytest with TF_ENABLE_ONEDNN_OPTS=$$onednn"; \
	  TF_ENABLE_ONEDNN_OPTS=$$onednn $(PYTHON) -m pytest tests $(1) $(PYTEST_ARGS) || exit 1; \
	done

test: install
	@$(call PYTEST_WITH_AND_WITHOUT_ONEDNN)

# Also the tests marked slow.
test-all: install
	@$(call PYTEST_WITH_AND_WITHOUT_ONEDNN,-m "slow or not slow")

bench: install-python
	$(PYTHON) benchmarks/speed.py

clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
