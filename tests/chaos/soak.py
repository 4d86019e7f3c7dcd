"""`make soak`: the orchestrator under a randomized mix of faults, for a given duration.

    python -m tests.chaos.soak --duration 300 [--tenants 12] [--seed N]
    python -m tests.chaos.soak --patroni [--strategy reuse|connect] --duration 600

Runs on its own throwaway Postgres and Redis. Faults: SIGKILL of a replica
(restarted at once), SIGSTOP of a replica for a few seconds, termination of a
random lock session, Postgres restarts (fast and immediate), Redis restarts
without persistence, and a partition of the replica that runs in a network
namespace. Namespaces need root: without it the soak refuses to start unless
told ``--without-partition``. After the faults stop, the system gets a recovery
window; then it prints the faults injected (only those that hit something
count), steps run, overlapping steps (expected 0), duplicate training jobs
(expected 0) and lost tenants: tenants that made no progress in the recovery
window (expected 0). A soak in which no fault hit anything, or no step ran,
proves nothing and fails.

With ``--patroni`` it runs on a 3-member Patroni cluster instead, with failovers
among the faults (failover_soak.py).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tasks import fleet
from tests.chaos import failover_soak, mix
from tests.chaos.mix import verdict
from tests.support import netns
from tests.support.orchestra import Orchestra
from tests.support.services import EmbeddedPostgres, EmbeddedRedis

FAULTS = ("kill", "pause", "terminate", "restart-postgres", "restart-redis", "partition")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make soak", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120, help="seconds of faults (120)")
    parser.add_argument("--tenants", type=int, default=12, help="tenants (12)")
    parser.add_argument("--interval", type=float, default=4, help="seconds between faults (4)")
    parser.add_argument("--recovery", type=float, default=30, help="quiet seconds at the end (30)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: time)")
    parser.add_argument(
        "--without-partition", action="store_true", help="leave out the partition fault"
    )
    parser.add_argument(
        "--patroni",
        action="store_true",
        help="on a 3-member Patroni cluster, with failovers and without the partition",
    )
    parser.add_argument(
        "--strategy",
        choices=failover_soak.STRATEGIES,
        help="the replicas' PGLOCK_STRATEGY under --patroni (reuse)",
    )
    args = parser.parse_args(argv)
    if args.patroni:
        return failover_soak.run(args)
    if args.strategy is not None:
        parser.error("--strategy needs --patroni")
    why = netns.available()
    if why is not None and not args.without_partition:
        print(
            f"soak: the partition fault cannot run ({why}); run as root, or pass", file=sys.stderr
        )
        print("--without-partition to soak without it", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    base = Path(tempfile.mkdtemp(prefix="pglock-soak-"))
    guest = netns.Guest() if why is None and not args.without_partition else None
    if guest is not None:
        guest.destroy()
        guest.create()
    pg = EmbeddedPostgres(base / "pg")
    listen = f"'127.0.0.1,{netns.HOST_IP}'" if guest else "'127.0.0.1'"
    pg.init(f"listen_addresses = {listen}")
    if guest:
        with (pg.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {netns.GUEST_IP}/32 trust\n")
    pg.start()
    redis = EmbeddedRedis(base / "redis")
    if guest:
        redis.bind = f"127.0.0.1 {netns.HOST_IP}"
    redis.start()
    orchestra = Orchestra(pg.dsn, redis.url, base, None)
    faults: Counter[str] = Counter()
    print(f"soak: seed {seed}, {args.duration:.0f} s of faults, logs in {base}", flush=True)
    if guest is None:
        print("soak: WITHOUT the partition fault (--without-partition)", flush=True)
    try:
        orchestra.seed(args.tenants)
        replicas = orchestra.replicas(3)
        orchestra.beat()
        if guest:
            replicas.append(_guest_replica(orchestra, guest, pg, redis))
        kinds = [f for f in FAULTS if guest or f != "partition"]
        deadline = time.monotonic() + args.duration
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.5, 1.5) * args.interval)  # the pace of the soak itself
            kind = rng.choice(kinds)
            if _inject(kind, rng, replicas, orchestra, pg, redis, guest):
                faults[kind] += 1
            for replica in replicas:
                if not replica.alive():
                    replica.start()
        before = orchestra.cycles()
        time.sleep(args.recovery)  # the quiet recovery window being measured
        after = orchestra.cycles()
        lost = sorted(t for t, c in after.items() if c <= before.get(t, 0))
        summary = orchestra.summary()
    finally:
        orchestra.close()
        redis.stop()
        pg.destroy()
        if guest:
            guest.destroy()
    problems = verdict(faults, summary, lost)
    return mix.report(faults, kinds, [], summary, lost, problems)


def _guest_replica(
    orchestra: Orchestra, guest: netns.Guest, pg: EmbeddedPostgres, redis: EmbeddedRedis
) -> fleet.Process:
    """A replica inside the namespace, reaching both servers over the veth pair."""
    env = {
        **orchestra.env,
        "PGLOCK_DSN": orchestra.dsn.replace("host=127.0.0.1", f"host={netns.HOST_IP}"),
        "ORCH_BROKER_URL": f"redis://{netns.HOST_IP}:{redis.port}/0",
        "ORCH_RESULT_BACKEND": f"redis://{netns.HOST_IP}:{redis.port}/0",
    }
    replica = fleet.replica(9, env, orchestra.log_dir)  # replica9.log: the one in the namespace
    replica.command = guest.command(replica.command)
    replica.start()
    orchestra.processes.append(replica)
    return replica


def _inject(
    kind: str,
    rng: random.Random,
    replicas: list[fleet.Process],
    orchestra: Orchestra,
    pg: EmbeddedPostgres,
    redis: EmbeddedRedis,
    guest: netns.Guest | None,
) -> bool:
    """Inject one fault; return whether it hit something."""
    if kind == "restart-postgres":
        pg.restart(rng.choice(["fast", "immediate"]))
    elif kind == "partition":
        if guest is None:
            raise AssertionError("the partition fault was chosen without a namespace")
        guest.cut()
        time.sleep(rng.uniform(3, 10))  # the length of the partition is the fault
        guest.heal()
    else:
        return mix.inject(kind, rng, replicas, orchestra, redis)
    return True


if __name__ == "__main__":
    sys.exit(main())
