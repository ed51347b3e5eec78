#!/usr/bin/env python3
"""Mutation testing of Orka's core modules with mutmut, and a score per module.

    python scripts/mutation.py                      # every core module, from scratch
    python scripts/mutation.py models controller/api
    python scripts/mutation.py --survivors-again    # re-test only last run's survivors
    python scripts/mutation.py --report             # scores from the last run, runs nothing
    python scripts/mutation.py --survivors registry # the diff of each surviving mutant
    python scripts/mutation.py --record             # last run's results -> the baseline file
    python scripts/mutation.py --changed            # CI: functions changed since the baseline

Each module runs in its own work folder (.mutation/<module>/, a copy of orka/ and tests/ with
a pyproject.toml whose [tool.mutmut] names that module and the tests that claim to cover it,
from [tool.orka.mutation] in the real pyproject.toml). mutmut runs those tests once to learn
which test calls which function, then runs against each mutant only the tests that call its
function, fastest first, stopping at the first failure.

Scoring, per module: killed / total, where
  killed    = tests failed, or timed out, or the mutant broke pytest itself;
  survived  = every test passed, or no selected test calls the function ("no tests");
  suspicious (slow but not timed out, or an unexpected exit) counts against the score;
  skipped and not-yet-checked mutants are left out of the total and shown apart.

--changed compares every function of the core modules with tests/mutation/baseline.json (a
hash of each function's source, and its mutants' results at the recorded run), mutates only
the functions that differ, and fails when a module's score (recorded results for the functions
that did not change, this run's for those that did) falls below the threshold. scripts/test.sh
runs it, so a change to a core module is mutation-tested in CI without the hours of a full run.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutation"
BASELINE = ROOT / "tests" / "mutation" / "baseline.json"

KILLED = {"killed", "timeout", "caught by type check", "segfault"}
SURVIVED = {"survived", "no tests"}
LEFT_OUT = {"skipped", "not checked", "check was interrupted by user"}
SUFFIX = re.compile(r"__mutmut_\d+$")


@dataclass(frozen=True)
class Module:
    path: str  # orka/scheduler/registry.py
    tests: list[str]
    functions: list[str] | None  # mutmut's names (x_f, xǁClassǁmethod); None: all

    @property
    def dotted(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")

    @property
    def short(self) -> str:
        return self.path.removeprefix("orka/").removesuffix(".py")

    @property
    def work(self) -> Path:
        return WORK / self.short.replace("/", "-")

    def for_changed(self) -> Module:
        """The same module with a work folder of its own for --changed, so a CI-style check
        never replaces the results of a full run kept in .mutation/<module>/."""
        return ChangedModule(self.path, self.tests, self.functions)

    def covers(self, function: str) -> bool:
        return self.functions is None or function in self.functions


class ChangedModule(Module):
    @property
    def work(self) -> Path:
        return WORK / "changed" / self.short.replace("/", "-")


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

    @property
    def percent(self) -> float:
        return 100 * self.killed / self.total if self.total else 100.0

    def line(self) -> str:
        pct = f"{self.percent:5.1f} %" if self.total else "    - "
        parts = [f"{s} {n}" for s, n in sorted(self.counts.items())]
        took = f"  ({self.seconds:.0f} s)" if self.seconds is not None else ""
        return f"{self.module:24} {self.killed:4}/{self.total:<4} {pct}  [{', '.join(parts)}]{took}"


def settings() -> tuple[dict, dict]:
    """pyproject.toml's [tool.mutmut] (shared settings) and [tool.orka.mutation]."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    return tool["mutmut"], tool["orka"]["mutation"]


def modules() -> list[Module]:
    _, ours = settings()
    functions = ours.get("functions", {})
    return [Module(path, list(tests), functions.get(path)) for path, tests in ours["tests"].items()]


def threshold() -> float:
    return float(settings()[1]["threshold"])


def resolve(name: str, known: list[Module]) -> Module:
    """'registry', 'scheduler/registry', 'orka/scheduler/registry.py' -> the module."""
    stem = name.removesuffix(".py").replace(".", "/").removeprefix("orka/")
    hits = [m for m in known if m.short == stem or m.short.endswith("/" + stem)]
    if len(hits) != 1:
        names = ", ".join(m.short for m in known)
        sys.exit(f"error: module {name!r} names {len(hits)} core modules; one of: {names}")
    return hits[0]


