"""Every statement the lock sessions send, named for what it does.

The lock statements are ``(name, text)`` pairs of bytes for libpq: a session runs
one unprepared the first time and prepares it under its name the second time
(see session.LockSession.query). Every built-in is called as ``pg_catalog.f`` so
that a role's ``search_path`` cannot put a function of the same name first.

A held lock is taken twice (its count is 2), so that a check can unlock it once
and take it again without ever letting it go: "still held" in O(1), never read
from ``pg_locks``. A lock session records the keys it holds in the session
setting ``pglock.held`` (``,key1,key2,``), which guarded tables read (guard.py).
Every lock statement proves that it ran on the session's own backend (its
``pglock.session`` token in force, no earlier holder's key in ``pglock.held``),
so a session moved by a pooler fails closed instead of locking elsewhere.
"""

from __future__ import annotations

#: The session setting listing the keys a lock session holds (``,k1,k2,``).
HELD_SETTING = "pglock.held"
#: The session setting carrying a per-session token, set in the startup options.
SESSION_TOKEN_SETTING = "pglock.session"

Statement = tuple[bytes, bytes]

# -- a dedicated session (strategies connect and reuse) ----------------------------

#: Try the lock, only on the session's own backend holding nothing of an earlier
#: holder's (NULL otherwise: a pooler moved it); once granted, take it a second time,
#: name the session after its holder and record the key.
#: $1 application_name, $2 ",key,", $3 token, $4 key.
TRY: Statement = (
    b"pglock_try",
    b"SELECT got, pg_catalog.pg_backend_pid(), CASE WHEN got THEN pg_catalog.concat("
    b"pg_catalog.set_config('application_name', $1::pg_catalog.text, false),"
    b" pg_catalog.set_config('pglock.held', $2::pg_catalog.text, false),"
    b" pg_catalog.pg_try_advisory_lock($4::pg_catalog.int8)) END"
    b" FROM (SELECT CASE WHEN pg_catalog.texteq("
    b"pg_catalog.current_setting('pglock.session', true), $3::pg_catalog.text)"
    b" AND pg_catalog.texteq(coalesce(pg_catalog.current_setting('pglock.held', true), ''), '')"
    b" THEN pg_catalog.pg_try_advisory_lock($4::pg_catalog.int8) END AS got) AS attempt",
)
#: Bound the next wait: returns lock_timeout as it was. $1 the bound, e.g. "1500ms".
SET_WAIT_BOUND: Statement = (
    b"pglock_set_wait_bound",
    b"SELECT pg_catalog.current_setting('lock_timeout'),"
    b" pg_catalog.set_config('lock_timeout', $1, false)",
)
#: Wait for the lock with the same proof as TRY: '' once granted, NULL when the
#: statement is not on the session's own backend. $1 token, $2 key.
WAIT: Statement = (
    b"pglock_wait",
    b"SELECT CASE WHEN pg_catalog.texteq("
    b"pg_catalog.current_setting('pglock.session', true), $1::pg_catalog.text)"
    b" AND pg_catalog.texteq(coalesce(pg_catalog.current_setting('pglock.held', true), ''), '')"
    b" THEN pg_catalog.pg_advisory_lock($2::pg_catalog.int8)::pg_catalog.text END",
)
#: After a granted wait: name the session, record the key, take it a second time and
#: put lock_timeout back ($3 NULL leaves it). $1 application_name, $2 ",key,", $4 key.
AFTER_WAIT: Statement = (
    b"pglock_after_wait",
    b"SELECT pg_catalog.pg_backend_pid(),"
    b" pg_catalog.set_config('application_name', $1::pg_catalog.text, false),"
    b" pg_catalog.set_config('pglock.held', $2, false),"
    b" pg_catalog.pg_try_advisory_lock($4::pg_catalog.int8),"
    b" pg_catalog.set_config('lock_timeout',"
    b" coalesce($3::pg_catalog.text, pg_catalog.current_setting('lock_timeout')), false)",
)
#: Free the lock before the session closes; true when it was still held. $1 key.
UNLOCK: Statement = (
    b"pglock_unlock",
    b"SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8),"
    b" pg_catalog.pg_advisory_unlock_all()",
)
#: Free the lock of a session that goes back to the idle ones: no advisory lock of the
#: holder's stays, nor its name. $1 key, $2 the idle application_name.
UNLOCK_FOR_REUSE: Statement = (
    b"pglock_unlock_reuse",
    b"SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8),"
    b" pg_catalog.pg_advisory_unlock_all(),"
    b" pg_catalog.set_config('application_name', $2, false),"
    b" pg_catalog.set_config('pglock.held', '', false)",
)
#: What a holder may have left on a session that goes back to the idle ones.
RESET_HANDED_OUT = b"DISCARD ALL"

