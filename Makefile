# The README's two commands are `make demo` and `make test`; both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint format clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch; a plain `torch` would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[server,dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python -m trainer demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
