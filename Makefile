# Two commands for a new user: `make run` generates two completions with the shipped model on 2 Ray ranks,
# `make test` runs the test suite. Both create (or reuse) .venv and install what they need.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# With CUDA, install your torch into .venv first and set TORCH_SPEC= (empty: keep it).
TORCH_SPEC ?= torch==2.13.0
# Where torch comes from. Empty: pip's configured index (PyPI's Linux torch==2.13.0 is the CUDA build, several
# GB); TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build from PyTorch's index.
TORCH_INDEX ?=
PROMPT ?= To be, or not to be
RANKS ?= 2

.PHONY: venv bench-deps run test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if [ -n "$(TORCH_SPEC)" ]; then echo "$(BIN)/pip install -q $(TORCH_SPEC) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),(pip's configured index))"; \
	  $(BIN)/pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); fi
	$(BIN)/pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

run: venv
	$(BIN)/moeray generate --ranks $(RANKS) --max-tokens 48 "$(PROMPT)" "def fibonacci(n):"

test: venv
	$(BIN)/python -m pytest tests

# what the benchmarks need beyond the tests (matplotlib for bench/heatmap.py, aiohttp for bench/load.py)
bench-deps: venv
	$(BIN)/pip install -q -e ".[test,bench]"

clean:
	rm -rf $(VENV)
