# Two entry points that work from a clean clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
export KERAS_BACKEND ?= tensorflow
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test test-thorough venv clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/text_classifier.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