# ---- the functions of a module, as mutmut names them, and a hash of each ----


def function_hashes(path: Path) -> dict[str, str]:
    """mutmut's name for each top-level function and method -> a hash of its code (formatting
    and comments left out, so only a change mutmut would mutate differently counts)."""
    tree = ast.parse(path.read_text())
    found: dict[str, str] = {}

    def add(name: str, node: ast.AST) -> None:
        found[name] = hashlib.sha256(ast.dump(node).encode()).hexdigest()[:16]

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            add(f"x_{node.name}", node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    add(f"xǁ{node.name}ǁ{item.name}", item)
    return found


def decorated(path: Path) -> set[str]:
    """The functions mutmut leaves alone: decorated ones, but for staticmethod/classmethod."""
    tree = ast.parse(path.read_text())
    plain = {"staticmethod", "classmethod"}
    found = set()
    for node in tree.body:
        items = node.body if isinstance(node, ast.ClassDef) else [node]
        for item in items:
            if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            names = [d.id for d in item.decorator_list if isinstance(d, ast.Name)]
            if item.decorator_list and not (
                len(names) == 1 == len(item.decorator_list) and names[0] in plain
            ):
                found.add(f"xǁ{node.name}ǁ{item.name}" if node is not item else f"x_{item.name}")
    return found


def function_of(key: str) -> str:
    """orka.models.xǁResourcesǁ__add____mutmut_3 -> xǁResourcesǁ__add__"""
    return SUFFIX.sub("", key).rsplit(".", 1)[1]


# ---- the work folder of a module, and mutmut run in it ----


def mutmut_section(module: Module) -> str:
    shared, _ = settings()
    cfg = {
        **shared,
        "source_paths": ["orka"],
        "only_mutate": [module.path],
        "pytest_add_cli_args_test_selection": module.tests,
        # The work folder is no git checkout; results are kept by function hash instead.
        "use_git_change_detection": False,
    }
    lines = ["[tool.mutmut]"]
    for key, value in cfg.items():
        lines.append(f"{key} = {json.dumps(value, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def prepare(module: Module, fresh: bool) -> None:
    """Copy the tree into the module's work folder. mutmut copies a source file into mutants/
    only when it is missing there, so every other file is removed first: a change anywhere in
    orka/ or tests/ reaches the next run."""
    work = module.work
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    shared, _ = settings()
    for name in ["orka", "tests", *shared.get("also_copy", [])]:
        src, dst = ROOT / name, work / name
        if dst.is_dir():
            shutil.rmtree(dst)
        elif dst.exists():
            dst.unlink()
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, dst)
    mutants = work / "mutants"
    # The mutated module stays: mutmut regenerates it (and forgets its results) only when the
    # source is newer than it, which copy2's kept modification time tells it.
    keep = {
        mutants / "mutmut-stats.json",
        *(mutants / module.path).parent.glob(Path(module.path).name + "*"),
    }
    if mutants.exists():
        for p in mutants.rglob("*"):
            if p.is_file() and p not in keep:
                p.unlink()
    text = (ROOT / "pyproject.toml").read_text()
    text = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text)
    text = re.sub(r"(?ms)^\[tool\.orka\.mutation[^\]]*\]\n.*?(?=^\[|\Z)", "", text)
    (work / "pyproject.toml").write_text(text.rstrip() + "\n\n" + mutmut_section(module))


def mutmut_exe() -> str:
    return shutil.which("mutmut") or str(Path(sys.executable).parent / "mutmut")


def env() -> dict[str, str]:
    # mutmut puts mutants/ first on sys.path itself; a PYTHONPATH naming the checkout would
    # shadow the mutated copies with the originals and every mutant would survive.
    e = dict(os.environ)
    e.pop("PYTHONPATH", None)
    return e


