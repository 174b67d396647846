# The two commands a user needs: `make demo` and `make test`. Each sets itself up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Small ops get much slower when threads are oversubscribed; pin the count explicitly.
THREADS ?= 2
export OMP_NUM_THREADS := $(THREADS)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test install clean

install: $(STAMP)

$(PY):
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "slidefusion needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)

# torch goes in first and exactly pinned, so nothing later can make pip resolve another build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/slidefusion demo --out outputs/demo.mp4

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) outputs runs *.egg-info
