# ftq: `make up` installs and starts the service; `make test` runs the whole test suite.
#
# Both create .venv when it is missing, install torch first when none is there (pip picks
# the CPU build on a box without CUDA wheels; a GPU box installs its own torch beforehand),
# then ftq itself in editable mode: `make up` with the service's dependencies only (plus
# SERVICE_EXTRAS, e.g. `make up SERVICE_EXTRAS=tracking,qlora`), `make test` with the dev
# extras (test tooling, browsers' driver, MLflow's server). Each install is redone only when
# pyproject.toml changes.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ftq-installed
DEV_STAMP := $(VENV)/.ftq-dev-installed
SERVICE_EXTRAS ?=
TORCH_VERSION ?= 2.13.0
# llama-cpp-python (dev extra) compiles llama.cpp when pip has no wheel: CPU only, portable, no
# BLAS/OpenMP/tools/tests; built once, then pip's wheel cache serves every later install.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF

.PHONY: install install-dev up test test-fast services browser

install: $(STAMP)
install-dev: $(DEV_STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e '.$(if $(SERVICE_EXTRAS),[$(SERVICE_EXTRAS)])'
	@touch $(STAMP)

$(DEV_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	CMAKE_ARGS="$${CMAKE_ARGS:-$(LLAMA_CMAKE_ARGS)}" CMAKE_BUILD_PARALLEL_LEVEL="$${CMAKE_BUILD_PARALLEL_LEVEL:-2}" $(PY) -m pip install -e '.[dev]'
	@touch $(DEV_STAMP) $(STAMP)

up: install
	$(VENV)/bin/ftq up

services:
	scripts/services.sh

browser:
	scripts/browser.sh

# pytest exits 5 when it collected no test: that fails `make test` like any other non-zero code
# (pytest-xdist keeps that exit code). TEST_WORKERS processes share the suite, a module per worker
# at a time (--dist loadscope), so a module's stack starts once: most of the suite waits on
# subprocesses (servers, workers, trainers), so three workers keep two cores busy. TEST_WORKERS=0
# runs it in one process.
TEST_WORKERS ?= 3
test: install-dev services browser
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope --durations=25

# The inner loop: no slow or integration tests, no services (under two minutes on 2 cores).
test-fast: install-dev
	$(PY) -m pytest -m "not slow and not integration"
