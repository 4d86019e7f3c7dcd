"""A real Django project (tests/django_project) with pglock_database: the ORM's writes fenced.

Its settings package has a prod module that imports the base one and names the lock
database by its alias (``CELERY_PGLOCK_DATABASE = "default"``); its app has a model on a
guarded table. Everything runs as the project would: ``manage.py`` and ``celery worker``
subprocesses (prefork and threads), the lock DSN read from ``DATABASES`` by each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from tests.support.locks import key_of, terminate
from tests.support.services import scalar, wait_until
from tests.support.workers import ROOT, Worker

PROJECT = ROOT / "tests" / "django_project"
#: The guarded table and its lock name (shop/tasks.py takes the same lock).
TABLE, LOCK = "shop_ledger", "shop:{tenant}"
RESULT_TIMEOUT = 60
POOLS = [("prefork", 2), ("threads", 4)]


@pytest.fixture(scope="module")
def shop_env(pg_dsn: str, broker_url: str) -> dict[str, str]:
    """The project's environment: its database from pg_dsn, split into DATABASES' fields."""
    params = conninfo_to_dict(pg_dsn)
    env = {
        "DJANGO_SETTINGS_MODULE": "proj.settings.prod",
        "PYTHONPATH": os.pathsep.join([str(PROJECT), str(ROOT)]),
        "SHOP_DB_NAME": str(params["dbname"]),
        "SHOP_DB_USER": str(params.get("user") or "postgres"),
        "SHOP_DB_PASSWORD": str(params.get("password") or ""),
        "SHOP_DB_HOST": str(params.get("host") or ""),
        "SHOP_DB_PORT": str(params.get("port") or ""),
        "SHOP_BROKER_URL": broker_url,
        "SHOP_QUEUE": f"shop-{uuid.uuid4().hex[:8]}",
        "PGLOCK_DSN": "",  # the lock DSN comes from DATABASES["default"] only
        # The project's connections start in a zone other than Django's (UTC), as on
        # many servers (SHOP_DB_OPTIONS, the libpq options of its DATABASES entry).
        "SHOP_DB_OPTIONS": "-c TimeZone=America/Chicago",
    }
    env["PGLOCK_TEST_QUEUE"] = env["SHOP_QUEUE"]
    return env


def manage(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run the project's manage.py with ``args``; ``extra`` variables on top of ``env``."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT,
        env={**os.environ, **env, **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def project(shop_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The project migrated: its ledger guarded by its own migration (InstallGuard)."""
    ok(manage(shop_env, "migrate", "--noinput"))
    yield shop_env
    manage(shop_env, "migrate", "shop", "zero", "--noinput")


@pytest.fixture(scope="module")
def shop_app(shop_env: dict[str, str]) -> Iterator[Celery]:
    """A client of the project's broker and result backend (tasks are sent by name)."""
    app = Celery(
        "shop-client",
        broker=shop_env["SHOP_BROKER_URL"],
        backend=shop_env["SHOP_BROKER_URL"],
        set_as_current=False,
    )
    yield app
    app.close()


@pytest.fixture(scope="module", params=POOLS, ids=[pool for pool, _ in POOLS])
def worker(
    request: pytest.FixtureRequest,
    project: dict[str, str],
    shop_app: Celery,
    log_dir: Path,
) -> Iterator[Worker]:
    """A `celery -A proj worker` of the project, on a queue of its pool's own."""
    pool, concurrency = request.param
    env = {**project, "PGLOCK_TEST_QUEUE": f"{project['SHOP_QUEUE']}-{pool}"}
    started = Worker(shop_app, "proj", env, log_dir, pool=pool, concurrency=concurrency)
    yield started
    started.stop()


def send(app: Celery, worker: Worker, name: str, *args: Any) -> Any:
    """Send ``shop.tasks.<name>`` to the queue of ``worker`` (its pool's own)."""
    command = worker.process.args
    assert isinstance(command, list)
    return app.send_task(f"shop.tasks.{name}", args=args, queue=command[command.index("-Q") + 1])


def ledger(pg_dsn: str, tenant: str) -> list[tuple[str, int]]:
    """The committed rows of ``tenant``: (entry, backend that wrote it), read from outside."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT entry, backend FROM {} WHERE tenant = %s ORDER BY id").format(
                sql.Identifier(TABLE)
            ),
            (tenant,),
        ).fetchall()
    return [(str(entry), int(backend)) for entry, backend in rows]


@pytest.fixture
def beacon(pg_dsn: str) -> Iterator[str]:
    """A table through which a body tells its lock's backend and the test says go."""
    name = f"beacon_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (tenant text PRIMARY KEY, backend_pid int, go bool DEFAULT false)"
            ).format(sql.Identifier(name))
        )
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))


