# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m cuflash demo

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
