"""TenantLockedTask: every call runs under the advisory lock named by its arguments.

The lock is taken in ``__call__`` on a session of its own and released in its
``finally``, so every way out of the body (return, exception, ``self.retry``,
``Ignore``, a soft time limit) releases it; a hard time limit or a killed
process closes the session, and Postgres frees the lock with it. Nothing about
a call is kept on the task instance, which every call in a process shares.
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import logging
import os
import re
import string
import warnings
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, ClassVar, Literal, TypedDict, TypeGuard

import psycopg
from celery import Celery, Task, signals, states
from celery.canvas import _chain, chord, group, maybe_signature
from celery.exceptions import Ignore, Retry

from .config import PglockConfig, get_config, retry_countdown
from .dsn import database_address
from .exceptions import (
    ConfigurationError,
    LockLost,
    LockNameError,
    LockTimeout,
    PglockError,
    lost_during_step,
)
from .inspect import database_identity
from .keys import check_lock_name, check_timeout, lock_key
from .leader import leader_setting, leader_source
from .lock import AdvisoryLock, _current, current_lock
from .loss import Loss
from .monitor import Body, Hold
from .orm import fence_orm
from .sources import registry
from .startup import announce

logger = logging.getLogger("pglock_celery.task")

LOCK_SKIPPED_EVENT = "task-lock-skipped"
"""The task event (``"task-lock-skipped"``) sent when a call skips because another session
holds its lock; its fields: ``lock``, and ``holder`` (every field Postgres reported)."""
LOCK_LOST_EVENT = "task-lock-lost"
"""The task event (``"task-lock-lost"``) sent once for each loss of a running call's lock,
whoever found it (the monitor, the body, a transaction, the release); its fields:
``lock``, ``reason``, ``loss`` (its kind) and ``holder`` (the session's application_name)."""
#: pglock_on_lost: raise LockLost inside the running body.
INTERRUPT = "interrupt"
#: Exit status of a worker process ended by pglock_on_lost = "terminate".
LOCK_LOST_EXIT_STATUS = 70

SKIP, WAIT, RETRY = "skip", "wait", "retry"
LOCK_MODES = (SKIP, WAIT, RETRY)


class SkipHolder(TypedDict):
    """Who held the lock when a call skipped, as the skip result keeps it (JSON-safe).

    Enough to find the holder's run (its task id, its process and host), its
    server session (the backend to look up or end) and how long it has held the
    lock. Everything else Postgres reports (application_name, client address,
    session state) goes in the ``task-lock-skipped`` event and the skip's log line.
    """

    task_id: str | None
    """The holder's task id, when a TenantLockedTask (or a lock taken in a task) holds it."""
    worker_pid: int | None
    """The holder's worker process, when the library holds the lock."""
    worker_host: str | None
    """The host of that process."""
    backend_pid: int
    """The server process of the holder's lock session (``pg_stat_activity.pid``)."""
    locked_at: str | None
    """When the lock was granted (ISO 8601), when its session records it."""


class SkipResult(TypedDict):
    """What a skipped call returns by default (``TenantLockedTask.on_lock_skipped``)."""

    skipped: Literal[True]
    """Always True: what ``pglock_celery.skipped(result)`` looks for."""
    lock: str
    """The lock name the call resolved."""
    holder: SkipHolder | None
    """Who held it, or None (``pglock_report_holder = False``, or unknown)."""


def skipped(result: object) -> TypeGuard[SkipResult]:
    """Return whether ``result`` is a skip result rather than what a body returned.

    True for the default skip result (a mapping with ``"skipped": True``, a str
    ``"lock"`` and a ``"holder"``), also as ``AsyncResult.get()`` gives it back
    through any result serializer. A task that overrides ``on_lock_skipped`` tells
    its own results apart itself.
    """
    return (
        isinstance(result, Mapping)
        and result.get("skipped") is True
        and isinstance(result.get("lock"), str)
        and "holder" in result
    )


def _skip_holder(holder: Mapping[str, Any]) -> SkipHolder:
    return {
        "task_id": holder.get("task_id"),
        "worker_pid": holder.get("worker_pid"),
        "worker_host": holder.get("worker_host"),
        "backend_pid": holder["backend_pid"],
        "locked_at": holder.get("locked_at"),
    }


# The lock of the TenantLockedTask call running in this context (None for a call
# running under its caller's hold): what its self.retry may release.
_this_call: ContextVar[AdvisoryLock | None] = ContextVar("pglock_this_call", default=None)


@signals.celeryd_init.connect
def _events_flag_to_conf(conf: Any = None, options: Any = None, **_: Any) -> None:
    """Make ``celery worker -E`` visible to tasks as ``worker_send_task_events``.

    The flag only reaches the worker's own event dispatcher; skip events are
    sent from the task, which reads the setting (inherited by pool children).
    """
    if conf is not None and options and options.get("task_events"):
        conf.worker_send_task_events = True


def configuration_problems(app: Celery) -> list[str]:
    """Return what is wrong with ``app``'s pglock settings and TenantLockedTask options.

    Each problem names the setting as written, or the task and its option, and
    why; an empty list means every call can at least resolve its lock. Found
    without any call, as a worker starts (see ``_refuse_to_start``). An app with
    a TenantLockedTask needs a lock DSN: an absent or malformed ``pglock_dsn`` is
    a problem too (never quoting the DSN), so a deploy that forgot it does not
    pass its readiness checks and then fail every locked call.
    """
    problems: list[str] = []
    config: PglockConfig | None = None
    try:
        config = get_config(app)
    except ConfigurationError as exc:
        problems.append(str(exc))
    locked = [task for task in app.tasks.values() if isinstance(task, TenantLockedTask)]
    shards = config.each_shard() if locked and config is not None else ()
    for _, shard in shards:
        try:
            shard.require_dsn()
        except ConfigurationError as exc:
            problems.append(str(exc))
    for task in locked:
        problems.extend(task.configuration_problems())
    for _, shard in shards if not problems else ():
        leader, setting = leader_source(shard), leader_setting(shard)
        fenced = leader.problem(shard.check_interval) if leader is not None else None
        if fenced is not None and setting is not None:
            problems.append(f"{shard.named(setting)}: {fenced}")
    return problems


@signals.worker_init.connect
def _refuse_to_start(sender: Any = None, **_: Any) -> None:
    """Stop a worker whose pglock settings or task options are invalid, before its pool starts.

    ``worker_init`` is sent in the worker's main process once every task module
    is imported (autodiscovered ones too) and before the pool forks. Celery
    logs and swallows an Exception from a signal handler, not a SystemExit:
    the worker exits with status 1 and the reasons on stderr (logging is not
    set up yet).
    """
    app = getattr(sender, "app", None)
    if app is None:
        return
    problems = configuration_problems(app)
    if problems:
        reasons = "".join(f"\n  - {problem}" for problem in problems)
        raise SystemExit(f"pglock-celery: worker {sender.hostname} refuses to start:{reasons}")


@signals.worker_ready.connect
def _say_where_locks_live(sender: Any = None, **_: Any) -> None:
    """Log where a worker's locks live, and warn when it cannot reach there (startup.py)."""
    app = getattr(sender, "app", None)
    if app is not None and any(isinstance(t, TenantLockedTask) for t in app.tasks.values()):
        announce(app)


def _same_database(a: PglockConfig, b: PglockConfig) -> bool:
    """Whether locks taken with ``a`` and with ``b`` surely live in the same database.

    Advisory locks belong to one database of one server. The DSNs count as the
    same when libpq resolves them to the same hosts, host addresses, ports,
    service and database name (order, URI or key=value form, user, password
    and other options aside). Otherwise (another database, or one server named
    two ways: by address and by host name) both servers are asked which
    database they serve, on a short plain session each. A server that cannot
    be asked leaves the doubt, and doubt takes the lock.
    """
    if a.dsn == b.dsn:
        return True
    where_a, where_b = database_address(a.dsn), database_address(b.dsn)
    if where_a is not None and where_a == where_b:
        return True
    identity = database_identity(a)
    return identity is not None and identity == database_identity(b)


#: Options of other lock libraries (celery-once, celery-singleton) that mean nothing
#: here: a task that sets one is warned, not silently ignored.
FOREIGN_OPTIONS = ("once", "lock_expiry", "raise_on_duplicate", "unlock_before_run")


class TenantLockedTask(Task):  # type: ignore[type-arg]
    """A Celery task whose body runs only while it holds a Postgres advisory lock."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for option in FOREIGN_OPTIONS:
            if option in cls.__dict__:
                warnings.warn(
                    f"task {cls.__name__}: {option!r} is an option of another lock library "
                    "and does nothing here (see the README's migration guide)",
                    RuntimeWarning,
                    stacklevel=2,
                )

    lock_name: ClassVar[str | Callable[..., str]] = "tenant:{tenant_id}"
    """The lock of a call: a ``str.format`` template over the call's bound arguments
    (defaults applied), or a callable taking the call's arguments and returning the
    name. Default ``"tenant:{tenant_id}"``."""
    lock_mode: ClassVar[str] = SKIP
    """``"skip"`` (default): return the skip result when the lock is held elsewhere;
    ``"wait"``: block until it is free (bounded by ``lock_timeout``); ``"retry"``:
    ``self.retry`` after a countdown, holding nothing meanwhile."""
    lock_timeout: ClassVar[float | None] = None
    """Seconds a ``"wait"`` call waits before LockTimeout; None (default): no bound."""
    lock_retry_countdown: ClassVar[float | None] = None
    """Countdown of a ``"retry"`` call in seconds; None (default): the
    ``pglock_retry_countdown`` setting (5 s)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = self.resolve_lock_name(args, kwargs)
        options = self.__dict__.get("_pglock_options")
        if options is None or options[:2] != (self.lock_mode, self.lock_timeout):
            # Checked once per value (a worker checks them as it starts, too).
            mode, timeout = self._checked_mode(), self._checked_timeout()
            options = self.__dict__["_pglock_options"] = (
                self.lock_mode,
                self.lock_timeout,
                mode,
                timeout,
            )
        mode, timeout = options[2], options[3]
        # The lock is made with every shard (and, during a change of the shards, the
        # previous map, for a moving name's lock there); the call's own settings are
        # its name's shard's.
        whole = config = get_config(self.app)
        if config.shards is not None:
            config = config.for_key(lock_key(name), name)
        config.require_dsn()
        outer = current_lock()
        if (
            outer is not None
            and outer.name == name
            and outer.owned_here()
            and _same_database(outer.config, config)
        ):
            # Called inline by the body that holds this very lock in this very
            # database (apply(), a direct call), in its own thread and greenlet: it
            # runs under that hold. Other threads, greenlets and processes still
            # exclude, a context copied into another thread too; a call whose lock
            # lives in another database takes it there.
            call_token = _this_call.set(None)
            try:
                return super().__call__(*args, **kwargs)
            finally:
                _this_call.reset(call_token)
        # The body to interrupt when the lock is found lost (pglock_on_lost).
        body = Body(name, registry.monitor, task=self.name) if config.on_lost == INTERRUPT else None
        lock = AdvisoryLock(
            name,
            config=whole,
            wait=mode == WAIT,
            timeout=timeout,
            task_id=self.request.id,
            on_lost=functools.partial(
                self._lock_lost,
                task_id=self.request.id,
                hostname=self.request.hostname,
                reaction=config.on_lost,
                body=body,
            ),
        )
        call_token = _this_call.set(lock)
        try:
            try:
                return self._run_locked(lock, mode, config, args, kwargs, body)
            finally:
                _this_call.reset(call_token)
        except Exception as exc:
            loss = lock.loss
            if loss is None or not (isinstance(exc, LockLost) or _a_database_error(exc)):
                raise
            # One text whoever found the loss (the monitor, the body, a transaction, the
            # release) and under every pool; the finder's own error is its cause.
            raise LockLost(lost_during_step(lock.label, loss.detail, self.name)) from exc

    def _run_locked(
        self,
        lock: AdvisoryLock,
        mode: str,
        config: PglockConfig,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        body: Body | None,
    ) -> Any:
        try:
            acquired = lock.acquire()
        except PglockError as exc:
            # Celery's autoretry_for wraps run(), which never sees the errors
            # of taking the lock; honour it for them here.
            autoretry_for: tuple[type[BaseException], ...] = getattr(self, "autoretry_for", ())
            if autoretry_for and isinstance(exc, autoretry_for):
                raise self.retry(exc=exc, **getattr(self, "retry_kwargs", {})) from exc
            raise
        error: BaseException | None = None
        try:
            if not acquired:
                return self._lock_busy(lock, mode, config, args, kwargs)
            token = _current.set(lock)
            if body is not None:
                body.start()
            try:
                with fence_orm(lock, config):
                    return super().__call__(*args, **kwargs)
            except Exception as exc:
                # A failed lock session is a lost lock, whatever the statement was (held()
                # finds and reports the loss; __call__ then raises LockLost); an SQL error
                # of the body on a live session is its own.
                if lock.loss is None and _a_database_error(exc):
                    lock.held()
                raise
            finally:
                if body is not None:
                    body.end()
                _current.reset(token)
        except BaseException as exc:
            error = exc
            raise
        finally:
            # What follows this call (its chain, callbacks, a chord) may take the
            # lock at once: the release returns only once the server freed it.
            lock.finish(error)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Release this call's lock, then retry as Celery does.

        The retry message must not reach another worker while this call still
        holds the lock, or the retry would be skipped by its own lock. Only the
        lock of the call that retries is released, never a caller's.
        """
        self._release_before_handing_on("retrying")
        return super().retry(*args, **kwargs)

    def on_replace(self, sig: Any) -> Any:
        """Release this call's lock, then send the replacement as Celery does.

        Celery publishes the replacement here (``self.replace()``): like a
        retry, it must not find its own lock still held by this call. Only the
        lock of the call that is replaced is released, never a caller's.
        """
        self._release_before_handing_on("replacing")
        return super().on_replace(sig)

    def _release_before_handing_on(self, doing: str) -> None:
        lock = _this_call.get()
        if lock is not None and lock.acquired:
            try:
                lock.release()
            except LockLost as lost:
                logger.warning(
                    "%s (before %s task %s)",
                    lost,
                    doing,
                    self.name,
                    extra={"lock": lock.label, "task_id": self.request.id},
                )

    def on_lock_skipped(
        self,
        lock_name: str,
        holder: dict[str, Any] | None,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> Any:
        """Return the result of a call that skipped because the lock was held.

        ``holder`` is everything Postgres reported about the holder (the fields of
        ``pglock_celery.holder()``, as a dict), or None. The default result is a
        ``SkipResult``, small whatever the holder: ``{"skipped": True, "lock":
        name, "holder": SkipHolder or None}``; ``pglock_celery.skipped(result)``
        tells it from a result of the body.
        """
        result: SkipResult = {
            "skipped": True,
            "lock": lock_name,
            "holder": _skip_holder(holder) if holder is not None else None,
        }
        return result

    def resolve_lock_name(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """Return the lock name of a call, or raise LockNameError saying why."""
        # A function stored as a class attribute would come back bound to the
        # task; the callable takes the call's arguments only.
        spec = inspect.getattr_static(self, "lock_name")
        if isinstance(spec, (staticmethod, classmethod)):
            spec = spec.__get__(None, type(self))
        if callable(spec):
            try:
                name = spec(*args, **kwargs)
            except Exception as exc:
                raise LockNameError(
                    f"task {self.name}: lock_name callable raised {type(exc).__name__}: {exc}"
                ) from exc
        else:
            name = self._format_lock_name(spec, args, kwargs)
        if not isinstance(name, str):
            raise LockNameError(
                f"task {self.name}: lock name must be a str, got {type(name).__name__}"
            )
        try:
            return check_lock_name(name)
        except LockNameError as exc:
            raise LockNameError(f"task {self.name}: {exc}") from None

    def _format_lock_name(
        self, template: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> str:
        values = self._simple_arguments(args, kwargs)
        if values is None:
            try:
                bound = self._run_signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise LockNameError(
                    f"task {self.name}: the call's arguments do not fit its signature "
                    f"({exc}), so lock_name {template!r} cannot be resolved"
                ) from exc
            bound.apply_defaults()
            values = dict(bound.arguments)
            for parameter in self._run_signature.parameters.values():
                if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                    values.update(values.pop(parameter.name, {}))
        try:
            return template.format(**values)
        except KeyError as exc:
            raise LockNameError(
                f"task {self.name}: lock_name {template!r} names argument "
                f"{exc.args[0]!r}, which the call lacks (it has: "
                f"{', '.join(self._in_signature_order(values)) or 'no arguments'})"
            ) from exc
        except (IndexError, AttributeError, ValueError, TypeError) as exc:
            raise LockNameError(
                f"task {self.name}: lock_name {template!r} cannot be formatted: {exc}"
            ) from exc

    def _in_signature_order(self, values: Mapping[str, Any]) -> list[str]:
        order = list(self._run_signature.parameters)
        return sorted(values, key=lambda name: order.index(name) if name in order else len(order))

    @functools.cached_property
    def _run_signature(self) -> inspect.Signature:
        return inspect.signature(self.run)

    @functools.cached_property
    def _plain_parameters(self) -> tuple[tuple[str, ...], frozenset[str], dict[str, Any]] | None:
        """The run signature's names, required names and defaults, when it has no
        ``*args``, ``**kwargs`` or positional-only parameter; else None."""
        parameters = self._run_signature.parameters.values()
        plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        if any(p.kind not in plain for p in parameters):
            return None
        positional = tuple(
            p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        required = frozenset(p.name for p in parameters if p.default is inspect.Parameter.empty)
        defaults = {
            p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty
        }
        return positional, required, defaults

    def _simple_arguments(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """What Signature.bind with apply_defaults gives (as a dict, in any order), for a
        call that plainly fits a plain signature (the common case, without its cost);
        None for any other call."""
        plain = self._plain_parameters
        if plain is None:
            return None
        positional, required, defaults = plain
        if len(args) > len(positional):
            return None
        given = positional[: len(args)]
        values = {**defaults, **dict(zip(given, args, strict=True))}
        parameters = self._run_signature.parameters
        for name, value in kwargs.items():
            if name in given or name not in parameters:
                return None  # bind raises: left to it, for its message
            values[name] = value
        if not required <= values.keys():
            return None
        return values

    def configuration_problems(self) -> list[str]:
        """Return what is wrong with this task's lock options, each naming task and option."""
        problems: list[str] = []
        checks: tuple[Callable[[], object], ...] = (
            self._checked_mode,
            self._checked_timeout,
            self._checked_countdown,
            self._checked_template,
        )
        for check in checks:
            try:
                check()
            except ConfigurationError as exc:
                problems.append(str(exc))
        return problems

    def _checked_countdown(self) -> None:
        countdown = self.lock_retry_countdown
        if countdown is None:
            return
        if isinstance(countdown, bool) or not isinstance(countdown, (int, float)):
            problem = "must be a number of seconds above 0 or None"
        else:
            try:
                retry_countdown(countdown)
                return
            except ValueError as exc:
                problem = str(exc)
        raise ConfigurationError(
            f"task {self.name}: lock_retry_countdown {problem}, not {countdown!r}"
        )

    def _checked_template(self) -> None:
        """Refuse a lock_name that no call could resolve: a field naming an argument the
        task cannot take (no such parameter, no ``**kwargs``), a positional field, bad syntax."""
        spec = inspect.getattr_static(self, "lock_name")
        if isinstance(spec, (staticmethod, classmethod)) or callable(spec):
            return
        if not isinstance(spec, str):
            raise ConfigurationError(
                f"task {self.name}: lock_name must be a str.format template or a callable, "
                f"not {type(spec).__name__}"
            )
        parameters = self._run_signature.parameters.values()
        any_name = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        names = [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD]
        try:
            fields = _template_fields(spec)
        except ValueError as exc:
            raise ConfigurationError(
                f"task {self.name}: lock_name {spec!r} is not a valid template: {exc}"
            ) from None
        for field in fields:
            argument = _FIELD_ARGUMENT.match(field)
            if argument is None or argument.group().isdigit():
                raise ConfigurationError(
                    f"task {self.name}: lock_name {spec!r} has a positional field "
                    f"{{{field}}}: name the argument it stands for"
                )
            if not any_name and argument.group() not in names:
                raise ConfigurationError(
                    f"task {self.name}: lock_name {spec!r} names argument "
                    f"{argument.group()!r}, which the task cannot take (its parameters: "
                    f"{', '.join(names) or 'none'})"
                )

    def _checked_mode(self) -> str:
        if self.lock_mode not in LOCK_MODES:
            raise ConfigurationError(
                f"task {self.name}: lock_mode must be one of {', '.join(LOCK_MODES)}, "
                f"not {self.lock_mode!r}"
            )
        return self.lock_mode

    def _checked_timeout(self) -> float | None:
        try:
            return check_timeout(self.lock_timeout)
        except PglockError as exc:
            raise ConfigurationError(f"task {self.name}: lock_timeout: {exc}") from None

    def _lock_busy(
        self,
        lock: AdvisoryLock,
        mode: str,
        config: PglockConfig,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> Any:
        name = lock.label
        holder = lock.holder() if config.report_holder else None
        holder_info = holder.as_dict() if holder is not None else None
        shown = holder.describe() if holder is not None else "unknown"
        # Close the session before anything is published: it holds nothing.
        lock.release()
        extra = {"lock": name, "task_id": self.request.id, "holder": holder_info}
        if holder is not None and holder.task_id is not None and holder.task_id == self.request.id:
            # This very call holds the lock: a copy of it delivered again while it runs
            # (an expired visibility timeout). The holder is read from the lock (a
            # session that only waits for it, named with this task id, is no holder), so
            # only a first delivery that holds it drops the copy. The run's own result is
            # the call's; the copy stores nothing (Ignore: no result, its message acked).
            logger.info(
                "lock %s is held by task %s[%s] itself: a redelivered copy, ignored",
                name,
                self.name,
                self.request.id,
                extra=extra,
            )
            raise Ignore()
        if mode == RETRY:
            self._retry_later(name, shown, config, extra)
        logger.info(
            "lock %s is held by %s: task %s[%s] skipped",
            name,
            shown,
            self.name,
            self.request.id,
            extra=extra,
        )
        self._send_event(
            LOCK_SKIPPED_EVENT,
            self.request.id,
            self.request.hostname,
            lock=name,
            holder=holder_info,
        )
        # The call ends SUCCESS with its skip result, and what was to follow it
        # (the rest of its chain, its link callbacks) does not run: the holder's
        # step is the one that counts. Membership of a group or chord is kept.
        skipped = self.on_lock_skipped(name, holder_info, args, kwargs)
        self._answer_what_follows(skipped)
        self.request.chain = None
        self.request.callbacks = None
        return skipped

    def _retry_later(
        self, name: str, shown: str, config: PglockConfig, extra: dict[str, Any]
    ) -> None:
        """Retry a call that found its lock held (lock_mode ``"retry"``), saying so.

        A retry is logged as one: when it comes and how many are left (here and in
        Celery's own line). Out of retries, the call fails with LockTimeout.
        """
        countdown = self.lock_retry_countdown or config.retry_countdown
        done, most = self.request.retries, self.max_retries
        if most is not None and done >= most:
            # Celery raises this exc itself, as the call's failure.
            raise self.retry(
                countdown=countdown,
                exc=LockTimeout(
                    f"task {self.name}: lock {name} was still held after {done} retries"
                ),
            )
        at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=countdown)
        left = "no limit" if most is None else f"{most - done - 1} left after it"
        when = (
            f"in {countdown:g} s (at {at.isoformat(timespec='seconds')}), retry "
            f"{done + 1}{'' if most is None else f' of {most}'} ({left})"
        )
        logger.info(
            "lock %s is held by %s: task %s[%s] retries %s",
            name,
            shown,
            self.name,
            self.request.id,
            when,
            extra=extra,
        )
        retrying = f"lock {name} is held by {shown}: retrying {when}"
        try:
            self.retry(countdown=countdown, exc=LockTimeout(f"task {self.name}: {retrying}"))
        except Retry as retry:
            retry.message = retrying  # Celery's own line: "Task ...[id] retry: <this>"
            raise

    def _answer_what_follows(self, skipped: Any) -> None:
        """Store the skip result as the result of every call that was to follow this one.

        Those calls never run, and a caller waiting on any of them (a chain's
        ``get()`` waits on its last step) would wait forever: each ends SUCCESS
        with this call's skip result instead, as if it had skipped too.
        """
        following: list[Any] = [*(self.request.chain or ()), *(self.request.callbacks or ())]
        task_ids = dict.fromkeys(
            task_id
            for sig in following
            for task_id in _frozen_ids(maybe_signature(sig, app=self.app))
        )
        for task_id in task_ids:
            try:
                self.backend.store_result(task_id, skipped, states.SUCCESS)
            except Exception as exc:
                logger.warning(
                    "task %s[%s] skipped: could not store its skip result for %s, which "
                    "was to follow it: %s",
                    self.name,
                    self.request.id,
                    task_id,
                    exc,
                    extra={"task_id": self.request.id, "following": task_id},
                )

    def _lock_lost(
        self,
        lock: Hold,
        loss: Loss,
        *,
        task_id: str | None,
        hostname: str | None,
        reaction: str,
        body: Body | None,
    ) -> None:
        """React to a loss found while the call holds the lock (by a monitor thread, the
        body itself, or its release), once the lock's session is already cut off.

        Every loss is reported here once (the event), whoever found it; a loss found
        at release has no body left to stop.
        """
        reason = loss.detail
        self._send_event(
            LOCK_LOST_EVENT,
            task_id,
            hostname,
            lock=lock.label,
            reason=reason,
            loss=loss.kind.value,
            holder=lock.application_name,
        )
        if reaction == INTERRUPT and body is not None:
            body.interrupt(reason)
        elif reaction == "terminate" and loss is not lock.found_at_release:
            # Also when the body, woken by the loss (lock.sleep()), has ended meanwhile:
            # the process ends as configured; a loss its release found has no body.
            logger.error(
                "lock %s lost: ending worker process %d so that task %s[%s] stops",
                lock.label,
                os.getpid(),
                self.name,
                task_id,
                extra={"lock": lock.label, "task_id": task_id, "reason": reason},
            )
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(LOCK_LOST_EXIT_STATUS)

    def _send_event(
        self, event: str, task_id: str | None, hostname: str | None, **fields: Any
    ) -> None:
        """Send a task event when the worker sends them; never fail the call for it."""
        if not (self.app.conf.worker_send_task_events and task_id):
            return
        try:
            with self.app.events.default_dispatcher(hostname=hostname) as dispatcher:
                dispatcher.send(event, uuid=task_id, **fields)
        except Exception as exc:
            logger.warning(
                "could not send %s for task %s: %s",
                event,
                task_id,
                exc,
                extra={"task_id": task_id, **fields},
            )


#: The argument a template field starts with: ``tenant`` in ``{tenant.id[0]!r:>8}``.
_FIELD_ARGUMENT = re.compile(r"[^.\[]+")


def _a_database_error(exc: BaseException) -> bool:
    """A psycopg error, or one an ORM raised for it (Django's are caused by psycopg's)."""
    return isinstance(exc, psycopg.Error) or isinstance(exc.__cause__, psycopg.Error)


def _template_fields(template: str) -> list[str]:
    """Return the field names of a ``str.format`` template, nested ones too.

    Raises ValueError for a template ``str.format`` cannot parse.
    """
    fields: list[str] = []
    for _, field, spec, _ in string.Formatter().parse(template):
        if field is not None:
            fields.append(field)
        if spec:
            fields.extend(_template_fields(spec))
    return fields


def _frozen_ids(sig: Any) -> list[str]:
    """Every task id a caller may wait on in ``sig``: its own, its members' (chains,
    groups, a chord's header and body) and its callbacks', where already frozen."""
    if sig is None:
        return []
    members: list[Any] = []
    if isinstance(sig, chord):
        members = [*sig.tasks, sig.body]
    elif isinstance(sig, (_chain, group)):
        members = list(sig.tasks)
    members += sig.options.get("link") or []
    ids = [task_id for member in members for task_id in _frozen_ids(maybe_signature(member))]
    task_id = sig.options.get("task_id")
    return [*ids, task_id] if isinstance(task_id, str) else ids