def beacon_pid(pg_dsn: str, beacon: str, tenant: str) -> int | None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT backend_pid FROM {} WHERE tenant = %s").format(sql.Identifier(beacon)),
            (tenant,),
        ).fetchone()
    return None if row is None else int(row[0])


def say_go(pg_dsn: str, beacon: str, tenant: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {} SET go = true WHERE tenant = %s").format(sql.Identifier(beacon)),
            (tenant,),
        )


def fails_with_lock_lost_once_its_backend_ends(
    pg_dsn: str, beacon: str, tenant: str, call: Any
) -> None:
    """Once the body signals, end its lock's backend, say go: the call fails with LockLost."""
    wait_until(
        lambda: beacon_pid(pg_dsn, beacon, tenant) is not None, 30, "the body to reach its wait"
    )
    backend_pid = beacon_pid(pg_dsn, beacon, tenant)
    assert backend_pid is not None and terminate(pg_dsn, backend_pid)
    say_go(pg_dsn, beacon, tenant)
    call.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert call.state == "FAILURE"
    assert type(call.result).__name__ == "LockLost", repr(call.result)


def test_a_locked_tasks_orm_writes_commit_on_the_lock_session(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """Autocommit, atomic() and a savepoint: written by the lock's backend, the guard accepts."""
    tenant = f"{run_id}-{worker.pool}"
    result = send(shop_app, worker, "record", tenant, "paid").get(timeout=RESULT_TIMEOUT)
    assert result["data"] == [{"how": "autocommit"}, {"how": "atomic"}]  # JSON read back
    assert result["aware"]  # Django's time zone loader on the lock's handle
    assert result["writers"] == [result["backend_pid"]]
    assert ledger(pg_dsn, tenant) == [("paid", result["backend_pid"])] * 2


def test_writes_in_signal_receivers_commit_on_the_lock_session(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """A post_save receiver's write (autocommit and in atomic()) and a custom signal's:
    written by the lock's backend, the guard accepts the ledger's."""
    tenant = f"{run_id}-{worker.pool}-signals"
    result = send(shop_app, worker, "record_through_signals", tenant).get(timeout=RESULT_TIMEOUT)
    pid = result["backend_pid"]
    assert ledger(pg_dsn, tenant) == [("signalled", pid), ("audit", pid)] * 2
    assert notes(pg_dsn, tenant) == ["after"]


def round_trips(messages: list[list[str]]) -> int:
    """How many times the client waited for the server: each simple Query or Sync ends one."""
    return sum(kind in ("Query", "Sync") for kind, *_ in messages)


def test_a_bodys_connection_needs_no_time_zone_set_up(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """The lock session starts in Django's zone for the alias, whatever the alias's own
    options say (Chicago): the body's connection sends no set-up, call after call (the
    release's DISCARD ALL returns to the session's start)."""
    for call in range(2):
        tenant = f"{run_id}-{worker.pool}-zone-{call}"
        sent = send(shop_app, worker, "one_write_traced", tenant).get(timeout=RESULT_TIMEOUT)
        assert not any("TimeZone" in text for _, *rest in sent for text in rest), sent
        assert notes(pg_dsn, tenant) == ["traced"]


def test_djangos_time_zone_set_up_runs_outside_the_fence_in_one_round_trip(
    worker: Worker, shop_app: Celery, run_id: str
) -> None:
    """A body that moved its session to another zone before its first ORM call: the
    connection Django opens sets its own, a session setting sent alone, never as a
    fenced transaction of its own."""
    tenant = f"{run_id}-{worker.pool}"
    sent = send(shop_app, worker, "one_write_traced", tenant, "America/Chicago").get(
        timeout=RESULT_TIMEOUT
    )
    texts = [text for _, *rest in sent for text in rest]
    set_up = next(i for i, text in enumerate(texts) if "'TimeZone'" in text)
    assert not any("BEGIN" in text for text in texts[:set_up]), sent
    assert round_trips(sent[: set_up + 1]) == 1, sent


def test_a_fenced_autocommit_write_costs_three_round_trips(
    worker: Worker, shop_app: Celery, run_id: str
) -> None:
    """One Model.objects.create() in autocommit: BEGIN, the proof and the savepoint in one
    round trip, the INSERT, then the release of the savepoint, the restore and the
    COMMIT in one (no leader to ask first). Unfenced, it is the INSERT alone."""
    tenant = f"{run_id}-{worker.pool}"
    sent = send(shop_app, worker, "one_write_traced", tenant).get(timeout=RESULT_TIMEOUT)
    texts = [text for _, *rest in sent for text in rest]
    begin = next(i for i, text in enumerate(texts) if "BEGIN" in text)
    write = sent[begin:]
    assert round_trips(write) == 3, write
    assert "COMMIT" in texts[-1] and "INSERT" in texts[-2], write


def test_the_bodys_own_orm_sql_cannot_free_its_lock(
    worker: Worker, shop_app: Celery, run_id: str
) -> None:
    """pg_advisory_unlock_all() through the ORM runs in a fenced transaction: the lock stays."""
    tenant = f"{run_id}-{worker.pool}"
    still_held = send(shop_app, worker, "unlock_then_write", tenant).get(timeout=RESULT_TIMEOUT)
    assert still_held is True


def notes(pg_dsn: str, tenant: str) -> list[str]:
    """The committed notes (an unguarded table) of ``tenant``, read from outside."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT text FROM shop_note WHERE tenant = %s ORDER BY id", (tenant,)
        ).fetchall()
    return [str(text) for (text,) in rows]


def test_sql_sent_around_djangos_execute_is_fenced_too(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """psycopg's stream(), copy() and the raw cursor under Django's: each in a fenced
    transaction, so an unlock through them frees nothing and their writes commit held."""
    tenant = f"{run_id}-{worker.pool}"
    result = send(shop_app, worker, "sql_past_the_wrapper", tenant).get(timeout=RESULT_TIMEOUT)
    assert result == {"other_got": False, "held": True}
    assert notes(pg_dsn, tenant) == ["copied", "raw"]


def test_a_copy_in_an_atomic_block_rolls_back_with_it(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """The fenced transaction begins with atomic(), whatever its first statement."""
    tenant = f"{run_id}-{worker.pool}"
    send(shop_app, worker, "copy_in_a_rolled_back_atomic", tenant).get(timeout=RESULT_TIMEOUT)
    assert notes(pg_dsn, tenant) == []


def test_sql_that_ends_the_fenced_transaction_stops_what_follows(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """COMMIT through a cursor inside atomic(): refused from then on (PglockError), so
    neither an unlock nor a write runs outside the fence; the lock stays held."""
    tenant = f"{run_id}-{worker.pool}"
    seen = send(shop_app, worker, "commit_by_sql", tenant).get(timeout=RESULT_TIMEOUT)
    assert seen["commit"] == seen["unlock"] == seen["after"] == "PglockError", seen
    assert seen["held"] == "True", seen
    assert "after" not in notes(pg_dsn, tenant)


def test_a_task_called_from_another_body_fences_its_writes_with_its_own_lock(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    tenant = f"{run_id}-{worker.pool}"
    inner = send(shop_app, worker, "call_another_tenants_step", tenant).get(timeout=RESULT_TIMEOUT)
    assert inner["writers"] == [inner["backend_pid"]]
    assert ledger(pg_dsn, f"{tenant}-inner") == [("inner", inner["backend_pid"])] * 2


@pytest.mark.parametrize("inside_atomic", [False, True], ids=["autocommit", "atomic"])
def test_nothing_written_after_the_lock_is_lost_commits(
    worker: Worker,
    shop_app: Celery,
    pg_dsn: str,
    run_id: str,
    beacon: str,
    inside_atomic: bool,
) -> None:
    """The lock's backend ended mid-body: the task fails with LockLost, its later write is gone.

    In autocommit the write made before the loss was committed under the lock; inside
    atomic() nothing of the transaction commits.
    """
    tenant = f"{run_id}-{worker.pool}"
    call = send(shop_app, worker, "record_across_a_loss", tenant, beacon, inside_atomic)
    fails_with_lock_lost_once_its_backend_ends(pg_dsn, beacon, tenant, call)
    committed = [entry for entry, _backend in ledger(pg_dsn, tenant)]
    assert committed == ([] if inside_atomic else ["before"])


def test_a_read_through_a_server_side_cursor_cut_by_a_loss_ends_with_lock_lost(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str, beacon: str
) -> None:
    """.iterator() inside atomic(), the lock's backend ended mid-read: Django's
    OperationalError under it, the task ends with LockLost all the same."""
    tenant = f"{run_id}-{worker.pool}"
    call = send(shop_app, worker, "read_across_a_loss", tenant, beacon)
    fails_with_lock_lost_once_its_backend_ends(pg_dsn, beacon, tenant, call)


def test_the_guarded_table_refuses_the_same_orm_write_outside_a_task(
    project: dict[str, str], pg_dsn: str, run_id: str
) -> None:
    done = manage(
        project,
        "shell",
        "-c",
        f"from shop.models import Ledger; Ledger.objects.create(tenant={run_id!r}, entry='x')",
    )
    assert done.returncode != 0
    assert TABLE in done.stderr and "shop:" in done.stderr, done.stderr
    assert ledger(pg_dsn, run_id) == []


def test_an_eager_call_inside_atomic_is_refused(project: dict[str, str], pg_dsn: str) -> None:
    """The body cannot join the caller's transaction under the lock: a PglockError says so."""
    code = (
        "from django.db import transaction\n"
        "from shop.tasks import record\n"
        "with transaction.atomic():\n"
        "    result = record.apply(('eager', 'x'))\n"
        "print(type(result.result).__name__, result.result)\n"
    )
    out = ok(manage(project, "shell", "-c", code))
    assert "PglockError lock shop:eager" in out and "on_commit" in out, out
    assert ledger(pg_dsn, "eager") == []


def guarded(env: dict[str, str]) -> bool:
    """Whether ``manage.py pglock guard list`` lists the ledger with its template."""
    listed = ok(manage(env, "pglock", "guard", "list"))
    return TABLE in listed and LOCK in listed


def write_outside_a_lock(pg_dsn: str, tenant: str) -> None:
    """Insert and delete a ledger row of ``tenant`` on a plain session (no lock held)."""
    table = sql.Identifier(TABLE)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (tenant, entry, data, written_at) VALUES (%s, 'x', '{{}}', now())"
            ).format(table),
            (tenant,),
        )
        conn.execute(sql.SQL("DELETE FROM {} WHERE tenant = %s").format(table), (tenant,))


def test_a_migration_installs_the_guard_and_unapplying_it_removes_it(
    project: dict[str, str], pg_dsn: str
) -> None:
    """InstallGuard guards the model's table as it is applied; unapplied, the guard is gone."""
    assert guarded(project)
    with pytest.raises(psycopg.Error, match="shop:migrated"):
        write_outside_a_lock(pg_dsn, "migrated")
    try:
        ok(manage(project, "migrate", "shop", "0001", "--noinput"))
        assert not guarded(project)
        write_outside_a_lock(pg_dsn, "migrated")
    finally:
        ok(manage(project, "migrate", "shop", "--noinput"))
    assert guarded(project)
    assert ledger(pg_dsn, "migrated") == []


def test_manage_py_check_passes_with_the_prod_settings(project: dict[str, str]) -> None:
    out = ok(manage(project, "check"))
    assert "no issues" in out


@pytest.mark.parametrize(
    ("settings_module", "extra", "check_id"),
    [
        ("proj.settings.base", {}, "pglock.E001"),
        ("proj.settings.base", {"PGLOCK_DSN": "host='unterminated"}, "pglock.E002"),
        ("proj.settings.prod", {"PGLOCK_CHECK_INTERVAL": "soon"}, "pglock.E003"),
        ("proj.settings.prod", {"PGLOCK_POOLER": "transaction"}, "pglock.E004"),
        ("proj.settings.prod", {"PGLOCK_STRATEGY": "shared"}, "pglock.E003"),
    ],
    ids=["no-dsn", "malformed-dsn", "invalid-setting", "transaction-pooler", "shared"],
)
def test_manage_py_check_reports_each_problem(
    shop_env: dict[str, str], settings_module: str, extra: dict[str, str], check_id: str
) -> None:
    done = manage(shop_env, "check", DJANGO_SETTINGS_MODULE=settings_module, **extra)
    assert done.returncode != 0
    assert check_id in done.stderr, done.stderr
    password = shop_env["SHOP_DB_PASSWORD"]
    assert not password or password not in done.stdout + done.stderr


def test_manage_py_check_reports_the_task_options_a_worker_would_refuse(
    project: dict[str, str],
) -> None:
    """The project's Celery app, its task modules imported as a worker does: E005 for each."""
    done = manage(project, "check", SHOP_TASK_MODULES="shop.misconfigured_tasks")
    assert done.returncode != 0
    problems = [line for line in done.stderr.splitlines() if "pglock.E005" in line]
    assert len(problems) == 2, done.stderr
    assert any("names_no_argument" in line and "'customer'" in line for line in problems)
    assert any("unknown_mode" in line and "lock_mode" in line for line in problems)


def test_manage_py_pglock_doctor_and_locks_use_the_alias(project: dict[str, str]) -> None:
    doctor = manage(project, "pglock", "doctor", "--json")
    assert doctor.returncode in (0, 1), doctor.stderr  # 1: this server's own findings
    findings = json.loads(doctor.stdout)
    assert findings and all({"level", "check"} <= set(finding) for finding in findings)
    locks = json.loads(ok(manage(project, "pglock", "locks", "--json")))
    assert isinstance(locks, list)
    listed = ok(manage(project, "pglock", "guard", "list"))
    assert TABLE in listed and LOCK in listed


#: Pools that run several bodies in one process (a waiter beside its lock's holder).
ONE_PROCESS_POOLS = [("threads", 4), ("gevent", 8)]


@pytest.fixture(scope="module", params=ONE_PROCESS_POOLS, ids=[p for p, _ in ONE_PROCESS_POOLS])
def one_process_worker(
    request: pytest.FixtureRequest,
    project: dict[str, str],
    shop_app: Celery,
    log_dir: Path,
) -> Iterator[Worker]:
    """A `celery -A proj worker` whose pool runs its bodies in one process."""
    pool, concurrency = request.param
    env = {**project, "PGLOCK_TEST_QUEUE": f"{project['SHOP_QUEUE']}-one-{pool}"}
    started = Worker(shop_app, "proj", env, log_dir, pool=pool, concurrency=concurrency)
    yield started
    started.stop()


def waiting_on(pg_dsn: str, name: str) -> int:
    """How many sessions wait (not granted) on the advisory lock of ``name``."""
    key = key_of(name) & 0xFFFFFFFFFFFFFFFF
    return int(
        scalar(
            pg_dsn,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid::bigint = %s AND objid::bigint = %s AND objsubid = 1",
            (key >> 32, key & 0xFFFFFFFF),
        )
    )


def test_a_waiter_on_the_same_lock_leaves_the_holders_orm_on_the_holders_session(
    one_process_worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str, beacon: str
) -> None:
    """A wait call on the holder's own lock in the holder's process: the holder's ORM
    writes still run on its lock session (the guard accepts them), then the waiter's."""
    tenant = f"{run_id}-{one_process_worker.pool}-waiter"
    holder = send(shop_app, one_process_worker, "write_while_another_call_waits", tenant, beacon)
    wait_until(lambda: beacon_pid(pg_dsn, beacon, tenant) is not None, 30, "the holder's body")
    waiter = send(shop_app, one_process_worker, "write_once_it_is_my_turn", tenant)
    wait_until(lambda: waiting_on(pg_dsn, f"shop:{tenant}") == 1, 30, "the waiter to wait")
    say_go(pg_dsn, beacon, tenant)
    held = holder.get(timeout=RESULT_TIMEOUT)
    assert held["ledger"] == "written", held
    assert held["orm_backend"] == held["backend_pid"], held
    waited = waiter.get(timeout=RESULT_TIMEOUT)
    assert ledger(pg_dsn, tenant) == [("holder", held["backend_pid"]), ("waiter", waited)]
    assert notes(pg_dsn, tenant) == ["holder"]


def test_the_async_orm_from_sync_code_writes_on_the_lock_session(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """acreate() under asyncio.run(), sync_to_async either way, async_to_sync: every
    write on the body's lock session, which the guarded table accepts."""
    tenant = f"{run_id}-{worker.pool}-async"
    result = send(shop_app, worker, "write_through_asgiref_hops", tenant).get(
        timeout=RESULT_TIMEOUT
    )
    entries = ["acreate", "sync_to_async True", "sync_to_async False", "async_to_sync"]
    assert result["rows"] == [[entry, result["backend_pid"]] for entry in entries]


def test_an_async_orm_write_after_the_loss_never_commits(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str, beacon: str
) -> None:
    """The lock's backend ended and the loss found: acreate() and sync_to_async under
    asyncio.run() in the body commit nothing (the task ends with LockLost)."""
    tenant = f"{run_id}-{worker.pool}-async-loss"
    call = send(shop_app, worker, "async_writes_after_the_loss", tenant, beacon)
    fails_with_lock_lost_once_its_backend_ends(pg_dsn, beacon, tenant, call)
    assert notes(pg_dsn, tenant) == []


def test_the_async_orm_inside_the_bodys_open_transaction_is_refused(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """acreate() under asyncio.run() inside atomic(): asgiref's thread cannot join the
    body's transaction, and is refused (naming the lock and the limit) rather than sent
    through the project's connection; the error rolls the block back, as any would."""
    tenant = f"{run_id}-{worker.pool}-async-atomic"
    seen = send(shop_app, worker, "async_orm_inside_atomic", tenant).get(timeout=RESULT_TIMEOUT)
    assert f"lock shop:{tenant}" in seen and "limit 9" in seen, seen
    assert notes(pg_dsn, tenant) == []


def test_the_async_orm_writes_on_the_lock_session_under_threads_and_is_refused_under_gevent(
    one_process_worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """acreate() under asyncio.run() in a body: under threads it writes on the lock
    session; under gevent Django refuses it (asgiref's executor is a greenlet of the loop's
    own thread: SynchronousOnlyOperation), and no row is written by any other path."""
    tenant = f"{run_id}-{one_process_worker.pool}-async-hops"
    call = send(shop_app, one_process_worker, "write_through_asgiref_hops", tenant)
    if one_process_worker.pool == "threads":
        result = call.get(timeout=RESULT_TIMEOUT)
        assert {backend for _, backend in result["rows"]} == {result["backend_pid"]}
        return
    with pytest.raises(Exception) as raised:
        call.get(timeout=RESULT_TIMEOUT)
    assert type(raised.value).__name__ == "SynchronousOnlyOperation", raised.value
    assert ledger(pg_dsn, tenant) == []


@pytest.fixture
def outcomes(pg_dsn: str) -> Iterator[str]:
    """A table where a body records what each of its writes did."""
    name = f"outcomes_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (feature text, outcome text)").format(sql.Identifier(name))
        )
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))