# -- a shared session (strategy shared) --------------------------------------------

#: Try the lock on the session's own backend; once granted, a second time, and add
#: the key to pglock.held. $1 token, $2 key.
TRY_SHARED: Statement = (
    b"pglock_try_shared",
    b"SELECT got, pg_catalog.pg_backend_pid(), CASE WHEN got THEN pg_catalog.concat("
    b"pg_catalog.set_config('pglock.held', pg_catalog.concat("
    b"coalesce(nullif(pg_catalog.current_setting('pglock.held', true), ''), ','),"
    b" $2::pg_catalog.text, ','), false),"
    b" pg_catalog.pg_try_advisory_lock($2::pg_catalog.int8)) END"
    b" FROM (SELECT CASE WHEN pg_catalog.texteq("
    b"pg_catalog.current_setting('pglock.session', true), $1::pg_catalog.text)"
    b" THEN pg_catalog.pg_try_advisory_lock($2::pg_catalog.int8) END AS got) AS attempt",
)
#: Both counts of the key go, and the key leaves pglock.held; the first result says
#: whether it was still held. $1 key.
UNLOCK_SHARED: Statement = (
    b"pglock_unlock_shared",
    b"SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8),"
    b" pg_catalog.pg_advisory_unlock($1::pg_catalog.int8),"
    b" pg_catalog.set_config('pglock.held',"
    b" pg_catalog.replace(pg_catalog.current_setting('pglock.held', true),"
    b" pg_catalog.concat(',', $1::pg_catalog.text, ','), ','), false)",
)
# -- who holds what (inspect.py) -------------------------------------------------

# Advisory locks are per database; a bigint key shows as classid/objid with
# objsubid = 1 (two int4 keys use objsubid = 2 and are not ours). Read by the
# operator's commands and holder(), and (KEYED_HOLDER) by a skip that reports its
# holder: never on the path of a lock that is taken, checked or released.
_HELD_LOCKS = """
SELECT l.classid::pg_catalog.int8, l.objid::pg_catalog.int8, a.pid, a.application_name,
       pg_catalog.host(a.client_addr), a.backend_start, a.state_change, a.state
FROM pg_catalog.pg_locks l
JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_catalog.pg_database
                    WHERE datname = pg_catalog.current_database())
"""
#: The holder of one key (psycopg placeholders: classid, objid).
HOLDER_OF_KEY = (
    _HELD_LOCKS
    + " AND l.classid = %s::pg_catalog.int8::pg_catalog.oid"
    + " AND l.objid = %s::pg_catalog.int8::pg_catalog.oid"
)
#: Every advisory lock of the database, oldest session first.
ALL_HELD = _HELD_LOCKS + " ORDER BY a.backend_start, a.pid"
#: The holder of one key, asked on a lock session (a skip's report, the redelivery
#: decision): read from the lock (pg_locks, granted), never from a session's name, which a
#: session carries before it is granted (``connect`` names it at open) and after it lost
#: the key. Postgres has no cheaper question "does backend P hold key K" for a session
#: that does not wait (pg_blocking_pids reads one lock's queue, but only for a waiting
#: backend), so this read grows with the server's lock table (docs/limits.md).
#: $1 classid, $2 objid (see keys.key_to_lock_fields).
KEYED_HOLDER: Statement = (
    b"pglock_keyed_holder",
    b"SELECT a.pid, a.application_name, pg_catalog.host(a.client_addr),"
    b" pg_catalog.to_json(a.backend_start) #>> '{}',"
    b" pg_catalog.to_json(a.state_change) #>> '{}', a.state"
    b" FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
    b" WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
    b" AND l.database = (SELECT oid FROM pg_catalog.pg_database"
    b" WHERE datname = pg_catalog.current_database())"
    b" AND l.classid = $1::pg_catalog.int8::pg_catalog.oid"
    b" AND l.objid = $2::pg_catalog.int8::pg_catalog.oid LIMIT 1",
)
#: The server's clock, for the age of what `pglock-celery locks` shows.
SERVER_NOW = b"SELECT pg_catalog.now()"
#: The server a lock session is on, for the Patroni fence (patroni.ServerIdentity).
SERVER_IDENTITY = b"SELECT pg_catalog.pg_postmaster_start_time()"

