# Two entry points that work from a clean clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
export KERAS_BACKEND ?= tensorflow
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test test-slow test-all test-thorough test-tf test-torch test-jax wheel-check venv clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,tensorflow]"
	touch $(STAMP)

# cuDNN 9's headers and libcudnn.so.9, which the (slow) test that compiles
# rnnfuse's TensorFlow op links against (no GPU needed; --no-deps skips the
# 600 MB cuBLAS wheel it does not use). Installed for the runs that include
# the slow tests only: the fast loop saves the download.
$(VENV)/.cudnn-stamp: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps "nvidia-cudnn-cu12>=9.1"
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/text_classifier.py

# The CPU suites: tests/ under the TensorFlow backend, tests/torch_backend
# under KERAS_BACKEND=torch, tests/jax_backend under KERAS_BACKEND=jax (GPU
# tests, tests/gpu, skip here). TESTS picks by marker:
#
#   make test          the fast loop: every test but the `slow` ones
#                      (tests/markers_slow.py), a few hypothesis examples each
#   make test-slow     only the `slow` ones
#   make test-all      both (what .ci/run runs, as make test then make test-slow)
#   make test-thorough both, with 200 hypothesis examples per property
#
# The TensorFlow and JAX suites run in TEST_WORKERS processes (pytest-xdist;
# XLA compiles on one core each, so two workers nearly halve them on two
# cores); the torch suite runs in one, where two are slower (torch's own
# threads). `worksteal` lets an idle worker take tests queued for the other,
# so a few long tests do not leave one core idle at the end. Exit code 5
# (no test selected) counts as success.
TEST_WORKERS ?= 2
TESTS ?= not slow
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -m "$(TESTS)"
OK_IF_NONE := || test $$? -eq 5

test: test-tf test-torch test-jax

test-slow:
	$(MAKE) test TESTS=slow

test-all:
	$(MAKE) test TESTS="slow or not slow"

test-thorough:
	HYPOTHESIS_PROFILE=thorough $(MAKE) test-all

ifeq ($(TESTS),not slow)
TF_NEEDS := $(STAMP)
else
TF_NEEDS := $(VENV)/.cudnn-stamp
endif

test-tf: $(TF_NEEDS)
	KERAS_BACKEND=tensorflow $(PYTEST) -n $(TEST_WORKERS) --dist worksteal tests $(OK_IF_NONE)

# The torch suite runs on the CPU: pinned so every run tests one version. pip
# takes it from the index it is configured with; where that is PyPI (Linux),
# add PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu to get the CPU
# build, not the multi-GB CUDA one.
$(VENV)/.torch-stamp: $(STAMP)
	$(BIN)/python -m pip install -q torch==2.13.0
	touch $@

test-torch: $(VENV)/.torch-stamp
	KERAS_BACKEND=torch OMP_WAIT_POLICY=PASSIVE $(PYTEST) tests/torch_backend $(OK_IF_NONE)

# The JAX suite runs on the CPU jaxlib, pinned so every run tests one version.
$(VENV)/.jax-stamp: $(STAMP)
	$(BIN)/python -m pip install -q jax==0.10.2 jaxlib==0.10.2
	touch $@

test-jax: $(VENV)/.jax-stamp
	KERAS_BACKEND=jax $(PYTEST) -n $(TEST_WORKERS) --dist worksteal tests/jax_backend $(OK_IF_NONE)

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
