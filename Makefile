# The README's two commands. Each builds .venv by itself on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench docs clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[all,dev]'
	touch $(STAMP)

# `make demo` trains PyTorch; `make demo FRAMEWORK=jax` (numpy, tf, keras, jax) another one
demo: $(STAMP)
	$(BIN)/python -m pitstop.cli demo $(if $(FRAMEWORK),--framework $(FRAMEWORK))

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

lint: $(STAMP)
	$(BIN)/ruff check pitstop tests benchmarks examples
	$(BIN)/mypy pitstop/core

docs: $(STAMP)
	$(BIN)/mkdocs build --strict   # the static site, offline, into site/

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_save.py

clean:
	rm -rf $(VENV) build site *.egg-info
