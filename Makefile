# make run: the orchestrator; make test: the suite. Each does its whole set-up from a fresh
# machine (venv, install, services found or started).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The oldest Celery, kombu and psycopg that pyproject.toml allows (.ci/oldest.txt).
OLDEST := .venv-oldest
OLDEST_STAMP := $(OLDEST)/.installed-stamp
# Debian packages some tests need, installed when we may (root with apt-get): PgBouncer
# (the doctor's pooler test), Chromium and its driver (Flower in a real browser).
APT_PACKAGES := pgbouncer chromium chromium-driver

.PHONY: run test lint unit integration chaos matrix soak bench mutate clean docs

# `make run` needs only the demo's packages (RUN_STAMP: no test tools, no apt packages);
# the tests need everything (STAMP).
RUN_STAMP := $(VENV)/.run-stamp
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[redis,binary,run]'
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[redis,binary,run,test]'
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	[ -z "$$missing" ] || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) \
		|| echo "could not install $$missing: the tests that need them will fail"
	touch $(STAMP) $(RUN_STAMP)

$(OLDEST_STAMP): pyproject.toml .ci/oldest.txt
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST)/bin/python -m pip install --quiet -c .ci/oldest.txt -e '.[redis,binary]' \
		pytest pytest-timeout hypothesis django gevent pyyaml psutil flower rich
	touch $(OLDEST_STAMP)

# Options: make run ARGS="--tenants 20 --replicas 3 --duration 60 --fast --chaos"
# It works in a Postgres database (pglock_demo) and a Redis database of its own.
run: $(RUN_STAMP)
	$(PY) -m tasks.run $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The default strategy (reuse) runs everything (tests/README.md maps each file to the
# guarantee it proves); the lock, worker and fault tests run again with a session per
# lock (connect), and the worker and fault tests with shared sessions. The files that
# test one strategy's sessions or every strategy at once need no re-run:
# test_session_reuse.py (reuse), test_shared_sessions.py (shared), test_release.py and
# test_holders_isolated.py (parametrised over all three). Left out under shared, as they
# test what shared sessions do differently (each has its shared counterpart in
# test_shared_sessions.py or is a documented difference): test_lock.py and the Redis
# restart (lock.connection, which shared sessions do not give), the waiter seen queued in
# pg_locks (a shared wait polls), the no-free-slot test (shared sessions stay open for the
# process's next locks), the redelivered copy's tests (a shared session names no holder,
# so a copy cannot tell its own first delivery: known limit 10).
NOT_UNDER_SHARED := not redis_restart and not second_call_wait and not no_free_connection_slot and not redelivered
# Files run side by side in PARALLEL processes (pytest-xdist, one file per process at a
# time): each process works in a Postgres and a Redis database of its own, as two runs
# on one machine do. The Patroni failover scenarios run last, alone (about 5 minutes).
PARALLEL ?= 3
XDIST := -n $(PARALLEL) --dist loadfile
# Patroni (its own venv), etcd and the Postgres 15 server binaries for the failover tests:
# built when missing (tests/support/patroni.py --install; root installs the Debian parts).
PATRONI_STAMP := .venv-patroni/.installed-stamp
$(PATRONI_STAMP): $(STAMP) tests/support/patroni.py
	rm -f $(PATRONI_STAMP)
	$(PY) -m tests.support.patroni --install
test: lint matrix $(PATRONI_STAMP)
	$(PY) -m pytest $(XDIST) tests -m 'not failover'
	PGLOCK_STRATEGY=connect $(PY) -m pytest $(XDIST) tests/integration/test_lock.py \
		tests/integration/test_workers.py tests/integration/test_fail_closed.py tests/chaos/test_faults.py
	PGLOCK_STRATEGY=shared $(PY) -m pytest $(XDIST) tests/integration/test_workers.py \
		tests/integration/test_fail_closed.py tests/chaos/test_faults.py -k '$(NOT_UNDER_SHARED)'
	$(PY) -m pytest -m failover tests/failover

# The oldest Celery the metadata allows, and the oldest Django the tests allow (the main
# venv has the newest): unit tests, the worker tests that prove G1, G2 and the lock modes,
# the celery sub-command, and the Django project (the ORM fence under every pool).
matrix: $(OLDEST_STAMP)
	$(OLDEST)/bin/python -c 'import celery, kombu, psycopg; \
		print("oldest: celery", celery.__version__, "kombu", kombu.__version__, "psycopg", psycopg.__version__)'
	$(OLDEST)/bin/python -m pytest tests/unit tests/integration/test_celery_command.py
	$(OLDEST)/bin/python -m pytest tests/integration/test_workers.py \
		-k 'overlap or sigkill or wait_mode or retry_mode or released'
	$(OLDEST)/bin/python -c 'import django; print("oldest: django", django.__version__)'
	$(OLDEST)/bin/python -m pytest tests/integration/test_django_project.py \
		tests/integration/test_django_dsn.py

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: $(STAMP)
	$(PY) -m pytest tests/integration

chaos: $(STAMP)
	$(PY) -m pytest tests/chaos

# Side-by-side and scale benchmarks on a Postgres of their own (about 7 minutes): one
# module per question (bench/latency.py, throughput, recovery, fanout, peak, guard, scale,
# shards) writes its figures to bench/results/<question>.json, then bench/report.py renders
# BENCHMARKS.md, bench/chart.png and bench/scale.png from those files alone. Some
# sections: make bench ARGS="--sections 1,7"; one alone: python -m bench.<question>;
# the page alone, from the stored data: python -m bench.report.
bench: $(STAMP)
	$(PY) -m bench.run $(ARGS)

# A longer randomized mix of faults: make soak ARGS="--duration 600". On a 3-member
# Patroni cluster, with failovers among the faults (a switchover, the leader's Postgres or
# Patroni SIGKILLed, its Patroni paused): make soak ARGS="--patroni --strategy connect
# --duration 600" (tests/chaos/failover_soak.py; Patroni's venv is built when missing).
soak: $(STAMP) $(if $(findstring --patroni,$(ARGS)),$(PATRONI_STAMP))
	$(PY) -m tests.chaos.soak $(ARGS)

# Mutation testing of keys, config, task (names and modes) and sessions with the tests
# that run in-process; prints the score and each survivor (not in CI; an hour or more).
mutate: $(STAMP)
	$(PY) -m tests.mutation.score $(ARGS)

# The documentation site (MkDocs, strict: a broken link or reference fails the build),
# into SITE_DIR (site/ by default). It installs the docs extra alone (DOCS_STAMP): no
# test tools, no apt packages. The browser check of the built site is a test
# (tests/integration/test_docs_site.py), which `make test` sets up for.
SITE_DIR ?= site
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir '$(SITE_DIR)'

clean:
	rm -rf $(VENV) $(OLDEST) .venv-patroni .pytest_cache .mypy_cache .ruff_cache
