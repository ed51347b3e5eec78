"""scripts/mutation.py: the names and hashes it gives functions, the per-module mutmut config it
writes, and --changed, which CI runs: what it mutates, how it scores, when it fails."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mutation() -> ModuleType:
    spec = importlib.util.spec_from_file_location("orka_mutation", ROOT / "scripts/mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["orka_mutation"] = module
    spec.loader.exec_module(module)
    return module


SOURCE = """
def top(a):
    return a + 1

class Box:
    def put(self, x):
        return [x]

    async def take(self):
        return None
"""


def test_functions_are_named_as_mutmut_names_them(mutation: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    assert sorted(mutation.function_hashes(path)) == ["x_top", "xǁBoxǁput", "xǁBoxǁtake"]
    assert mutation.function_of("orka.m.xǁBoxǁput__mutmut_12") == "xǁBoxǁput"
    assert mutation.function_of("orka.a.b.x_top__mutmut_3") == "x_top"


def test_hash_ignores_comments_and_layout_but_not_code(
    mutation: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    before = mutation.function_hashes(path)
    path.write_text(SOURCE.replace("return a + 1", "# why\n    return (a +\n            1)"))
    assert mutation.function_hashes(path) == before
    path.write_text(SOURCE.replace("return a + 1", "return a - 1"))
    after = mutation.function_hashes(path)
    assert after["x_top"] != before["x_top"]
    assert {k: v for k, v in after.items() if k != "x_top"} == {
        k: v for k, v in before.items() if k != "x_top"
    }


def test_every_configured_module_and_function_exists(mutation: ModuleType) -> None:
    modules = mutation.modules()
    assert {m.path for m in modules} >= {
        "orka/scheduler/registry.py",
        "orka/controller/placement.py",
        "orka/controller/reconciler.py",
        "orka/controller/api.py",
        "orka/agent/supervisor.py",
        "orka/security/identity.py",
        "orka/models.py",
        "orka/scheduler/gateway.py",
        "orka/scheduler/liveness.py",
        "orka/scheduler/placer.py",
        "orka/scheduler/feed.py",
    }
    for m in modules:
        hashes = mutation.function_hashes(ROOT / m.path)
        assert set(m.functions or []) <= set(hashes), m.path
        for t in m.tests:
            # A test left out by node id (`--deselect=FILE::TEST[PARAMS]`) names a real test.
            path, _, node = t.removeprefix("--deselect=").partition("::")
            assert (ROOT / path).exists(), t
            if node:
                assert t.startswith("--deselect="), t
                assert f"def {node.partition('[')[0]}(" in (ROOT / path).read_text(), t


def test_the_work_folder_config_names_one_module_and_its_tests(
    mutation: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(mutation, "WORK", tmp_path)
    module = next(m for m in mutation.modules() if m.path == "orka/models.py")
    cfg = tomllib.loads("[x]\n" + mutation.mutmut_section(module).split("\n", 1)[1])["x"]
    assert cfg["only_mutate"] == ["orka/models.py"]
    assert cfg["pytest_add_cli_args_test_selection"] == module.tests
    assert cfg["use_git_change_detection"] is False
    assert cfg["process_isolation"] == "forkserver"


def _fake_module(mutation: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    src = tmp_path / "orka" / "m.py"
    src.parent.mkdir()
    src.write_text(SOURCE)
    module = mutation.Module("orka/m.py", ["tests/unit"], None)
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    monkeypatch.setattr(mutation, "BASELINE", tmp_path / "baseline.json")
    monkeypatch.setattr(mutation, "threshold", lambda: 85.0)
    monkeypatch.setattr(mutation, "prepare", lambda module, fresh: None)
    monkeypatch.setattr(mutation, "budget", lambda: 0)
    hashes = mutation.function_hashes(src)
    baseline = {
        "orka/m.py": {
            "x_top": {"hash": hashes["x_top"], "mutants": {"1": "killed", "2": "survived"}},
            "xǁBoxǁput": {
                "hash": hashes["xǁBoxǁput"],
                "mutants": {str(n): "killed" for n in range(1, 9)},
            },
            "xǁBoxǁtake": {
                "hash": hashes["xǁBoxǁtake"],
                "mutants": {str(n): "killed" for n in range(1, 5)},
            },
        }
    }
    (tmp_path / "baseline.json").write_text(json.dumps(baseline))
    return src, module


def test_changed_runs_nothing_when_nothing_changed(
    mutation: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, module = _fake_module(mutation, tmp_path, monkeypatch)

    def never(*args: object) -> float:
        raise AssertionError("mutmut ran though nothing changed")

    monkeypatch.setattr(mutation, "run_mutmut", never)
    assert mutation.changed([module], 2) == 0
    # 13 of the 14 recorded mutants killed
    assert re.search(r"\b13/14\s+92\.9 %", capsys.readouterr().out)


@pytest.mark.parametrize(("new_results", "code"), [("killed", 0), ("survived", 1)])
def test_changed_mutates_only_the_changed_function_and_scores_the_module(
    mutation: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    new_results: str,
    code: int,
) -> None:
    src, module = _fake_module(mutation, tmp_path, monkeypatch)
    src.write_text(SOURCE.replace("return [x]", "return [x, x]"))
    ran: list[list[str]] = []
    monkeypatch.setattr(
        mutation, "run_mutmut", lambda m, names, jobs, functions=None: ran.append(names) or 1.0
    )
    # the changed function now has 3 mutants; results() also returns stale ones of others
    monkeypatch.setattr(
        mutation,
        "results",
        lambda m: {
            **{f"orka.m.xǁBoxǁput__mutmut_{n}": new_results for n in (1, 2, 3)},
            "orka.m.x_top__mutmut_1": "survived",
        },
    )
    assert mutation.changed([module], 2) == code
    assert ran == [["orka.m.xǁBoxǁput__mutmut_*"]]
    out = capsys.readouterr().out
    # recorded: x_top 1 of 2 killed, take 4 of 4; this run: put 3 of 3 (or 0 of 3), not
    # the 8 recorded for it before the change
    expected = r"\b8/9\s+88\.9 %" if new_results == "killed" else r"\b5/9\s+55\.6 %"
    assert re.search(expected, out)
    if code:
        assert "orka.m.xǁBoxǁput__mutmut_1: survived" in out


def test_changed_runs_a_fixed_sample_when_the_change_has_more_mutants_than_the_budget(
    mutation: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, module = _fake_module(mutation, tmp_path, monkeypatch)
    src.write_text(SOURCE.replace("return [x]", "return [x, x]"))
    monkeypatch.setattr(mutation, "budget", lambda: 4)
    generated = {f"orka.m.xǁBoxǁput__mutmut_{n}": "not checked" for n in range(1, 11)}
    state = dict(generated)
    ran: list[list[str]] = []

    def run(m: object, names: list[str], jobs: int, **kw: object) -> float:
        ran.append(names)
        for name in names:
            if name in state:
                state[name] = "killed"
        return 1.0

    monkeypatch.setattr(mutation, "run_mutmut", run)
    monkeypatch.setattr(mutation, "results", lambda m: dict(state))
    assert mutation.changed([module], 2) == 0
    # first a run that only generates the mutants, then 4 of the 10, named one by one
    assert len(ran) == 2 and "generate_only" in ran[0][0]
    assert len(ran[1]) == 4 and set(ran[1]) <= set(generated)
    assert ran[1] == mutation.sample(sorted(generated, reverse=True), 4)
    out = capsys.readouterr().out
    assert "10 mutants in the changed functions; running 4 of them" in out
    # scored: recorded x_top 1 of 2 and take 4 of 4, this run's 4 of 4 (6 not checked)
    assert re.search(r"\b9/10\s+90\.0 %.*not checked 6", out)


def test_changed_skips_a_module_with_no_recorded_run(
    mutation: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, module = _fake_module(mutation, tmp_path, monkeypatch)
    (tmp_path / "baseline.json").write_text("{}")
    monkeypatch.setattr(mutation, "run_mutmut", lambda *a: pytest.fail("mutmut ran"))
    assert mutation.changed([module], 2) == 0
    assert "orka/m.py: no recorded run, skipped" in capsys.readouterr().out


def test_a_survivors_only_run_keeps_the_other_verdicts_of_unchanged_functions(
    mutation: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, _ = _fake_module(mutation, tmp_path, monkeypatch)
    module = mutation.Module("orka/m.py", ["tests/unit"], None)
    monkeypatch.setattr(mutation, "WORK", tmp_path / "work")
    meta = mutation.meta_path(module)
    meta.parent.mkdir(parents=True)
    codes = {
        "orka.m.x_top__mutmut_1": 1,
        "orka.m.x_top__mutmut_2": 0,
        "orka.m.xǁBoxǁput__mutmut_1": 1,
    }
    meta.write_text(json.dumps({"exit_code_by_key": codes}))
    mutation.note_hashes(module)
    before = mutation.exit_codes(module)
    assert before == codes
    # mutmut re-ran the survivor (now killed) and forgot the rest
    meta.write_text(
        json.dumps({"exit_code_by_key": {**dict.fromkeys(codes), "orka.m.x_top__mutmut_2": 1}})
    )
    mutation.keep_verdicts(module, before)
    assert json.loads(meta.read_text())["exit_code_by_key"] == {
        **codes,
        "orka.m.x_top__mutmut_2": 1,
    }
    # a function changed since the run: its old verdicts no longer count
    src.write_text(SOURCE.replace("return a + 1", "return a + 2"))
    assert mutation.exit_codes(module) == {"orka.m.xǁBoxǁput__mutmut_1": 1}


def test_a_changed_decorated_function_is_named_but_not_mutated(
    mutation: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # mutmut skips decorated functions: --changed says so instead of failing on no mutants.
    src, module = _fake_module(mutation, tmp_path, monkeypatch)
    src.write_text(SOURCE.replace("    def put(", "    @property\n    def put("))
    assert mutation.decorated(src) == {"xǁBoxǁput"}
    monkeypatch.setattr(mutation, "run_mutmut", lambda *a, **k: pytest.fail("mutmut ran"))
    mutation.changed([module], 2)
    out = capsys.readouterr().out
    assert "not mutated (decorated): xǁBoxǁput" in out
    # put's recorded mutants are gone with it: x_top 1 of 2, take 4 of 4
    assert re.search(r"\b5/6\s+83\.3 %", out)


def test_a_failed_run_without_mutants_names_the_failing_test(
    mutation: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(mutation, "WORK", tmp_path)
    monkeypatch.setattr(
        mutation, "settings", lambda: ({"pytest_add_cli_args": ["-p", "no:cacheprovider"]}, {})
    )
    module = mutation.Module("orka/thing.py", ["tests/test_thing.py"], None)
    tests = module.work / "mutants" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_thing.py").write_text(
        "import os\n\n"
        "def test_traced():\n"
        "    assert os.environ['MUTANT_UNDER_TEST'] == 'stats'\n\n"
        "def test_slow_under_tracing():\n"
        "    assert 1 == 2\n"
    )
    mutation._show_unmutated_failures(module)
    out = capsys.readouterr().out
    assert "  | FAILED tests/test_thing.py::test_slow_under_tracing" in out
    assert "test_traced" not in out


@pytest.fixture
def flaky_mutmut(mutation: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The script's work folders under tmp_path, and `mutmut` its name."""
    monkeypatch.setattr(mutation, "WORK", tmp_path)
    monkeypatch.setattr(mutation, "mutmut_exe", lambda: "mutmut")


@pytest.mark.usefixtures("flaky_mutmut")
def test_a_first_failure_without_mutants_names_the_tests_and_runs_mutmut_again(
    mutation: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = mutation.Module("orka/thing.py", ["tests/test_thing.py"], None)
    module.work.mkdir(parents=True)
    runs: list[list[str]] = []

    def run(cmd: list[str], stdout: Any = None, **kwargs: Any) -> subprocess.CompletedProcess:
        runs.append(cmd)
        flaked = len(runs) == 1
        stdout.write(b"failed to collect stats. runner returned 1\n" if flaked else b"done\n")
        return subprocess.CompletedProcess(cmd, 1 if flaked else 0)

    shown: list[str] = []
    monkeypatch.setattr(mutation.subprocess, "run", run)
    monkeypatch.setattr(mutation, "_show_unmutated_failures", lambda m: shown.append(m.path))
    mutation.run_mutmut(module, ["orka.thing.*"], 2)
    assert [cmd[:2] for cmd in runs] == [["mutmut", "run"], ["mutmut", "run"]]
    assert shown == ["orka/thing.py"]
    out = capsys.readouterr().out
    assert "==> thing: the run without mutants failed; again" in out
    assert "  | failed to collect stats. runner returned 1" in out
