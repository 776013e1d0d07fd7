# Two commands for a new user: `make run` serves the shipped model through 2 Ray ranks,
# `make test` runs the test suite. Both create (or reuse) .venv and install what they need.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU wheel by default; with CUDA, install your torch into .venv first and set TORCH_SPEC= (empty).
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= To be, or not to be
RANKS ?= 2

.PHONY: venv run test bench-quick clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

run: venv
	$(BIN)/moeray generate --ranks $(RANKS) --max-tokens 48 "$(PROMPT)" "def fibonacci(n):"

test: venv
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV)
