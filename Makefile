# The two commands a user needs: `make demo` and `make test`. Each sets itself up first.
# `make demo` installs the library alone (what the demo needs); `make test` adds the [dev] extra.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Exact versions for this project's own environment: torch is pinned there, never in pyproject.toml.
PIP    := $(PY) -m pip install --quiet -c constraints.txt
CORE   := $(VENV)/.installed-core
DEV    := $(VENV)/.installed-dev
# Small ops get much slower when threads are oversubscribed; pin the count explicitly.
THREADS ?= 2
export OMP_NUM_THREADS := $(THREADS)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test install docs clean

install: $(CORE)

$(PY):
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "slidefusion needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)

# torch goes in first, as constraints.txt pins it, so nothing later can make pip resolve another build.
$(CORE): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet --upgrade pip
	$(PIP) torch
	$(PIP) -e .
	touch $@

$(DEV): $(CORE)
	$(PIP) -e '.[dev]'
	touch $@

demo: $(CORE)
	$(VENV)/bin/slidefusion demo --out outputs/demo.mp4

# The suite includes the docs: the site builds with --strict and its runnable examples run (tests/docs).
# Two pytest workers (pytest-xdist), one thread each: most tests are small ops or wait on subprocesses,
# so two workers on two cores halve the wall time where two threads in one process would not.
WORKERS ?= 2
test: export OMP_NUM_THREADS := 1
test: $(DEV)
	$(PY) -m pytest -q -n $(WORKERS) tests

docs: $(DEV)
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) outputs runs site *.egg-info
