"""One TenantLockedTask call against a DSN, run where a test puts it (a network namespace).

    python -m tests.support.attempt DSN TENANT

Prints one JSON line: whether the body ran, the call's error (type and message)
and the seconds the call took. The pglock settings come from the environment.
"""

from __future__ import annotations

import json
import sys
import time

from pglock_celery import TenantLockedTask
from tests.support.locks import eager_app


def main(dsn: str, tenant: str) -> int:
    app = eager_app(dsn, "attempt")
    ran: list[str] = []

    @app.task(base=TenantLockedTask, shared=False)
    def step(tenant_id: str) -> str:
        ran.append(tenant_id)
        return "ran"

    started = time.monotonic()
    result = step.apply((tenant,))
    error = result.result if isinstance(result.result, BaseException) else None
    print(
        json.dumps(
            {
                "ran": bool(ran),
                "error": type(error).__name__ if error else None,
                "message": str(error) if error else None,
                "seconds": time.monotonic() - started,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
