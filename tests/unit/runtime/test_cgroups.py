"""The cgroup layer against directories laid out like cgroupfs (v2: what Debian 12 hosts have;
the v1 path runs for real in test_isolation.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orka.models import Resources
from orka.runtime.cgroups import CgroupsV1, CgroupsV2, cpu_quota_us, detect


def _v2_root(tmp_path: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


class FakeKernelV2(CgroupsV2):
    """cgroupfs creates a new cgroup's files itself; a plain directory needs them made."""

    def create(self, name: str, resources: Resources) -> None:
        self.prepare()
        d = self.root / self.parent / name
        d.mkdir(exist_ok=True)
        for f in ("memory.max", "memory.swap.max", "memory.oom.group", "cpu.max"):
            (d / f).touch()
        super().create(name, resources)

    def prepare(self) -> None:
        current = self.root
        for part in Path(self.parent).parts:
            current = current / part
            current.mkdir(exist_ok=True)
            (current / "cgroup.subtree_control").touch()
        super().prepare()


def test_v2_limits(tmp_path: Path) -> None:
    root = _v2_root(tmp_path)
    cg = FakeKernelV2(root, "orka/n1")
    cg.create("web-0", Resources(cpu_millis=250, memory_bytes=64 << 20))
    d = root / "orka" / "n1" / "web-0"
    assert cg.dirs("web-0") == [d]
    assert cg.procs_files("web-0") == [d / "cgroup.procs"]
    assert (d / "memory.max").read_text() == str(64 << 20)
    # No swap past the limit, and the OOM killer takes the whole instance.
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "memory.oom.group").read_text() == "1"
    assert (d / "cpu.max").read_text() == "25000 100000"
    # Every level from the root down lets its children use memory and cpu.
    for level in (root, root / "orka", root / "orka" / "n1"):
        assert (level / "cgroup.subtree_control").read_text() == "+memory +cpu"


def test_v2_zero_means_no_limit(tmp_path: Path) -> None:
    root = _v2_root(tmp_path)
    cg = FakeKernelV2(root, "orka")
    cg.create("web-0", Resources())
    d = root / "orka" / "web-0"
    assert (d / "memory.max").read_text() == "max"
    assert (d / "memory.swap.max").read_text() == "max"
    assert (d / "cpu.max").read_text() == "max 100000"


def test_v2_oom_kills_and_remove(tmp_path: Path) -> None:
    root = _v2_root(tmp_path)
    cg = FakeKernelV2(root, "orka")
    cg.create("web-0", Resources(memory_bytes=1 << 20))
    d = root / "orka" / "web-0"
    assert cg.oom_kills("web-0") == 0  # no memory.events yet
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert cg.oom_kills("web-0") == 1
    (d / "cgroup.procs").write_text("")
    for f in d.iterdir():  # cgroupfs' files vanish with the directory; a plain dir's do not
        f.unlink()
    assert cg.exists("web-0")
    cg.remove("web-0")
    assert not cg.exists("web-0")
    cg.remove("web-0")  # idempotent


def test_v1_oom_kills_from_oom_control_then_failcnt(tmp_path: Path) -> None:
    cg = CgroupsV1(tmp_path / "memory", tmp_path / "cpu", "orka")
    mem = tmp_path / "memory" / "orka" / "web-0"
    mem.mkdir(parents=True)
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cg.oom_kills("web-0") == 2
    # Before Linux 4.13 oom_control has no oom_kill line: hitting the limit is the sign.
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    (mem / "memory.failcnt").write_text("7\n")
    assert cg.oom_kills("web-0") == 7


@pytest.mark.parametrize(("millis", "quota"), [(1000, 100_000), (2500, 250_000), (1, 1000)])
def test_cpu_quota(millis: int, quota: int) -> None:
    # 1 millicore would be 100 us; the kernel's minimum quota is 1 ms.
    assert cpu_quota_us(millis) == quota


def _mountinfo(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_detect_prefers_v2_with_both_controllers(tmp_path: Path) -> None:
    root = _v2_root(tmp_path)
    (root / "orka").mkdir()
    (root / "orka" / "cgroup.subtree_control").write_text("")  # as cgroupfs makes it
    info = _mountinfo(
        tmp_path,
        [f"30 23 0:26 / {root} rw,nosuid,nodev,noexec shared:4 - cgroup2 cgroup2 rw,nsdelegate"],
    )
    cg, why = detect("orka", info)
    assert isinstance(cg, CgroupsV2) and why == ""
    assert (root / "cgroup.subtree_control").read_text() == "+memory +cpu"
    assert (root / "orka" / "cgroup.subtree_control").read_text() == "+memory +cpu"


def test_detect_falls_back_to_v1_when_unified_is_empty(tmp_path: Path) -> None:
    # This machine's layout: an empty cgroup2 beside v1 memory and cpu hierarchies.
    unified = _v2_root(tmp_path, controllers="")
    (tmp_path / "memory").mkdir()
    (tmp_path / "cpu,cpuacct").mkdir()
    info = _mountinfo(
        tmp_path,
        [
            f"30 23 0:26 / {unified} rw shared:4 - cgroup2 cgroup2 rw",
            f"31 23 0:27 / {tmp_path / 'memory'} rw shared:5 - cgroup cgroup rw,memory",
            f"32 23 0:28 / {tmp_path / 'cpu,cpuacct'} rw shared:6 - cgroup cgroup rw,cpu,cpuacct",
        ],
    )
    cg, why = detect("orka/n1", info)
    assert isinstance(cg, CgroupsV1) and why == ""
    assert cg.dirs("web-0") == [
        tmp_path / "memory" / "orka" / "n1" / "web-0",
        tmp_path / "cpu,cpuacct" / "orka" / "n1" / "web-0",
    ]


def test_detect_none_when_not_writable(tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "orka").write_text("a file where the parent dir would go")
    (tmp_path / "cpu").mkdir()
    info = _mountinfo(
        tmp_path,
        [
            f"31 23 0:27 / {memory} rw - cgroup cgroup rw,memory",
            f"32 23 0:28 / {tmp_path / 'cpu'} rw - cgroup cgroup rw,cpu",
        ],
    )
    cg, why = detect("orka", info)
    assert cg is None
    assert "cgroup v1" in why


def test_detect_none_without_hierarchies(tmp_path: Path) -> None:
    cg, why = detect("orka", _mountinfo(tmp_path, ["22 1 0:5 / /proc rw - proc proc rw"]))
    assert cg is None
    assert "no cgroup hierarchy" in why
