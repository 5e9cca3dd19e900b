# Two commands on a fresh machine: `make run` and `make test`.
# Both create .venv on first use; the stamp file keeps later calls from reinstalling.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
FLOWER := $(shell sed -n 's/^ *"\(flwr\[simulation\][^"]*\)".*/\1/p' pyproject.toml)

.PHONY: run lint test bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# The CPU wheel of torch first: an unpinned torch would pull gigabytes of CUDA packages.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	# the newest Flower pyproject's pin allows, also in a .venv made under an older pin
	$(BIN)/pip install --upgrade "$(FLOWER)"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m simulations.run $(ARGS)

# `make test` lints first (ruff check, ruff format --check; pyproject.toml's [tool.ruff]).
# Two pytest-xdist workers: the deployment and Flower tests wait on subprocesses while the other worker runs.
# One test or file: make test PYTEST_ARGS="-n 0 tests/test_coreset.py"
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m simulations.bench $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