# -- any lock session ------------------------------------------------------------

#: At the start of a holder's transaction (lock.transaction()): prove, without
#: waiting, that the session holds its key, and pin it with a transaction-level lock
#: too, so that nothing the transaction runs (pg_advisory_unlock_all(), say) can free
#: it before the transaction ends, and a PREPARE TRANSACTION fails (a transaction
#: holding a key at both levels cannot be prepared, so no write under the lock
#: outlives it). The pin is only tried: it is granted at once to a session that holds
#: the key, and refused at once when another does; a free key is pinned for a moment
#: and the session-level unlock then says it was not held (false: the caller rolls
#: back). While pinned, unlocking the session-level count once and taking it again
#: never frees the key. %s the key.
PROVE_AND_PIN = (
    b"SELECT CASE WHEN pg_catalog.pg_try_advisory_xact_lock(%s::pg_catalog.int8)"
    b" THEN CASE WHEN pg_catalog.pg_advisory_unlock(%s::pg_catalog.int8)"
    b" THEN pg_catalog.pg_try_advisory_lock(%s::pg_catalog.int8) ELSE false END"
    b" ELSE false END"
)
#: Before that transaction ends: the key is held twice at session level again,
#: whatever the transaction unlocked (the pin kept everyone else out meanwhile).
#: %s the key.
RESTORE_AFTER_TRANSACTION = (
    b"SELECT pg_catalog.pg_advisory_unlock(k), pg_catalog.pg_advisory_unlock(k),"
    b" pg_catalog.pg_try_advisory_lock(k), pg_catalog.pg_try_advisory_lock(k)"
    b" FROM (SELECT %s::pg_catalog.int8 AS k) AS key"
)

#: The savepoint a holder's statements run under in that transaction: after one of
#: them failed, the transaction is rolled back to it, so the restore still runs.
HOLDER_SAVEPOINT = b"pglock_holder"


def holder_transaction_opening(begin: bytes, key: int) -> bytes:
    """BEGIN (``begin``, with the handle's modes), the proof and pin, and the holder's
    savepoint: one simple query, one round trip; the key inlined (an int, parenthesised
    so that the smallest int8 is read whole)."""
    prove = PROVE_AND_PIN.replace(b"%s", b"(%d)" % key)
    return b"%s; %s; SAVEPOINT %s" % (begin, prove, HOLDER_SAVEPOINT)


def holder_transaction_end(key: int, *, failed: bool, commit: bool) -> bytes:
    """Back out of the holder's savepoint (rolled back to it first when ``failed``),
    restore the key's count, and, with ``commit``, COMMIT (ROLLBACK when ``failed``):
    one simple query. A statement of it that fails skips the rest (the caller rolls
    back what is left open)."""
    parts = [b"RELEASE SAVEPOINT " + HOLDER_SAVEPOINT]
    if failed:
        parts.insert(0, b"ROLLBACK TO SAVEPOINT " + HOLDER_SAVEPOINT)
    parts.append(RESTORE_AFTER_TRANSACTION.replace(b"%s", b"(%d)" % key))
    if failed:
        parts.append(b"ROLLBACK")
    elif commit:
        parts.append(b"COMMIT")
    return b"; ".join(parts)


