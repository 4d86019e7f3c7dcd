"""`make bench`: every question of the benchmark, one after the other, then BENCHMARKS.md.

Runs on a Postgres of its own (bench/server.py; ``PGLOCK_BENCH_DSN`` or ``--dsn``
names another) and the local Redis (else an embedded one). Each question is a
module that measures one thing and writes its figures to
``bench/results/<question>.json``; ``bench.report`` then renders BENCHMARKS.md,
bench/chart.png and bench/scale.png from those files alone:

1. ``bench.latency``: a lock cycle against the alternatives;
2. ``bench.throughput``: locked no-op Celery throughput and the CPU per call;
3. ``bench.recovery``: recovery after the holder is SIGKILLed;
4. ``bench.fanout``: the scan's fan-out and a skipped call's cost;
5. ``bench.peak``: lock sessions at peak and after;
6. ``bench.guard``: the cost of a guarded write;
7. ``bench.scale``: cost against foreign locks, sessions for 1,000 and 10,000
   holders, lock throughput;
8. ``bench.shards``: routing a name to its shard, 100,000 locks held over three
   shard servers, lock throughput with 1 to 3 shards, a capacity model;
9. ``bench.orm``: a fenced ORM write (``pglock_database``) against an unfenced one.

``make bench ARGS="--sections 1,7"`` (numbers or names) runs some of them and
rewrites their data only; ``python -m bench.<question>`` runs one alone;
``python -m bench.report`` renders the page from the stored data.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from types import ModuleType

from bench import (
    cli,
    fanout,
    guard,
    latency,
    orm,
    peak,
    recovery,
    report,
    scale,
    shards,
    throughput,
)

QUESTIONS: tuple[ModuleType, ...] = (
    latency,
    throughput,
    recovery,
    fanout,
    peak,
    guard,
    scale,
    shards,
    orm,
)


def chosen(sections: str) -> list[ModuleType]:
    """The questions named by number or by name, in the page's order."""
    wanted = {s.strip() for s in sections.split(",") if s.strip()}
    found = [q for q in QUESTIONS if q.SECTION in wanted or q.NAME in wanted]
    known = {q.SECTION for q in QUESTIONS} | {q.NAME for q in QUESTIONS}
    unknown = wanted - known
    if unknown:
        names = ", ".join(f"{q.SECTION} ({q.NAME})" for q in QUESTIONS)
        raise SystemExit(f"no section {', '.join(sorted(unknown))}: pick from {names}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser_for(list(QUESTIONS), "make bench", __doc__.splitlines()[0])
    parser.add_argument(
        "--sections",
        default=",".join(q.SECTION for q in QUESTIONS),
        help="sections to run, by number or name, e.g. 1,7 or latency,scale (default: all)",
    )
    args = parser.parse_args(argv)
    questions = chosen(args.sections)
    given = sys.argv[1:] if argv is None else argv
    command = "make bench" + (f" ARGS={shlex.quote(shlex.join(given))}" if given else "")
    elapsed = cli.measure(questions, args, command, whole=questions == list(QUESTIONS))
    if not args.no_render:
        report.write(Path(args.out), Path(args.results))
        print(f"wrote {args.out} from {args.results}")
    print(f"measured in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
