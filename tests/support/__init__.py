"""What the test suites share: services, workers, PgBouncer, network namespaces, locks.

- ``ci``: whether this is a CI run (a missing capability then fails, never skips).
- ``services``: Postgres and Redis found or started, a database of the run's own.
- ``workers``: real ``celery worker`` processes; ``orchestra``: the orchestrator's.
- ``pgbouncer``: a real PgBouncer in front of the test server; ``rabbitmq``: a broker.
- ``netns``: a host in a network namespace that can be cut off.
- ``locks``: a lock with its own settings, and looking at locks from another session
  (``free_elsewhere``, ``terminate``).
- ``history`` (step runs and the overlap checker), ``leftovers``, ``cli``.
- Scripts the tests run in processes of their own (``python -m tests.support.<name>``):
  ``attempt``, ``holder``, ``fork_during_connect``, ``gevent_timeout``.
"""
