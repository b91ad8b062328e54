# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

demo: $(STAMP)
	$(BIN)/runlane demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -n 2 --dist loadgroup

lint: $(STAMP)
	$(BIN)/ruff check .

	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/lifecycle.py --write docs/benchmarks.md

clean:
	rm -rf $(VENV) runlane-demo .pytest_cache .mypy_cache .ruff_cache .hypothesis