def run_mutmut(
    module: Module,
    names: list[str],
    children: int,
    functions: list[str] | None = None,
    quiet: bool = False,
) -> float:
    """mutmut run. Given the `functions` the names stand for, a run that fails because none of
    them has a mutant (nothing in it mutmut mutates) is not an error."""
    start = time.monotonic()
    cmd = [mutmut_exe(), "run", "--max-children", str(children), *names]
    shown = names if len(names) <= 4 else [*names[:3], f"... ({len(names)} names)"]
    print(f"==> {module.short}: mutmut run {' '.join(shown)}", flush=True)
    errors = subprocess.DEVNULL if quiet else subprocess.STDOUT
    # mutmut's own report goes to a file: on a failure its end says why (a test that failed in
    # the run without mutants, say), which a bare exit code does not.
    output = module.work / "mutmut-run.log"
    for attempt in (1, 2):
        with open(output, "wb") as out:
            done = subprocess.run(
                cmd, cwd=module.work, env=env(), check=False, stdout=out, stderr=errors
            )
        text = output.read_text(errors="replace")
        # mutmut's first steps run the module's tests without mutants ("stats", then a "clean
        # test"); a test that fails there failed on its own, not because of a mutant (the
        # pytest stage ran it too): run them once more as mutmut did, to name a test that
        # fails again (mutmut names none), then run mutmut again, so one timing flake under
        # the mutation stage's slower tracing does not decide a score.
        unmutated = ("failed to collect stats", "Failed to run clean test")
        if done.returncode != 0 and any(t in text for t in unmutated) and attempt == 1:
            print(f"==> {module.short}: the run without mutants failed; again", flush=True)
            print("\n".join(f"  | {line}" for line in _report(text)), flush=True)
            _show_unmutated_failures(module)
            continue
        break
    lacking = functions is not None and not any(
        function_of(k) in functions for k in results(module)
    )
    if done.returncode != 0 and not lacking:
        print("\n".join(f"  | {line}" for line in _report(text)), flush=True)
        sys.exit(f"error: mutmut run failed for {module.path} (exit {done.returncode})")
    took = time.monotonic() - start
    print(f"==> {module.short}: {took:.0f} s", flush=True)
    return took


