"""A Celery app whose settings live under a namespace of its own (``PROJ_*``), shards too.

Its two shard maps (the current one and the previous) carry a DSN password each, from
PGLOCK_TEST_SECRET: ``celery report`` and ``celery inspect conf`` must show neither.
Configured from the environment the test sets: PGLOCK_TEST_BROKER, PGLOCK_TEST_QUEUE,
PGLOCK_TEST_SHARD_DSN (the server the shards name) and PGLOCK_TEST_SECRET.
"""

from __future__ import annotations

import os

from celery import Celery

_dsn = os.environ.get("PGLOCK_TEST_SHARD_DSN", "host=127.0.0.1 user=postgres dbname=postgres")
_secret = os.environ.get("PGLOCK_TEST_SECRET", "namespaced-s3cret")


SETTINGS = {
    "PROJ_BROKER_URL": os.environ.get("PGLOCK_TEST_BROKER", "redis://127.0.0.1:6379/0"),
    "PROJ_TASK_DEFAULT_QUEUE": os.environ.get("PGLOCK_TEST_QUEUE", "pglock-tests"),
    "PROJ_BROKER_CONNECTION_RETRY_ON_STARTUP": True,
    "PROJ_PGLOCK_SHARDS": {
        "a": f"{_dsn} password={_secret}",
        "b": {"dsn": f"{_dsn} password={_secret}", "patroni_url": None},
    },
    "PROJ_PGLOCK_SHARDS_PREVIOUS": {"a": f"{_dsn} password={_secret}"},
}

app = Celery("namespaced", set_as_current=False)
app.config_from_object(SETTINGS, namespace="PROJ")
