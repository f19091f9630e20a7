# ftq: `make up` installs and starts the service; `make test` runs the whole test suite.
#
# Both create .venv when it is missing and install from the lock, requirements/lock.txt (pip's
# constraints: every dependency at the version the suite passed with; `make lock` re-resolves it
# from pyproject.toml's ranges). torch comes first, unless the venv has one (a GPU box may bring
# its own): the CPU build on a machine with no NVIDIA driver, PyPI's CUDA build where there is one,
# or whatever TORCH_INDEX_URL names (scripts/install-torch.sh, with pip). Then ftq in editable mode,
# with uv (UV below): `make up`
# with the service's dependencies plus SERVICE_EXTRAS (e.g. `make up SERVICE_EXTRAS=tracking,qlora`,
# also into an existing venv), `make test` with the dev extras (test tooling, browsers' driver,
# MLflow's server, llama.cpp's bindings, lm-eval). An install is redone when pyproject.toml or the lock
# changes, or for extras not installed yet.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
LOCK := requirements/lock.txt
SERVICE_EXTRAS ?=
comma := ,
STAMP := $(VENV)/.ftq-installed$(if $(SERVICE_EXTRAS),-$(subst $(comma),-,$(SERVICE_EXTRAS)))
DEV_STAMP := $(VENV)/.ftq-dev-installed
TORCH_VERSION ?= 2.13.0
# uv installs from the lock in ~15 s where pip took ~80 s (a fresh venv on 2 cores, same packages:
# `pip freeze` of both venvs is identical); uv itself comes from pip at the locked version. torch
# stays pip's (scripts/install-torch.sh: pip finds the local CPU build, uv does not look there).
UV := $(VENV)/bin/uv
# --compile-bytecode: uv, unlike pip, writes no .pyc at install, and where PYTHONDONTWRITEBYTECODE is
# set (this machine's image sets it) no process writes them later either, so every Python process
# compiled transformers, peft, FastAPI, Celery, ... from source at each start: a tiny trainer run
# took 22.6 s of CPU instead of 14.2 s, and the suite starts hundreds of processes. COMPILE does the
# same for ftq's own packages (editable, so never compiled by an installer; up-to-date files are
# skipped, so it runs before every test run and `ftq up`).
PIP_INSTALL := $(UV) pip install --compile-bytecode --python $(PY) -c $(LOCK)
COMPILE := $(PY) -m compileall -q -j 0 api cli core trainer worker migrations bench

# llama-cpp-python (dev extra: the GGUF export tests load exports in real llama.cpp) has no Linux
# wheel on PyPI, so pip compiles llama.cpp: ~7 min on 2 cores, most of a cold machine's install.
# scripts/llama-wheel.sh builds the locked version once per machine into WHEELHOUSE (outside pip's
# cache, so clearing that cache does not bring the compile back) and says so while it builds.
WHEELHOUSE ?= $(HOME)/.cache/ftq/wheels
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF

.PHONY: install install-dev up test test-fast test-latest services browser lock

install: $(STAMP)
install-dev: $(DEV_STAMP)

$(VENV)/.venv-created:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@touch $@

$(UV): $(LOCK) | $(VENV)/.venv-created
	$(PY) -m pip install -q -c $(LOCK) uv
	@touch $@

$(STAMP): pyproject.toml $(LOCK) | $(UV)
	@scripts/install-torch.sh $(PY) $(TORCH_VERSION) $(LOCK)
	$(PIP_INSTALL) -e '.$(if $(SERVICE_EXTRAS),[$(SERVICE_EXTRAS)])'
	@$(COMPILE)
	@touch $(STAMP)

$(DEV_STAMP): pyproject.toml $(LOCK) | $(UV)
	@scripts/install-torch.sh $(PY) $(TORCH_VERSION) $(LOCK)
	@CMAKE_ARGS="$${CMAKE_ARGS:-$(LLAMA_CMAKE_ARGS)}" scripts/llama-wheel.sh $(PY) $(LOCK) $(WHEELHOUSE)
	$(PIP_INSTALL) --find-links $(WHEELHOUSE) -e '.[dev]'
	@touch $(DEV_STAMP) $(VENV)/.ftq-installed

up: install
	@$(COMPILE)
	$(VENV)/bin/ftq up

services:
	scripts/services.sh

browser:
	scripts/browser.sh

# pytest exits 5 when it collected no test: that fails `make test` like any other non-zero code
# (pytest-xdist keeps that exit code). TEST_WORKERS processes share the suite, a module per worker
# at a time (--dist loadfile), so a module's stack or module-scoped launch starts once: loadscope
# would hand each test class to a worker of its own, and every worker that got a class of a module
# started that module's fixtures again (test_distributed_runs: 93 s of tests alone, 210 s on 2
# loadscope workers). The long modules go out first (tests/conftest.py's HEAVY_FIRST sets the
# collection order; --no-loadscope-reorder keeps it instead of xdist's most-tests-first), so the
# run does not end on one of them alone. Most of the suite waits on subprocesses (servers,
# workers, trainers), so three workers keep two cores busy. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3
test: install-dev services browser
	@$(COMPILE)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The inner loop: no slow or integration tests, no services (under two minutes on 2 cores).
test-fast: install-dev
	$(PY) -m pytest -m "not slow and not integration"

# The newest releases pyproject.toml's ranges allow, in their own venv and without the lock: the
# trainer, API and core unit tests on them, so an upstream release (transformers, torch, peft,
# FastAPI, ...) that breaks ftq is caught here before users meet it. Run before each release and
# before `make lock`; CI runs `make test` only (see docs/operations.md, "Dependencies").
LATEST_VENV ?= .venv-latest
test-latest:
	@test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	@CMAKE_ARGS="$${CMAKE_ARGS:-$(LLAMA_CMAKE_ARGS)}" scripts/llama-wheel.sh $(LATEST_VENV)/bin/python $(LOCK) $(WHEELHOUSE)
	@scripts/install-torch.sh $(LATEST_VENV)/bin/python newest
	$(LATEST_VENV)/bin/python -m pip install --upgrade --upgrade-strategy eager --find-links $(WHEELHOUSE) -e '.[dev]'
	$(LATEST_VENV)/bin/python scripts/versions.py
	$(LATEST_VENV)/bin/python -m pytest -n 2 tests/unit/trainer tests/unit/api tests/unit/core

# Re-resolves requirements/lock.txt from pyproject.toml (newest versions the ranges allow, torch
# pinned to TORCH_VERSION); run `make test-latest` first, then `make test` on the new lock.
# `make lock KEEP=1` keeps every pin that still fits (for a new dependency: only it and what it pulls
# are added).
lock: install-dev
	scripts/lock.sh $(VENV)/bin/uv $(TORCH_VERSION)$(if $(KEEP), --keep)
