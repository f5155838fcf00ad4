# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Offline machines that already have the dependencies can reuse them:
#   make demo VENV_ARGS=--system-site-packages PIP_ARGS="--no-index --no-build-isolation"
PYTHON ?= python3
VENV ?= .venv
VENV_ARGS ?=
PIP_ARGS ?=
PY := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -m pip install -q $(PIP_ARGS) ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m cuflash demo

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
