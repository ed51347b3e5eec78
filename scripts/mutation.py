#!/usr/bin/env python3
"""Mutation testing of Orka's core modules with mutmut, and a score per module.

    python scripts/mutation.py                      # every core module ([tool.mutmut] only_mutate)
    python scripts/mutation.py security/identity agent/supervisor
    python scripts/mutation.py --report             # scores from the last run, runs nothing
    python scripts/mutation.py --survivors registry # the diff of each surviving mutant

Run from anywhere; it works in the repository root. mutmut keeps its results in mutants/, so a
second run only re-tests functions that changed (delete mutants/ for a clean run). The tests run
are the fast ones listed in pyproject.toml's [tool.mutmut] (unit tests and the in-process
integration tests of these modules); mutmut runs each mutant against only the tests that called
its function in a first, clean run, which is what keeps each mutant's run short.

Scoring, per module: killed / total, where
  killed    = tests failed, or timed out (mutmut's timeout: 15 x the tests' clean duration + 1 s),
              or the mutant broke pytest itself;
  survived  = every test passed, or no test calls the function ("no tests": a gap all the same);
  suspicious (slow but not timed out, or an unexpected exit) counts against the score, shown apart;
  skipped and not-yet-checked mutants are left out of the total and shown apart.
Not part of scripts/test.sh: a full run takes far longer than CI allows (README, Development).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KILLED = {"killed", "timeout", "caught by type check", "segfault"}
SURVIVED = {"survived", "no tests"}
LEFT_OUT = {"skipped", "not checked", "check was interrupted by user"}


@dataclass
class Score:
    module: str
    counts: Counter[str] = field(default_factory=Counter)
    survivors: list[str] = field(default_factory=list)
    seconds: float | None = None

    @property
    def killed(self) -> int:
        return sum(n for s, n in self.counts.items() if s in KILLED)

    @property
    def total(self) -> int:
        return sum(n for s, n in self.counts.items() if s not in LEFT_OUT)

    def line(self) -> str:
        pct = f"{100 * self.killed / self.total:5.1f} %" if self.total else "    - "
        parts = [f"{s} {n}" for s, n in sorted(self.counts.items())]
        took = f"  ({self.seconds:.0f} s)" if self.seconds is not None else ""
        return f"{self.module:32} {self.killed:4}/{self.total:<4} {pct}  [{', '.join(parts)}]{took}"


def core_modules() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return list(config["only_mutate"])


def resolve(name: str, modules: list[str]) -> str:
    """'identity', 'security/identity', 'orka/security/identity.py' -> the configured path."""
    stem = name.removesuffix(".py").replace(".", "/").removeprefix("orka/")
    hits = [m for m in modules if m.removesuffix(".py").endswith(stem)]
    if len(hits) != 1:
        known = ", ".join(m.removeprefix("orka/").removesuffix(".py") for m in modules)
        sys.exit(f"error: module {name!r} names {len(hits)} core modules; one of: {known}")
    return hits[0]


def dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def mutmut() -> list[str]:
    exe = shutil.which("mutmut") or str(Path(sys.executable).parent / "mutmut")
    return [exe]


def env() -> dict[str, str]:
    # mutmut puts mutants/ first on sys.path itself; a PYTHONPATH naming the worktree would
    # shadow the mutated copies with the originals and every mutant would survive.
    e = dict(os.environ)
    e.pop("PYTHONPATH", None)
    return e


def run(path: str, children: int) -> float:
    start = time.monotonic()
    cmd = [*mutmut(), "run", "--max-children", str(children), f"{dotted(path)}.*"]
    print(f"==> {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, cwd=ROOT, env=env(), check=False)
    if done.returncode != 0:
        sys.exit(f"error: mutmut run failed for {path} (exit {done.returncode})")
    took = time.monotonic() - start
    print(f"\n==> {path}: {took:.0f} s", flush=True)
    return took


def score(path: str) -> Score:
    from mutmut.stats import status_by_exit_code

    result = Score(path)
    meta = ROOT / "mutants" / f"{path}.meta"
    if not meta.exists():
        return result
    codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
    for name, code in sorted(codes.items()):
        status = status_by_exit_code[code]
        result.counts[status] += 1
        if status in SURVIVED or status == "suspicious":
            result.survivors.append(f"{name}: {status}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="core modules (default: all of them)")
    parser.add_argument("--report", action="store_true", help="print the last run's scores")
    parser.add_argument("--survivors", action="store_true", help="show each survivor's diff")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel mutants")
    args = parser.parse_args()

    modules = core_modules()
    chosen = [resolve(m, modules) for m in args.modules] or modules
    took: dict[str, float] = {}
    if not (args.report or args.survivors):
        for path in chosen:
            took[path] = run(path, args.jobs)

    scores = [score(path) for path in chosen]
    print("\nmodule                           killed/total score  [statuses]  (run time)")
    for s in scores:
        s.seconds = took.get(s.module)
        print(s.line())
    killed, total = sum(s.killed for s in scores), sum(s.total for s in scores)
    if total:
        print(f"{'all':32} {killed:4}/{total:<4} {100 * killed / total:5.1f} %")
    for s in scores:
        if s.survivors:
            print(f"\nsurvivors in {s.module}:")
        for line in s.survivors:
            print(f"  {line}")
            if args.survivors:
                name = line.split(":")[0]
                subprocess.run([*mutmut(), "show", name], cwd=ROOT, env=env(), check=False)


if __name__ == "__main__":
    main()
