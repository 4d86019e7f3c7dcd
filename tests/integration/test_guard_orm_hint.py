"""A guarded write refused inside a locked task through Django's ORM says why and what to do.

The ORM writes through its own connection, which is not the lock session: the guard
refuses, and its HINT says that the ORM's connection is not the lock's and to write
through ``current_lock().connection`` or ``lock.transaction()``. Django runs in a
process of its own (its settings are process-wide), on the run's real Postgres.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from pglock_celery import install_guard
from pglock_celery.guard import GUARD_SQLSTATE

SCRIPT = r"""
import json, os, sys
import django
from django.conf import settings
from psycopg.conninfo import conninfo_to_dict

params = conninfo_to_dict(os.environ["PGLOCK_DSN"])
settings.configure(
    INSTALLED_APPS=[],
    DATABASES={"default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.get("dbname", ""), "USER": params.get("user", ""),
        "PASSWORD": params.get("password", ""), "HOST": params.get("host", ""),
        "PORT": params.get("port", ""),
        "OPTIONS": {"options": "-c search_path=" + sys.argv[1]},
    }},
)
django.setup()

from celery import Celery
from django.db import DatabaseError, models
from django.db.models import F
from pglock_celery import TenantLockedTask, current_lock

class Job(models.Model):
    tenant_id = models.TextField(primary_key=True)
    n = models.IntegerField()

    class Meta:
        app_label = "orm_hint"
        db_table = "jobs"
        managed = False

app = Celery("orm_hint", set_as_current=True)
app.conf.pglock_dsn = os.environ["PGLOCK_DSN"]

@app.task(base=TenantLockedTask, lock_name="orm:{tenant_id}")
def bump(tenant_id):
    lock = current_lock()
    assert lock is not None and lock.acquired
    try:
        Job.objects.filter(tenant_id=tenant_id).update(n=F("n") + 1)
    except DatabaseError as exc:
        cause = exc.__cause__
        return {"sqlstate": cause.sqlstate, "hint": cause.diag.message_hint,
                "message": str(cause).splitlines()[0]}
    return {"sqlstate": None}

print(json.dumps(bump(sys.argv[2])))
"""


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    name = f"guard_orm_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        admin.execute(f"CREATE TABLE {name}.jobs (tenant_id text PRIMARY KEY, n int NOT NULL)")
        admin.execute(f"INSERT INTO {name}.jobs VALUES ('t1', 0)")
        install_guard(admin, f"{name}.jobs", "orm:{tenant_id}")
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def test_a_refused_orm_write_in_a_locked_task_hints_at_the_locks_connection(
    pg_dsn: str, schema: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, schema, "t1"],
        env={**os.environ, "PGLOCK_DSN": pg_dsn},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["sqlstate"] == GUARD_SQLSTATE
    assert outcome["message"].startswith(f"pglock guard: UPDATE on {schema}.jobs refused")
    hint = outcome["hint"]
    assert "ORM's connection" in hint and "Django" in hint and "is not the lock's" in hint
    assert "current_lock().connection" in hint and "lock.transaction()" in hint
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f"SELECT n FROM {schema}.jobs").fetchone() == (0,)