#: Is the server a primary, and does this session still hold the key? The key is
#: pinned for the statement first (granted at once to the session that holds it,
#: refused when another does), so unlocking one session-level count and taking it
#: again never lets it go, whatever its count; a key the session no longer holds is
#: not unlocked (false). $1 key.
CHECK: Statement = (
    b"pglock_check",
    b"SELECT pg_catalog.pg_is_in_recovery(),"
    b" CASE WHEN pg_catalog.pg_try_advisory_xact_lock($1::pg_catalog.int8)"
    b" THEN CASE WHEN pg_catalog.pg_advisory_unlock($1::pg_catalog.int8)"
    b" THEN pg_catalog.pg_try_advisory_lock($1::pg_catalog.int8) ELSE false END"
    b" ELSE false END",
)
#: End a lock session's backend from outside and wait (up to $3 ms) until it has
#: exited, so its locks are free and no statement of it can still commit; true when it
#: is gone (also when it already was: its start no longer matches). $1 backend pid,
#: $2 backend start (microseconds since 1970), $3 milliseconds to wait.
END_BACKEND: Statement = (
    b"pglock_end_backend",
    b"SELECT CASE WHEN EXISTS (SELECT FROM pg_catalog.pg_stat_get_activity($1::pg_catalog.int4)"
    b" AS a WHERE (EXTRACT(epoch FROM a.backend_start) * 1000000)::pg_catalog.int8"
    b" = $2::pg_catalog.int8)"
    b" THEN pg_catalog.pg_terminate_backend($1::pg_catalog.int4, $3::pg_catalog.int8)"
    b" ELSE true END",
)
#: The server's own view of a lock session that is busy (a holder's statement,
#: pipeline, COPY or transaction), asked on a session of its own (probe.py): the same
#: server (its start, in microseconds since 1970), what the session's backend waits
#: for and since when its statement runs ('<wait_event> <query_start>', the event ''
#: for nothing; NULL when that backend, by its pid and start, is gone: 'SyncRep' is a
#: commit waiting for synchronous replication), and its key not free (a
#: shared pin, tried, is refused while anyone holds the key: granted, it proves the key
#: free; NULL for a session that waits). $1 server start, $2 backend pid, $3 backend
#: start, $4 key or NULL.
PROBE: Statement = (
    b"pglock_probe",
    b"SELECT (EXTRACT(epoch FROM pg_catalog.pg_postmaster_start_time())"
    b" * 1000000)::pg_catalog.int8 = $1::pg_catalog.int8,"
    b" (SELECT COALESCE(a.wait_event, '') || ' '"
    b" || COALESCE((EXTRACT(epoch FROM a.query_start) * 1000000)::pg_catalog.int8::text, '')"
    b" FROM pg_catalog.pg_stat_get_activity($2::pg_catalog.int4) AS a"
    b" WHERE (EXTRACT(epoch FROM a.backend_start) * 1000000)::pg_catalog.int8"
    b" = $3::pg_catalog.int8),"
    b" pg_catalog.pg_try_advisory_xact_lock_shared($4::pg_catalog.int8)",
)


def set_session_settings(count: int) -> bytes:
    """Set ``count`` settings for the session (psycopg placeholders: name, value, ...).

    Behind a session-mode pooler, which drops startup options.
    """
    calls = ", ".join("pg_catalog.set_config(%s, %s, false)" for _ in range(count))
    return f"SELECT {calls}".encode()


#: Whether this database keeps the record of the shard maps (rollout.py), read from the
#: catalog: a role that may not use schema public still learns that it exists (and is
#: then refused by it rather than let past it).
_SHARD_RECORD = (
    b"(SELECT pg_catalog.count(*) = 2 FROM pg_catalog.pg_class AS c"
    b" JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace"
    b" WHERE n.nspname = 'public'"
    b" AND c.relname IN ('pglock_shard_sessions', 'pglock_shard_maps'))"
)
#: The backend a new session landed on, whether its startup options are in force,
#: when its backend and its server started (microseconds since 1970, for probe.py), and
#: whether the database keeps the record of the shard maps.
VERIFY_SESSION = (
    b"SELECT pg_catalog.pg_backend_pid(), pg_catalog.current_setting(%s, true),"
    b" (SELECT (EXTRACT(epoch FROM a.backend_start) * 1000000)::pg_catalog.int8"
    b" FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS a),"
    b" (EXTRACT(epoch FROM pg_catalog.pg_postmaster_start_time())"
    b" * 1000000)::pg_catalog.int8, " + _SHARD_RECORD
)
SHARD_RECORD_EXISTS = b"SELECT " + _SHARD_RECORD

# -- the fence of a change of the shards (rollout.py) ------------------------------