#: The ways of the ORM to write that shop.tasks.orm_writes_after_the_loss tries, in order.
ORM_WRITES = (
    "create", "atomic", "nested atomic", "savepoint", "on_commit", "select_for_update",
    "bulk_create", "bulk_update", "update_or_create", "get_or_create", "update", "delete",
    "raw sql", "set_autocommit", "close_old_connections", "connection.close",
    "signal receiver", "asyncio.run(acreate)", "async_to_sync(acreate)",
)  # fmt: skip


def _no_orm_write_commits_after_the_loss(
    worker: Worker, shop_app: Celery, pg_dsn: str, tenant: str, beacon: str, outcomes: str
) -> None:
    call = send(shop_app, worker, "orm_writes_after_the_loss", tenant, beacon, outcomes)
    fails_with_lock_lost_once_its_backend_ends(pg_dsn, beacon, tenant, call)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        seen = dict(
            conn.execute(
                sql.SQL("SELECT feature, outcome FROM {}").format(sql.Identifier(outcomes))
            ).fetchall()
        )
    assert list(seen) == list(ORM_WRITES)  # each tried
    assert [feature for feature, outcome in seen.items() if outcome == "written"] == [], seen
    assert notes(pg_dsn, tenant) == ["before"]  # nothing added, changed or deleted


def test_no_way_of_the_orm_to_write_commits_after_the_loss(
    worker: Worker, shop_app: Celery, pg_dsn: str, run_id: str, beacon: str, outcomes: str
) -> None:
    """create, atomic (nested, savepoints), on_commit, select_for_update, bulk_create and
    bulk_update, update_or_create, get_or_create, update, delete, raw SQL, set_autocommit,
    close_old_connections, connection.close(), a signal's receiver and the async ORM,
    each tried once the loss is found: none commits (prefork and threads)."""
    tenant = f"{run_id}-{worker.pool}-every-write"
    _no_orm_write_commits_after_the_loss(worker, shop_app, pg_dsn, tenant, beacon, outcomes)


def test_no_way_of_the_orm_to_write_commits_after_the_loss_in_one_process_pools(
    one_process_worker: Worker,
    shop_app: Celery,
    pg_dsn: str,
    run_id: str,
    beacon: str,
    outcomes: str,
) -> None:
    """The same under threads and gevent, bodies sharing one process."""
    tenant = f"{run_id}-{one_process_worker.pool}-one-every-write"
    _no_orm_write_commits_after_the_loss(
        one_process_worker, shop_app, pg_dsn, tenant, beacon, outcomes
    )
