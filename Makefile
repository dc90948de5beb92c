# One command each: `make demo` installs and runs the main job; `make test` installs and runs the tests.
# Everything goes into a local virtual environment (.venv). torch is installed first and pinned, so that
# packages depending on plain `torch` (tilelang, xgrammar) do not pull a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
export TILELANG_CACHE_DIR ?= $(CURDIR)/.cache/tilelang
export TRITON_CACHE_DIR ?= $(CURDIR)/.cache/triton

.PHONY: install demo test lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test,codegen]" $(TORCH)
	touch $@

demo: install
	$(BIN)/deepinfer run

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
