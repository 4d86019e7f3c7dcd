# make run: the orchestrator; make test: the suite. Each does its whole set-up from a fresh
# machine (venv, install, services found or started).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint unit integration chaos soak bench mutate clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[run,test]'
	@# PgBouncer, for the doctor's pooler test: from Debian's packages when we may install.
	@command -v pgbouncer >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer) \
		|| echo "pgbouncer could not be installed: the doctor's pooler test will fail"
	touch $(STAMP)

# Options: make run ARGS="--tenants 20 --replicas 3 --duration 60 --fast --chaos"
run: $(STAMP)
	$(PY) -m tasks.run $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The default strategy (reuse) runs everything; the lock, worker and fault tests run
# again with a session per lock (connect).
test: lint
	$(PY) -m pytest tests
	PGLOCK_STRATEGY=connect $(PY) -m pytest tests/integration/test_lock.py \
		tests/integration/test_workers.py tests/integration/test_fail_closed.py tests/chaos/test_faults.py

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: $(STAMP)
	$(PY) -m pytest tests/integration

chaos: $(STAMP)
	$(PY) -m pytest tests/chaos

# Side-by-side benchmarks: writes BENCHMARKS.md and bench/chart.png (about 5 minutes).
bench: $(STAMP)
	$(PY) -m bench.run $(ARGS)

# A longer randomized mix of faults: make soak ARGS="--duration 600"
soak: $(STAMP)
	$(PY) -m tests.chaos.soak $(ARGS)

# Mutation testing of keys, config, task (names and modes) and sessions with the tests
# that run in-process; prints the score and each survivor (not in CI; an hour or more).
mutate: $(STAMP)
	$(PY) -m tests.mutation.score $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
