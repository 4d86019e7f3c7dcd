"""`make mutate`: mutmut over keys, config, task (names and modes) and sessions; the score.

    python -m tests.mutation.score [--workdir DIR] [--max-children N]

Runs in a scratch copy of the tracked files (DIR, default /tmp/pglock-mutate), so
the checkout gets no mutants/ folder, with its own TMPDIR so that pytest's temporary
folders never rotate another run's. Only tests that run in this process count (see
setup.cfg beside this file): a worker process would not see a mutant. Prints the
killed share over every mutant and over the mutants that are not equivalent
(EQUIVALENT below, each with the reason no test can tell it apart).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The functions under test: all of keys, config and sessions; task's name
#: resolution and modes (not its event and loss reporting).
SCOPE = (
    "pglock_celery.keys.*",
    "pglock_celery.config.*",
    "pglock_celery.sessions.*",
    *(
        f"pglock_celery.task.xǁTenantLockedTaskǁ{method}__mutmut_*"
        for method in (
            "__call__", "_run_locked", "retry", "on_lock_skipped", "resolve_lock_name",
            "_format_lock_name", "_checked_mode", "_checked_timeout", "_lock_busy",
        )
    ),
)  # fmt: skip

#: Surviving mutants no test can kill, and why.
EQUIVALENT: dict[str, str] = {
    "pglock_celery.keys.x_lock_key__mutmut_6": "usedforsecurity only matters in FIPS mode",
    "pglock_celery.keys.x_lock_key__mutmut_8": "usedforsecurity only matters in FIPS mode",
    "pglock_celery.keys.x_lock_key__mutmut_9": "usedforsecurity only matters in FIPS mode",
}


def in_scope(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in SCOPE)


def prepare(workdir: Path) -> None:
    """A scratch copy of the tracked files, with mutmut's settings at its root."""
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "tmp").mkdir(parents=True)
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / name.decode()
        target = workdir / name.decode()
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    shutil.copy2(Path(__file__).with_name("setup.cfg"), workdir / "setup.cfg")


def results(workdir: Path, env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=workdir, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    statuses = {}
    for line in done.stdout.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name and in_scope(name):
            statuses[name] = status
    return statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make mutate", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pglock-mutate"))
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="reuse the workdir's earlier results")
    args = parser.parse_args(argv)
    if not args.keep:
        prepare(args.workdir)
    env = {**os.environ, "TMPDIR": str(args.workdir / "tmp")}
    subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children), *SCOPE],
        cwd=args.workdir, env=env, check=False,
    )  # fmt: skip
    statuses = results(args.workdir, env)
    if all(status == "not checked" for status in statuses.values()):
        print("mutmut checked no mutant: see its output above", file=sys.stderr)
        return 1
    counts = Counter(statuses.values())
    survivors = sorted(name for name, status in statuses.items() if status != "killed")
    equivalent = [name for name in survivors if name in EQUIVALENT]
    killed, total = counts["killed"], len(statuses)
    print(f"\nmutants {total}: {dict(sorted(counts.items()))}")
    for name in survivors:
        print(f"  {statuses[name]:<10} {name}  {EQUIVALENT.get(name, '')}")
    print(f"killed {killed}/{total} = {100 * killed / max(total, 1):.1f}%")
    relevant = total - len(equivalent)
    print(
        f"killed of the non-equivalent {killed}/{relevant} = {100 * killed / max(relevant, 1):.1f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
