# Two entry points for a fresh clone (README): `make demo` and `make test`.
# Each creates .venv when it is missing and installs the package into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast lint format bench gpu-wheels gpu-suite docs docs-serve install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m sae_pipeline.demo

# Two workers on the 2-core CI box (TEST_WORKERS=0: one process); groups and order: tests/parallel.py.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

test: $(STAMP)
	$(PY) -m pytest $(XDIST) --durations=30

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not slow"

# ruff's lint and format checks ([tool.ruff] in pyproject.toml; tests/test_lint.py runs them too); format fixes.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(PY) -m benchmarks.mp_sae
	$(PY) -m benchmarks.babel

# A lent GPU (docs/where-to-run.md): gpu-wheels here (the peers' wheels into .whl/), then gpu-suite there, in one
# device call carrying .whl. gpu-suite uses the machine's python3: that image has torch, and no venv is made there.
gpu-wheels:
	PYTHON=$(PYTHON) bash benchmarks/gpu_wheels.sh

gpu-suite:
	$(PYTHON) -m benchmarks.gpu_suite

# The documentation site (mkdocs.yml, docs/) into site/; docs-serve rebuilds it on every edit.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve

clean:
	rm -rf $(VENV) demo_out runs site *.egg-info gpu_suite_out
