# ftq: `make up` installs and starts the service; `make test` runs the whole test suite.
#
# Both create .venv when it is missing, install torch first when none is there (pip picks
# the CPU build on a box without CUDA wheels; a GPU box installs its own torch beforehand),
# then ftq itself in editable mode with its dev extras. The install is redone only when
# pyproject.toml changes.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ftq-installed
TORCH_VERSION ?= 2.13.0

.PHONY: install up test test-fast services browser

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e '.[dev]'
	@touch $(STAMP)

up: install
	$(VENV)/bin/ftq up

services:
	scripts/services.sh

browser:
	scripts/browser.sh

# pytest exits 5 when it collected no test: that fails `make test` like any other non-zero code.
test: install services browser
	$(PY) -m pytest

# The inner loop: no slow or integration tests, no services (under two minutes on 2 cores).
test-fast: install
	$(PY) -m pytest -m "not slow and not integration"
