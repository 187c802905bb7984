# Two entry points that work from a clean clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
export KERAS_BACKEND ?= tensorflow
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test test-tf test-torch test-jax test-thorough wheel-check venv clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,tensorflow]"
	# cuDNN 9's headers and libcudnn.so.9, which the test that compiles
	# rnnfuse's TensorFlow op links against (no GPU needed; --no-deps skips
	# the 600 MB cuBLAS wheel it does not use).
	$(BIN)/python -m pip install -q --no-deps "nvidia-cudnn-cu12>=9.1"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/text_classifier.py

# The CPU suite under the TensorFlow backend, then the torch-backend tests
# (tests/torch_backend) under KERAS_BACKEND=torch and the JAX-backend tests
# (tests/jax_backend) under KERAS_BACKEND=jax. GPU tests (tests/gpu) skip here.
# The TensorFlow suite runs in TEST_WORKERS processes (pytest-xdist): on the
# 2-core CI machine 2 workers take it from 538 s to 315 s; the torch and JAX
# suites gain nothing from it and run in one.
TEST_WORKERS ?= 2
test: test-tf test-torch test-jax

test-tf: $(STAMP)
	KERAS_BACKEND=tensorflow $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) tests

# torch==2.13.0 is the CPU build this machine kind keeps on local disk; a bare
# `torch` would pull a multi-GB CUDA build.
$(VENV)/.torch-stamp: $(STAMP)
	$(BIN)/python -m pip install -q torch==2.13.0
	touch $@

test-torch: $(VENV)/.torch-stamp
	KERAS_BACKEND=torch OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -p no:cacheprovider tests/torch_backend

# jax==0.10.2 (CPU jaxlib) is what this machine kind's local index holds.
$(VENV)/.jax-stamp: $(STAMP)
	$(BIN)/python -m pip install -q jax==0.10.2 jaxlib==0.10.2
	touch $@

test-jax: $(VENV)/.jax-stamp
	KERAS_BACKEND=jax $(BIN)/python -m pytest -q -p no:cacheprovider tests/jax_backend

# Build the wheel, install it with its declared dependencies only (no Keras
# backend) in a fresh venv, and check that pip sees no broken requirement,
# that the package data (py.typed, the JSON Schema) is in it and that the
# command answers --version without a backend.
wheel-check:
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/python" -m pip install -q --upgrade pip; \
	"$$tmp/venv/bin/python" -m pip wheel -q --no-deps -w "$$tmp/dist" .; \
	"$$tmp/venv/bin/python" -m pip install -q "$$tmp"/dist/rnnfuse-*.whl; \
	"$$tmp/venv/bin/python" -m pip check; \
	"$$tmp/venv/bin/python" -c "import sys, zipfile; \
	names = set(zipfile.ZipFile(sys.argv[1]).namelist()); \
	missing = {'rnnfuse/py.typed', 'rnnfuse/schema/cli-output-v1.json'} - names; \
	sys.exit(f'wheel lacks {sorted(missing)}' if missing else 0)" "$$tmp"/dist/rnnfuse-*.whl; \
	cd "$$tmp"; \
	"$$tmp/venv/bin/rnnfuse" --version; \
	echo "wheel-check: $$(ls "$$tmp"/dist) installs, pip check clean"

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