#: A lock session records the map it came with (%s), under its pid and its backend's
#: start: a later session with the same pid replaces a gone one's row.
ENTER_MAP = (
    b"INSERT INTO public.pglock_shard_sessions (pid, backend_start, map)"
    b" SELECT pg_catalog.pg_backend_pid(), a.backend_start, %s"
    b" FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS a"
    b" ON CONFLICT (pid) DO UPDATE"
    b" SET backend_start = excluded.backend_start, map = excluded.map"
)
#: Which database of which running server this is (the server's start in microseconds,
#: never a text that a session's TimeZone changes, and the database's oid): advisory
#: locks live in one server's memory, so two servers of one cluster (a promoted
#: standby, a clone) are two, and two DSNs that give the same text reach one lock table.
_DATABASE = (
    b"(SELECT 'server ' || (EXTRACT(epoch FROM pg_catalog.pg_postmaster_start_time())"
    b" * 1000000)::pg_catalog.int8::pg_catalog.text || ' database ' || d.oid::pg_catalog.text"
    b" FROM pg_catalog.pg_database AS d WHERE d.datname = pg_catalog.current_database())"
)
DATABASE_OF = b"SELECT " + _DATABASE
#: The same, read by a plain session (inspect.database_identity).
DATABASE_IDENTITY = DATABASE_OF
#: Whether the map %s is accepted here, and the maps that are.
MAP_ACCEPTED = (
    b"SELECT coalesce(bool_or(map = %s), false),"
    b" coalesce(string_agg(map, ', ' ORDER BY map), '')"
    b" FROM public.pglock_shard_maps"
)
#: The same, and which database this is (a transition's session: two DSNs of one
#: database are one shard to it).
MAP_ACCEPTED_WHERE = (
    b"SELECT coalesce(bool_or(map = %s), false),"
    b" coalesce(string_agg(map, ', ' ORDER BY map), ''), "
    + _DATABASE
    + b" FROM public.pglock_shard_maps"
)
#: A session that recorded no map is taken for a lock session (of any prefix) by its
#: name as the library writes it (``prefix|pid...``, ``prefix-idle|pid``), or by an
#: advisory lock of the library's kind (one bigint key) that it holds or waits for: a
#: holder that renamed its session still holds its lock.
_UNRECORDED_LOCK_SESSION = (
    b"(a.application_name ~ '^[^|]+[|][0-9]+([.][0-9a-f]+)?([|]|$)'"
    b" OR a.pid IN (SELECT l.pid FROM pg_catalog.pg_locks AS l"
    b" WHERE l.locktype = 'advisory' AND l.objsubid = 1))"
)
#: As the record is made: the lock sessions connected before it (known as
#: _UNRECORDED_LOCK_SESSION says) are recorded with the map that ran before it (%s: the
#: steady map of `init`, the old map of a `begin`), so that no step takes them for none.
ADOPT_SESSIONS = (
    b"INSERT INTO public.pglock_shard_sessions (pid, backend_start, map)"
    b" SELECT a.pid, a.backend_start, %s FROM pg_catalog.pg_stat_activity AS a"
    b" WHERE a.pid <> pg_catalog.pg_backend_pid() AND a.backend_type = 'client backend'"
    b" AND a.datname = pg_catalog.current_database() AND a.backend_start IS NOT NULL"
    b" AND " + _UNRECORDED_LOCK_SESSION + b" ON CONFLICT (pid) DO NOTHING"
)
#: The record, made by the operator's command (``pglock-celery shards``) where it is
#: missing; every lock session may record itself and read which maps are accepted.
CREATE_SHARD_RECORD = (
    b"CREATE TABLE IF NOT EXISTS public.pglock_shard_maps"
    b" (map text PRIMARY KEY, since timestamptz NOT NULL DEFAULT pg_catalog.now())",
    b"CREATE TABLE IF NOT EXISTS public.pglock_shard_sessions"
    b" (pid integer PRIMARY KEY, backend_start timestamptz NOT NULL, map text NOT NULL)",
    b"GRANT SELECT ON public.pglock_shard_maps TO PUBLIC",
    b"GRANT SELECT, INSERT, UPDATE ON public.pglock_shard_sessions TO PUBLIC",
)
#: Then (after ADOPT_SESSIONS): a session writes its own row alone (its pid: a gone
#: session's row is replaced), whoever owns the table; a row is deleted only once its
#: session is gone.
SHARD_RECORD_SECURITY = (
    b"ALTER TABLE public.pglock_shard_sessions ENABLE ROW LEVEL SECURITY",
    b"ALTER TABLE public.pglock_shard_sessions FORCE ROW LEVEL SECURITY",
    b"CREATE POLICY pglock_read ON public.pglock_shard_sessions FOR SELECT USING (true)",
    b"CREATE POLICY pglock_enter ON public.pglock_shard_sessions FOR INSERT"
    b" WITH CHECK (pid = pg_catalog.pg_backend_pid())",
    b"CREATE POLICY pglock_reenter ON public.pglock_shard_sessions FOR UPDATE"
    b" USING (pid = pg_catalog.pg_backend_pid()) WITH CHECK (pid = pg_catalog.pg_backend_pid())",
    b"CREATE POLICY pglock_prune ON public.pglock_shard_sessions FOR DELETE USING (NOT EXISTS"
    b" (SELECT FROM pg_catalog.pg_stat_activity AS a WHERE a.pid = pglock_shard_sessions.pid"
    b" AND (a.backend_start = pglock_shard_sessions.backend_start OR a.backend_start IS NULL)))",
)
#: A gone session's row is never in the way, but need not stay either (run on its own,
#: never inside a step's transaction: a session opening meanwhile never waits for it).
#: A session whose start this role cannot see is never taken for gone.
PRUNE_SHARD_SESSIONS = (
    b"DELETE FROM public.pglock_shard_sessions AS s WHERE NOT EXISTS (SELECT FROM"
    b" pg_catalog.pg_stat_activity AS a WHERE a.pid = s.pid"
    b" AND (a.backend_start = s.backend_start OR a.backend_start IS NULL))"
)
#: Read pg_stat_activity afresh (a transaction otherwise keeps its first look at it).
FRESH_ACTIVITY = b"SELECT pg_catalog.pg_stat_clear_snapshot()"
#: How long a step waits for the record's write lock (%s), in its transaction only.
SET_STEP_LOCK_WAIT = b"SELECT pg_catalog.set_config('lock_timeout', %s, true)"
#: One step of a change of the shards at a time on a database: the record's writers
#: queue here, its readers (every lock session opening) do not.
LOCK_SHARD_MAPS = b"LOCK TABLE public.pglock_shard_maps IN EXCLUSIVE MODE"
#: Accept no map but those of the array %s (then ACCEPT_MAP each).
ACCEPT_ONLY = b"DELETE FROM public.pglock_shard_maps WHERE map <> ALL (%s::text[])"
ACCEPT_MAP = b"INSERT INTO public.pglock_shard_maps (map) VALUES (%s) ON CONFLICT DO NOTHING"
ACCEPTED_MAPS = b"SELECT map FROM public.pglock_shard_maps ORDER BY map"
#: The live lock sessions with the map each recorded ('' for none): recorded ones,
#: and those that recorded none but are lock sessions all the same.
CONNECTED_SESSIONS = (
    b"SELECT coalesce(s.map, ''), a.pid, a.application_name, pg_catalog.host(a.client_addr)"
    b" FROM pg_catalog.pg_stat_activity AS a LEFT JOIN public.pglock_shard_sessions AS s"
    b" ON s.pid = a.pid AND s.backend_start = a.backend_start"
    b" WHERE a.pid <> pg_catalog.pg_backend_pid() AND a.backend_type = 'client backend'"
    b" AND a.datname = pg_catalog.current_database()"
    b" AND (s.map IS NOT NULL OR " + _UNRECORDED_LOCK_SESSION + b") ORDER BY 1, 2"
)
#: Whether this role sees other roles' sessions whole (their backend_start among them).
SEES_EVERY_SESSION = (
    b"SELECT r.rolsuper OR pg_catalog.pg_has_role(r.oid, 'pg_read_all_stats', 'MEMBER')"
    b" FROM pg_catalog.pg_roles AS r WHERE r.rolname = current_user"
)
#: The same where no record exists: every lock session, none with a map.
UNRECORDED_SESSIONS = (
    b"SELECT '', a.pid, a.application_name, pg_catalog.host(a.client_addr)"
    b" FROM pg_catalog.pg_stat_activity AS a"
    b" WHERE a.pid <> pg_catalog.pg_backend_pid() AND a.backend_type = 'client backend'"
    b" AND a.datname = pg_catalog.current_database()"
    b" AND " + _UNRECORDED_LOCK_SESSION + b" ORDER BY 2"
)
