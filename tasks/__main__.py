"""Operator commands: `python -m tasks init-db | add-tenant ID | remove-tenant ID`."""

from __future__ import annotations

import argparse
import os
import sys

from pglock_celery import PglockError

from .schema import apply_schema
from .tenants import TenantError, seed_tenants


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tasks")
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init-db", help="apply the schema; seed tenants if none exist")
    init.add_argument("--tenants", type=int, default=0, help="tenants to seed into an empty db")
    add = commands.add_parser("add-tenant", help="onboard a tenant (serial, under its lock)")
    add.add_argument("tenant_id")
    remove = commands.add_parser("remove-tenant", help="remove a tenant once no step of it runs")
    remove.add_argument("tenant_id")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    dsn = os.environ.get("PGLOCK_DSN", "")
    if not dsn:
        parser.error("set PGLOCK_DSN to the orchestrator's database")
    try:
        if args.command == "init-db":
            apply_schema(dsn)
            if args.tenants:
                import psycopg

                with psycopg.connect(dsn) as conn:
                    empty = conn.execute("SELECT NOT EXISTS (SELECT FROM tenants)").fetchone()
                if empty and empty[0]:
                    seed_tenants(dsn, [f"tenant-{n:03d}" for n in range(1, args.tenants + 1)])
        elif args.command == "add-tenant":
            seed_tenants(dsn, [args.tenant_id])
        else:
            from .tenants import remove_tenant

            remove_tenant.apply_async((args.tenant_id,)).get(timeout=180)
    except (TenantError, PglockError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
