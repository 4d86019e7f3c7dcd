"""The pglock-celery command: who holds which lock, a key for a name, a doctor, guards,
the steps of a change of the shards.

The same command runs as ``celery -A proj pglock ...`` (see celery_command.py);
``-A/--app`` gives either one the Celery app whose ``pglock_dsn`` to use.

Exit codes: 0 fine, 1 the doctor found something that makes the locks unsafe,
2 bad input or a database that cannot be reached (one line on stderr, never a
traceback or a password).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from . import __version__, sql
from .doctor import Budget, Finding, read_settings, run_checks
from .dsn import describe_target, dsn_problem, redact
from .exceptions import ConfigurationError, PglockError
from .guard import (
    GuardedTable,
    guarded_tables,
    install_guard,
    remove_guard,
)
from .inspect import Holder, list_holders
from .keys import lock_key
from .operator_session import operator_session
from .rollout import Rollout, describe
from .shards import Shard, parse_shards, previous_label

if TYPE_CHECKING:
    from .config import PglockConfig

CLI_APPLICATION_NAME = "pglock-celery-cli"


class UsageError(Exception):
    """Bad input: reported on one line with exit code 2."""


def escaped(text: str) -> str:
    """``text`` as the CLI prints it: every character a terminal would act on escaped.

    Lock names, table names, templates and everything else that comes from a server
    (or a neighbour's session) may hold a newline that would forge a row, or an
    escape sequence for the operator's terminal: each character that is not
    printable (controls, format characters such as bidirectional overrides, line
    separators) is printed as Python writes it (``\\n``, ``\\x1b``, ``\\u202e``),
    and a backslash as ``\\\\`` so that an escape is never ambiguous.
    """
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        "\\\\" if ch == "\\" else ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text
    )


def say(text: str, *, file: Any = None) -> None:
    """Print one line of output, escaped (see escaped)."""
    print(escaped(text), file=file)


def print_json(found: Any) -> None:
    """Print ``found`` as JSON: json.dumps escapes every control but DEL, escaped here."""
    print(json.dumps(found, indent=2).replace("\x7f", "\\u007f"))


def _dsn(args: argparse.Namespace) -> str:
    return _usable_dsn(args.dsn or _app_dsn(args) or os.environ.get("PGLOCK_DSN"))


def _targets(args: argparse.Namespace) -> list[tuple[str | None, str]]:
    """The databases a command works on, each with its shard's name (None: no shards).

    ``--dsn`` alone; else every shard of ``pglock_shards`` (the app's, or the
    environment's) and, during a change, of ``pglock_shards_previous`` whose database
    the new map lacks, or the one ``--shard`` names; else ``pglock_dsn``.
    """
    wanted = getattr(args, "shard", None)
    if args.dsn:
        if wanted:
            raise UsageError("--dsn and --shard: give one or the other")
        return [(None, _usable_dsn(args.dsn))]
    shards = _shards(args)
    if shards is None:
        if wanted:
            raise UsageError(f"--shard {wanted!r}: no pglock_shards is set")
        return [(None, _dsn(args))]
    # During a change of the shards, the previous map's databases too: a shard being
    # removed, or a moved shard's old database (named "NAME (previous map)").
    labelled = [(shard.name, shard.dsn) for shard in shards]
    for shard in _shards(args, "pglock_shards_previous") or ():
        if all(shard.dsn != dsn for _, dsn in labelled):
            current = any(name == shard.name for name, _ in labelled)
            labelled.append((previous_label(shard.name) if current else shard.name, shard.dsn))
    chosen = [(name, dsn) for name, dsn in labelled if wanted in (None, name)]
    if not chosen:
        names = ", ".join(name for name, _ in labelled)
        which = "pglock_shards names" if len(labelled) == len(shards) else "both maps name"
        raise UsageError(f"--shard {wanted!r}: {which} {names}")
    return [(name, _usable_dsn(dsn)) for name, dsn in chosen]


def _shards(args: argparse.Namespace, setting: str = "pglock_shards") -> tuple[Shard, ...] | None:
    """The app's (or else the environment's) pglock_shards (or ``setting``, the
    previous map's), parsed; None when unset.

    Read on its own, so that another invalid setting (the doctor's finding) does not
    hide the shards; an invalid value of its own is bad input.
    """
    app = _app(args)
    raw = app.conf.get(setting) if app is not None else None
    if raw is None:
        raw = os.environ.get(setting.upper()) or None
    try:
        return parse_shards(raw)
    except ValueError as exc:
        raise UsageError(f"invalid setting {setting}=<hidden>: {exc}") from None


def _sharded_settings(args: argparse.Namespace) -> PglockConfig | None:
    """The app's (or else the environment's) settings when they set pglock_shards."""
    from .config import get_config, load_config

    if _shards(args) is None:
        return None
    app = _app(args)
    try:
        return get_config(app) if app is not None else load_config(None)
    except PglockError as exc:
        raise UsageError(str(exc)) from None


def _headed(shard: str | None, dsn: str) -> str:
    """The line that starts a shard's part of a command's output."""
    return f"shard {shard} ({describe_target(dsn)}):"


def _usable_dsn(dsn: str | None) -> str:
    if not dsn:
        raise UsageError(
            "no database: pass --dsn, set pglock_dsn on the app given with -A, or set PGLOCK_DSN"
        )
    problem = dsn_problem(dsn)
    if problem is not None:
        raise UsageError(f"malformed DSN ({problem}); its text is not shown")
    return dsn


def connect(dsn: str, timeout: int = 5) -> psycopg.Connection:
    """A short-lived inspection session (never a lock session, never waiting for ever)."""
    try:
        return operator_session(dsn, CLI_APPLICATION_NAME, connect_timeout=timeout)
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        raise UsageError(
            f"cannot connect to {describe_target(dsn)}: {redact(reason, dsn)}"
        ) from None


def _age(since: str | None, now: dt.datetime) -> str:
    if since is None:
        return ""
    seconds = int((now - dt.datetime.fromisoformat(since)).total_seconds())
    hours, rest = divmod(max(seconds, 0), 3600)
    return (
        f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"
    )


def _shown_name(holder: Holder) -> str:
    if holder.name is None:
        return "-"
    return holder.name + ("…" if holder.name_truncated else "")


def cmd_locks(args: argparse.Namespace) -> int:
    found: list[tuple[str | None, Holder, dt.datetime]] = []
    targets = _targets(args)
    for shard, dsn in targets:
        with connect(dsn) as conn:
            now = conn.execute(sql.SERVER_NOW).fetchone()[0]  # type: ignore[index]
            found.extend(
                (shard, h, now)
                for h in list_holders(conn)
                if not args.prefix or (h.name or "").startswith(args.prefix)
            )
    sharded = any(shard is not None for shard, _ in targets)
    if args.json:
        print_json(
            [
                {
                    **({"shard": shard} if sharded else {}),
                    **h.as_dict(),
                    "age": _age(_since(h), now),
                }
                for shard, h, now in found
            ]
        )
        return 0
    _print_table(_lock_rows(found, sharded), sharded)
    shards = f" on {len(targets)} shards" if sharded else ""
    print(f"{len(found)} advisory lock(s) held{shards}")
    return 0


def _print_table(rows: list[tuple[str, ...]], sharded: bool) -> None:
    """The locks table, every cell escaped, columns as wide as their widest cell."""
    columns: tuple[str, ...] = (
        "LOCK", "KEY", "HOST", "PID", "TASK ID", "CLIENT", "LOCKED SINCE", "AGE", "STATE"
    )  # fmt: skip
    columns = ("SHARD", *columns) if sharded else columns
    table = [tuple(escaped(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in [columns, *table]) for i in range(len(columns))]
    for row in [columns, *table]:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())


def _lock_rows(
    found: list[tuple[str | None, Holder, dt.datetime]], sharded: bool
) -> list[tuple[str, ...]]:
    """The cells of the locks table, as the server gave them (escaped by the caller).

    Since when each lock is held: its grant time where its session records it (a
    library holder's); else the session's start, marked "~" (a bound, not the time).
    """
    return [
        (
            *((shard or "",) if sharded else ()),
            _shown_name(h),
            str(h.key),
            h.worker_host or "",
            str(h.worker_pid or ""),
            h.task_id or "",
            h.client_addr or "local",
            ("" if h.locked_at else "~") + (_since(h) or "")[:19].replace("T", " "),
            _age(_since(h), now),
            h.state or "",
        )
        for shard, h, now in found
    ]


def _since(holder: Holder) -> str | None:
    """When ``holder``'s lock was granted, or at the latest: its session's start."""
    return holder.locked_at or holder.backend_start


def cmd_key(args: argparse.Namespace) -> int:
    from .keys import key_to_lock_fields

    key = lock_key(args.name)
    classid, objid = key_to_lock_fields(key)
    say(str(key))
    if args.verbose:
        say(f"pg_locks: classid = {classid} AND objid = {objid} AND objsubid = 1")
        config = _sharded_settings(args)
        if config is not None:
            say(f"shard: {config.shard_of(key, args.name)}")
            previous = config.previous_for_key(key, args.name)
            if previous is not None:
                before = config.previous_map()
                assert before is not None
                say(
                    f"previous shard: {before.shard_of(key, args.name)} (a change of the "
                    "shards is under way: the name is locked there too, first)"
                )
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    # An invalid setting is a finding like any other (exit 1), not bad input: the
    # valid settings still count, and the checks run all the same.
    app = _app(args)
    budget = _budget(args, app)
    config, invalid = read_settings(app)
    targets = _doctor_targets(args, config, invalid)
    for _, dsn in targets:
        with connect(dsn):
            pass  # unreachable, refused, bad password: one line and exit 2
    findings: list[Finding] = []
    for shard, dsn in targets:
        if shard is not None and not args.json:
            say(_headed(shard, dsn))
        found = run_checks(
            dsn, lock_sessions=args.lock_sessions or 0, locks=args.locks,
            pooler=config.pooler, app=app, shard=shard, budget=budget,
        )  # fmt: skip
        if not args.json:
            for finding in found:
                print(_escaped_finding(finding).line())
        findings.extend(found)
    failed = [f for f in findings if f.level == "fail"]
    if args.json:
        print_json([f.as_dict() for f in findings])
    else:
        say(f"{len(failed)} problem(s) found" if failed else "no problem found")
    return 1 if failed else 0


def _doctor_targets(
    args: argparse.Namespace, config: PglockConfig, invalid: ConfigurationError | None
) -> list[tuple[str | None, str]]:
    """The databases the doctor checks: --dsn alone, else every shard, else the lock DSN."""
    if config.shards is not None and not args.dsn:
        return _targets(args)
    if invalid is not None and not (args.dsn or config.dsn):
        raise UsageError(f"no database to check, and {invalid}")
    return [(None, _usable_dsn(args.dsn or config.dsn))]


def _budget(args: argparse.Namespace, app: Any) -> Budget | None:
    """The fleet of --processes and --concurrency (default: the app's worker_concurrency)."""
    if args.processes is None:
        if args.concurrency is not None:
            raise UsageError("--concurrency needs --processes (the worker processes that lock)")
        return None
    if args.lock_sessions is not None:
        raise UsageError(
            "--lock-sessions or --processes: give one or the other (--processes counts "
            "the lock sessions of each strategy itself)"
        )
    if args.concurrency is not None:
        return Budget(args.processes, args.concurrency)
    configured = None if app is None else app.conf.worker_concurrency
    if not configured:  # Celery's own default (None, or 0): the worker host's CPUs
        where = "no Celery app given (-A)" if app is None else "the app sets no worker_concurrency"
        raise UsageError(
            f"--processes needs --concurrency (the locked calls each process runs at once): {where}"
        )
    try:
        concurrency = _count(str(configured))
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"the app's worker_concurrency: {exc}; give --concurrency") from None
    return Budget(args.processes, concurrency, "worker_concurrency")


def _count(text: str) -> int:
    """A whole number of at least 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def cmd_guard_install(args: argparse.Namespace) -> int:
    for shard, dsn in _targets(args):
        if shard is not None:
            say(_headed(shard, dsn))
        with connect(dsn) as conn:
            install_guard(conn, args.table, args.lock)
        say(f"guarded {args.table}: a write to a row needs the lock {args.lock}")
    return 0


def cmd_guard_remove(args: argparse.Namespace) -> int:
    for shard, dsn in _targets(args):
        if shard is not None:
            say(_headed(shard, dsn))
        with connect(dsn) as conn:
            before = guarded_tables(conn)
            remove_guard(conn, args.table)
            left = {t.table for t in guarded_tables(conn)}
        removed = [t for t in before if t.table not in left]
        if not removed:
            say(f"{args.table} had no guard: nothing removed")
        else:
            tables = ", ".join(t.table for t in removed)
            say(f"removed the guard (lock {removed[0].lock_name}) of {tables}: writes need no lock")
    return 0


def _escaped_finding(finding: Finding) -> Finding:
    """``finding`` with its texts escaped (a table's or a setting's name is the server's)."""
    return dataclasses.replace(
        finding,
        check=escaped(finding.check),
        message=escaped(finding.message),
        fix=escaped(finding.fix),
    )


def _guard_state(table: GuardedTable) -> str:
    if not table.enabled:
        return "DISABLED (writes are not checked)"
    if not table.stored_row_guarded:
        return "INCOMPLETE (the row as stored is not checked: install again)"
    return "on" if table.truncate_guarded else "on (TRUNCATE not guarded)"


def cmd_guard_list(args: argparse.Namespace) -> int:
    found: list[tuple[str | None, GuardedTable]] = []
    targets = _targets(args)
    for shard, dsn in targets:
        with connect(dsn) as conn:
            found.extend((shard, table) for table in guarded_tables(conn))
    sharded = any(shard is not None for shard, _ in targets)
    if args.json:
        listed = [
            {**({"shard": shard} if sharded else {}), **vars(t), "state": _guard_state(t)}
            for shard, t in found
        ]
        print_json(listed)
        return 0
    head: tuple[str, ...] = ("TABLE", "LOCK", "STATE")
    head = ("SHARD", *head) if sharded else head
    rows = [
        head,
        *(
            tuple(
                escaped(cell)
                for cell in (
                    *((shard or "",) if sharded else ()),
                    t.table,
                    t.lock_name,
                    _guard_state(t),
                )
            )
            for shard, t in found
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]))
    say(f"{len(found)} guarded table(s)" + (f" on {len(targets)} shards" if sharded else ""))
    return 0


def _rollout(args: argparse.Namespace) -> Rollout:
    """The databases of both maps (each DSN once), with this configuration's map."""
    config = _sharded_settings(args)
    identity = None if config is None else config.map_identity
    if config is None or identity is None:
        raise UsageError("no pglock_shards is set: give the app (-A) or PGLOCK_SHARDS")
    databases: dict[str, tuple[str, str]] = {}
    for shard in (*(config.shards or ()), *(config.shards_previous or ())):
        dsn = _usable_dsn(shard.dsn)
        databases.setdefault(dsn, (shard.name, dsn))
    return Rollout(list(databases.values()), identity, connect)


def _print_accepted(rollout: Rollout) -> None:
    accepted = rollout.accepted()
    for shard, dsn in rollout.shards:
        maps = accepted[shard]
        shown = "every map (no record)" if maps is None else ", ".join(maps) or "no map"
        say(f"{_headed(shard, dsn)} accepts {shown}")


def cmd_shards_status(args: argparse.Namespace) -> int:
    rollout = _rollout(args)
    identity = rollout.identity
    if identity.transition:
        say(f"this configuration: the change from map {identity.previous} to map "
              f"{identity.steady} (its sessions record {identity.name})")  # fmt: skip
    else:
        say(f"this configuration: map {identity.name}")
    _print_accepted(rollout)
    for shard, sessions in rollout.connected().items():
        counts = collections.Counter(session.map or "(none recorded)" for session in sessions)
        shown = ", ".join(f"{n} of map {m}" for m, n in sorted(counts.items())) or "none"
        say(f"shard {shard}: lock sessions connected: {shown}")
    return 0


def cmd_shards_init(args: argparse.Namespace) -> int:
    rollout = _rollout(args)
    if rollout.identity.transition:
        raise UsageError("init takes the steady configuration: pglock_shards_previous is set")
    others = rollout.init()
    _print_accepted(rollout)
    if others:
        say(f"sessions of other maps are connected, let in before: {describe(others)}; "
              "stop those workers")  # fmt: skip
        return 1
    say(f"initialised: workers of another map than {rollout.identity.name} are refused")
    return 0


def cmd_shards_begin(args: argparse.Namespace) -> int:
    rollout = _rollout(args)
    others = rollout.begin()
    _print_accepted(rollout)
    if others:
        say(f"begun, but sessions of other maps are connected, let in before: "
              f"{describe(others)}; stop those workers")  # fmt: skip
        return 1
    identity = rollout.identity
    say(f"begun: old-map workers (map {identity.previous}) and transition workers (map "
          f"{identity.name}) lock; new-map workers (map {identity.steady}) are refused "
          "until `shards finish`")  # fmt: skip
    return 0


def cmd_shards_finish(args: argparse.Namespace) -> int:
    rollout = _rollout(args)
    identity = rollout.identity
    say(f"refusing the old map ({identity.previous}): waiting up to {args.wait:g} s for "
          "every session of another map than the transition to end")  # fmt: skip
    already, left = rollout.finish(args.wait, say)
    if left:
        say(f"not finished: {describe(left)}; meanwhile old-map and new-map workers are "
              "refused, transition workers lock: stop those workers, run finish again")  # fmt: skip
        return 1
    _print_accepted(rollout)
    say(f"finished{' already' if already else ''}: map {identity.steady} is accepted; roll "
          "the workers over to the new map alone (pglock_shards_previous unset)")  # fmt: skip
    return 0


def build_parser(prog: str = "pglock-celery") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    _add_app_options(parser)
    commands = parser.add_subparsers(dest="command", required=True)

    locks = commands.add_parser("locks", help="every advisory lock held, with its holder")
    locks.add_argument("--dsn", help="the database (default: PGLOCK_DSN)")
    locks.add_argument("--json", action="store_true", help="JSON for scripts")
    locks.add_argument("--prefix", default="", help="only lock names starting with this")
    locks.set_defaults(run=cmd_locks)

    key = commands.add_parser("key", help="the advisory lock key of a name")
    key.add_argument("name")
    key.add_argument("-v", "--verbose", action="store_true", help="also the pg_locks fields")
    key.set_defaults(run=cmd_key)

    doctor = commands.add_parser("doctor", help="is this database set up for safe locks?")
    doctor.add_argument("--dsn", help="the database (default: PGLOCK_DSN)")
    doctor.add_argument("--json", action="store_true", help="JSON for scripts")
    doctor.add_argument(
        "--lock-sessions",
        type=int,
        help="lock sessions the fleet may open at once, counted by hand (or --processes)",
    )
    doctor.add_argument(
        "--locks",
        type=int,
        default=0,
        help="advisory locks the fleet may hold at once (its running locked calls at peak)",
    )
    doctor.add_argument(
        "--processes",
        type=_count,
        help="worker processes that may lock: each shard's session budget for the strategy",
    )
    doctor.add_argument(
        "--concurrency",
        type=_count,
        help="locked calls each of those processes runs at once (default: the app's "
        "worker_concurrency)",
    )
    doctor.set_defaults(run=cmd_doctor)

    shards = commands.add_parser(
        "shards", help="a change of pglock_shards, step by step (docs/shards.md)"
    )
    steps = shards.add_subparsers(dest="shards_command", required=True)
    status = steps.add_parser("status", help="which maps each shard accepts, who is connected")
    status.set_defaults(run=cmd_shards_status)
    init = steps.add_parser("init", help="accept this map alone: refuse workers of any other")
    init.set_defaults(run=cmd_shards_init)
    begin = steps.add_parser(
        "begin", help="accept the old map and the transition, refuse the new map"
    )
    begin.set_defaults(run=cmd_shards_begin)
    finish = steps.add_parser(
        "finish", help="refuse the old map, wait until its workers are gone, accept the new"
    )
    finish.add_argument(
        "--wait", type=float, default=300.0, metavar="SECONDS",
        help="how long to wait for the old map's sessions to end (default 300)",
    )  # fmt: skip
    finish.set_defaults(run=cmd_shards_finish)

    guard = commands.add_parser(
        "guard", help="guarded tables: Postgres refuses a write without the row's lock"
    )
    guards = guard.add_subparsers(dest="guard_command", required=True)
    install = guards.add_parser("install", help="guard a table (idempotent)")
    install.add_argument("table", help="the table, schema-qualified or on the search_path")
    install.add_argument(
        "--lock",
        required=True,
        metavar="TEMPLATE",
        help='lock name over columns: "training:{tenant_id}"',
    )
    install.set_defaults(run=cmd_guard_install)
    remove = guards.add_parser("remove", help="remove a table's guard")
    remove.add_argument("table")
    remove.set_defaults(run=cmd_guard_remove)
    listing = guards.add_parser("list", help="every guarded table with its lock name template")
    listing.add_argument("--json", action="store_true", help="JSON for scripts")
    listing.set_defaults(run=cmd_guard_list)
    for command in (install, remove, listing):
        command.add_argument("--dsn", help="the database (default: PGLOCK_DSN)")
    for command in (locks, doctor, install, remove, listing):
        command.add_argument(
            "--shard", help="with pglock_shards: this shard only (default: every shard)"
        )
    return parser


def main(argv: Sequence[str] | None = None, *, app: Any = None, prog: str = "pglock-celery") -> int:
    """Run the command; ``app`` is a Celery app already loaded (by ``celery -A``)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        if app is not None and args.app is None:
            args.loaded_app = app
        result: int = args.run(args)
        return result
    except (UsageError, PglockError) as exc:
        say(f"pglock-celery: error: {exc}", file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        dsn = getattr(args, "dsn", None) or _app_dsn(args) or os.environ.get("PGLOCK_DSN")
        reason = redact(" ".join(str(exc).split()), dsn)
        say(f"pglock-celery: error: {reason}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# The Celery app (-A/--app) and --version: kept apart from the commands above.


def _add_app_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-A",
        "--app",
        metavar="APP",
        help="a Celery app (module or module:attribute, as for celery -A): its pglock_dsn "
        "is the database when --dsn is not given",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def _load_app(name: str) -> Any:
    """Import the Celery app ``name`` the way ``celery -A`` does."""
    from celery.app.utils import find_app

    try:
        return find_app(name)
    except Exception as exc:  # anything the app's own import raises
        reason = f"{type(exc).__name__}: {exc}"
        raise UsageError(f"cannot load the Celery app {name!r}: {reason}") from None


def _app(args: argparse.Namespace) -> Any:
    """The Celery app given (-A, or loaded by ``celery -A``), or None."""
    if getattr(args, "loaded_app", None) is None and getattr(args, "app", None):
        args.loaded_app = _load_app(args.app)
    return getattr(args, "loaded_app", None)


def _app_dsn(args: argparse.Namespace) -> str | None:
    """The app's pglock_dsn (its PGLOCK_DSN fallback included), or None without an app."""
    from .config import get_config

    app = getattr(args, "loaded_app", None)
    if app is None and getattr(args, "app", None):
        app = args.loaded_app = _load_app(args.app)
    return None if app is None else get_config(app).dsn


if __name__ == "__main__":
    sys.exit(main())