def _show_unmutated_failures(module: Module) -> None:
    """mutmut keeps the failing tests of its run without mutants to itself: run them once more
    as it does (its copy, its pytest flags, its call tracing on) and print pytest's verdicts,
    so a CI log names the test (one past the per-test timeout under tracing, say)."""
    shared, _ = settings()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *shared.get("pytest_add_cli_args", []),
        "-rfE",
        *module.tests,
    ]
    print(f"==> {module.short}: its tests without mutants, as mutmut ran them", flush=True)
    done = subprocess.run(
        cmd,
        cwd=module.work / "mutants",
        env={**env(), "MUTANT_UNDER_TEST": "stats"},
        check=False,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.splitlines()
    shown = [line for line in lines if line.startswith(("FAILED", "ERROR"))] or lines[-20:]
    print("\n".join(f"  | {line}" for line in shown), flush=True)


def _report(text: str) -> list[str]:
    """The end of mutmut's output without its progress spinner: the failing tests' lines and
    mutmut's own words."""
    lines = [
        line
        for line in text.splitlines()
        if line.strip() and not any("\u2800" <= ch <= "\u28ff" for ch in line)  # spinner
    ]
    failing = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return failing[-10:] + lines[-20:]


def globs(module: Module, functions: list[str] | None) -> list[str]:
    chosen = functions if functions is not None else module.functions
    if chosen is None:
        return [f"{module.dotted}.*"]
    return [f"{module.dotted}.{f}__mutmut_*" for f in chosen]


# ---- results ----


def results(module: Module) -> dict[str, str]:
    """mutant -> status, for the mutants of the functions this module's scoring covers."""
    from mutmut.stats import status_by_exit_code

    meta = meta_path(module)
    if not meta.exists():
        return {}
    codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
    return {
        key: status_by_exit_code[code]
        for key, code in sorted(codes.items())
        if module.covers(function_of(key))
    }


def meta_path(module: Module) -> Path:
    return module.work / "mutants" / f"{module.path}.meta"


def _hashes_path(module: Module) -> Path:
    # Beside mutmut's meta file, not in it: mutmut refuses a meta file with keys of its own.
    return meta_path(module).with_suffix(".orka-hashes.json")


def exit_codes(module: Module) -> dict[str, int | None]:
    """The last run's verdicts, of the functions whose source has not changed since (each run
    records its functions' hashes beside mutmut's meta file; without them nothing is kept)."""
    meta = meta_path(module)
    if not meta.exists():
        return {}
    codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
    hashes = _hashes_path(module)
    if not hashes.exists():
        return {}
    then = json.loads(hashes.read_text())
    now = function_hashes(ROOT / module.path)
    return {k: c for k, c in codes.items() if then.get(function_of(k)) == now.get(function_of(k))}


def note_hashes(module: Module) -> None:
    if meta_path(module).exists():
        _hashes_path(module).write_text(json.dumps(function_hashes(ROOT / module.path)))


def keep_verdicts(module: Module, before: dict[str, int | None]) -> None:
    """Restore the verdicts mutmut dropped in a survivors-only run. mutmut forgets every result
    when the test selection changes (a test file added to the module's list); a kill stays a
    kill when tests are only added (each mutant stops at its first failing test), so the
    earlier verdict of a mutant not re-run still holds. Only valid after adding tests."""
    meta = meta_path(module)
    data = json.loads(meta.read_text())
    codes = data["exit_code_by_key"]
    restored = 0
    for key, code in before.items():
        if codes.get(key) is None and code is not None:
            codes[key] = code
            restored += 1
    meta.write_text(json.dumps(data, indent=4))
    note_hashes(module)
    if restored:
        print(f"==> {module.short}: kept {restored} verdicts of the last run", flush=True)


def score_of(name: str, statuses: dict[str, str]) -> Score:
    s = Score(name)
    for key, status in statuses.items():
        s.counts[status] += 1
        if status in SURVIVED or status == "suspicious":
            s.survivors.append(f"{key}: {status}")
    return s


def record(chosen: list[Module]) -> None:
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    for module in chosen:
        statuses = results(module)
        if not statuses or any(s == "not checked" for s in statuses.values()):
            sys.exit(f"error: {module.path}: no complete run to record")
        # Every function, those without mutants too: a change to one is then seen as one.
        per: dict[str, dict] = {
            f: {"hash": h, "mutants": {}}
            for f, h in function_hashes(ROOT / module.path).items()
            if module.covers(f)
        }
        for key, status in statuses.items():
            per[function_of(key)]["mutants"][key.rsplit("__mutmut_", 1)[1]] = status
        baseline[module.path] = per
        print(f"recorded {module.path}: {len(statuses)} mutants in {len(per)} functions")
    BASELINE.write_text(json.dumps(baseline, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def budget() -> int:
    """The most mutants --changed runs per module; 0: no limit."""
    return int(settings()[1].get("changed_budget", 0))


def sample(keys: list[str], size: int) -> list[str]:
    """`size` of `keys`, the same ones on every run and machine (ordered by a hash of each
    name, so neither the order of functions in the file nor their names' spelling biases it)."""
    return sorted(keys, key=lambda k: hashlib.sha256(k.encode()).hexdigest())[:size]


def within_budget(module: Module, functions: list[str]) -> list[str]:
    """The mutant names --changed runs for `functions`: all of them, or a sample when they
    have more mutants than the budget. A rewrite touches hundreds of functions, and a full
    run of one module takes up to an hour, which CI cannot spend; the sample still fails a
    change whose new code no test pins, and the mutants left out are shown as not checked
    until a full run by hand records them (README, Development)."""
    size = budget()
    names = globs(module, functions)
    if not size:
        return names
    # Naming no mutant makes mutmut generate them all (listed in its meta file) and stop
    # before it runs any test.
    generate = f"{module.dotted}.x_orka_generate_only__mutmut_0"
    run_mutmut(module, [generate], 1, functions=["x_orka_generate_only"], quiet=True)
    keys = [k for k in results(module) if function_of(k) in functions]
    if len(keys) <= size:
        return names
    print(
        f"  {len(keys)} mutants in the changed functions; running {size} of them (budget"
        f" changed_budget in pyproject.toml; all of them: scripts/mutation.py {module.short})",
        flush=True,
    )
    return sample(keys, size)


def changed(chosen: list[Module], children: int) -> int:
    """Mutation-test only what changed since the baseline; 1 when a module falls short."""
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    failed = False
    for module in chosen:
        if module.path not in baseline:
            # A whole module takes up to an hour: it is recorded by hand, not in CI.
            print(f"{module.path}: no recorded run, skipped (record one: README, Development)")
            continue
        recorded: dict[str, dict] = baseline[module.path]
        now = {f: h for f, h in function_hashes(ROOT / module.path).items() if module.covers(f)}
        differ = sorted(f for f, h in now.items() if recorded.get(f, {}).get("hash") != h)
        statuses = {
            f"{module.dotted}.{f}__mutmut_{n}": status
            for f, fn in recorded.items()
            if f in now and f not in differ
            for n, status in fn["mutants"].items()
        }
        skipped = decorated(ROOT / module.path)
        if differ:
            print(f"{module.path}: {len(differ)} function(s) changed: {', '.join(differ)}")
        if set(differ) & skipped:
            # A decorated function is not mutated; say so rather than pass it in silence.
            print(f"  not mutated (decorated): {', '.join(sorted(set(differ) & skipped))}")
        mutate = [f for f in differ if f not in skipped]
        if mutate:
            work = module.for_changed()
            prepare(work, fresh=True)
            run_mutmut(work, within_budget(work, mutate), children, functions=mutate)
            statuses.update((k, s) for k, s in results(work).items() if function_of(k) in differ)
        s = score_of(module.short, statuses)
        print(s.line())
        if differ and s.percent < threshold():
            failed = True
            print(f"error: {module.path}: {s.percent:.1f} % killed, below {threshold():.0f} %")
            for line in s.survivors:
                if function_of(line.split(":")[0]) in differ:
                    print(f"  new survivor {line}")
    if not failed:
        print(f"mutation: every core module at or above {threshold():.0f} % where it changed")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="core modules (default: all of them)")
    parser.add_argument("--report", action="store_true", help="print the last run's scores")
    parser.add_argument("--survivors", action="store_true", help="show each survivor's diff")
    parser.add_argument(
        "--survivors-again", action="store_true", help="re-test last run's survivors only"
    )
    parser.add_argument("--record", action="store_true", help="write the baseline file")
    parser.add_argument("--changed", action="store_true", help="CI: what changed since it")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel mutants")
    args = parser.parse_args()

    known = modules()
    chosen = [resolve(m, known) for m in args.modules] or known
    if args.changed:
        sys.exit(changed(chosen, args.jobs))
    if args.record:
        record(chosen)
        return
    took: dict[str, float] = {}
    if args.survivors_again:
        for module in chosen:
            again = [k for k, s in results(module).items() if s in SURVIVED | {"suspicious"}]
            if again:
                before = exit_codes(module)
                prepare(module, fresh=False)
                took[module.path] = run_mutmut(module, again, args.jobs)
                keep_verdicts(module, before)
    elif not (args.report or args.survivors):
        for module in chosen:
            prepare(module, fresh=True)
            took[module.path] = run_mutmut(module, globs(module, None), args.jobs)
            note_hashes(module)

    scores = [score_of(m.short, results(m)) for m in chosen]
    print("\nmodule                   killed/total score  [statuses]  (run time)")
    for m, s in zip(chosen, scores, strict=True):
        s.seconds = took.get(m.path)
        print(s.line())
    killed, total = sum(s.killed for s in scores), sum(s.total for s in scores)
    if total:
        print(f"{'all':24} {killed:4}/{total:<4} {100 * killed / total:5.1f} %")
    for m, s in zip(chosen, scores, strict=True):
        if s.survivors:
            print(f"\nsurvivors in {m.path}:")
        for line in s.survivors:
            print(f"  {line}")
            if args.survivors:
                name = line.split(":")[0]
                subprocess.run([mutmut_exe(), "show", name], cwd=m.work, env=env(), check=False)


if __name__ == "__main__":
    main()
