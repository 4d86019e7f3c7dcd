# make test: the whole set-up from a fresh machine (venv, install, services) and the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test lint unit integration chaos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest tests

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: $(STAMP)
	$(PY) -m pytest tests/integration

chaos: $(STAMP)
	$(PY) -m pytest tests/chaos

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
