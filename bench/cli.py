"""Running questions: on the benchmark's services, each one's figures saved, the page rendered.

Used by ``bench.run`` (``make bench``: every question) and by each question's own
``python -m bench.<question>``. A question is a module with ``NAME`` (its data file,
``bench/results/<NAME>.json``), ``SECTION`` (its number in BENCHMARKS.md),
``add_arguments(parser)`` and ``measure(ctx, args) -> dict``. This module imports
no question: they are handed to it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import common, report


def parser_for(questions: list[ModuleType], prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--dsn", help="the database (default: PGLOCK_BENCH_DSN, else its own)")
    parser.add_argument(
        "--results", default=str(common.RESULTS), help="where the data files are written"
    )
    parser.add_argument("--out", default=str(common.ROOT / "BENCHMARKS.md"))
    parser.add_argument(
        "--no-render", action="store_true", help="write the data only, not BENCHMARKS.md"
    )
    for question in questions:
        question.add_arguments(parser)
    return parser


def measure(
    questions: list[ModuleType], args: argparse.Namespace, command: str, *, whole: bool = False
) -> float:
    """Measure ``questions`` one after the other and save each one's figures; seconds taken.

    ``whole``: every question ran, so the run's description (``run.json``) is written too.
    """
    results = Path(args.results)
    work = Path(tempfile.mkdtemp(prefix="pglock-bench-"))
    started = time.perf_counter()
    with common.services(work, command, args.dsn) as ctx:
        for question in questions:
            print(f"{question.SECTION}. {question.TITLE}", flush=True)
            began = time.perf_counter()
            data: dict[str, Any] = {"meta": {}, **question.measure(ctx, args)}
            data["meta"] = common.meta(ctx, began)
            saved = common.save(question.NAME, data, results)
            print(f"  ({time.perf_counter() - began:.0f} s) -> {saved}", flush=True)
        elapsed = time.perf_counter() - started
        if whole:
            run = {"meta": common.meta(ctx, started), "machine": common.machine()}
            run["meta"]["seconds"] = round(elapsed, 1)
            common.save(common.RUN, run, results)
    return elapsed


def main(
    questions: list[ModuleType], prog: str, description: str, argv: list[str] | None = None
) -> int:
    """``python -m bench.<question>``: measure one question, rewrite its data and the page."""
    args = parser_for(questions, prog, description).parse_args(argv)
    command = " ".join([prog, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    elapsed = measure(questions, args, command)
    if not args.no_render:
        report.write(Path(args.out), Path(args.results))
        print(f"wrote {args.out} from {args.results}")
    print(f"measured in {elapsed:.0f} s")
    return 0
