# The two commands of the README: `make demo` (set up, then train on a local
# cluster) and `make test` (set up, then run the tests). Both create their
# own virtual environment in .venv and install every package they need.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WORKERS ?= 2
SHARDS ?= 2
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py
	PYTHON=$(PYTHON) bash scripts/install_debian_packages.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/keras-geeps build-ops
	touch $@

demo: setup
	$(BIN)/keras-geeps launch --workers $(WORKERS) --shards $(SHARDS) -- \
	  $(BIN)/python examples/fashion_mnist_fit.py

test: setup
	$(BIN)/keras-geeps build-ops
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 tests $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 -m "not slow" tests

clean:
	rm -rf $(VENV) keras_geeps/_lib *.egg-info build
