# Two commands: `make run` trains alphabet_sort on this machine, `make test` lints (ruff), builds the docs
# (mkdocs, strict: a broken link fails) and runs the tests.
# Each creates .venv and installs what is missing. TORCH pins the CPU-compatible torch
# (GPU nodes: docs/gpu.md; vLLM 0.31 pins the same torch, built for CUDA).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test setup

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	@# The code sandbox (rlactors.envs.sandbox) runs programs under bubblewrap; as root, install it
	@# from Debian where it is missing (elsewhere its tests skip, saying so).
	command -v bwrap >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq bubblewrap; } || true
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) examples/alphabet_sort/run.py $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mkdocs build --strict
	$(PY) -m pytest -q --durations=20 $(ARGS)
