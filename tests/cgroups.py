"""Cgroups for tests: a parent of each test's own (engineers and CI jobs share the host), and
its removal with whatever a test left in it."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

from orka.runtime.cgroups import detect


def unique_parent() -> str:
    return f"orka-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_cgroup_parent(parent: str) -> None:
    """Kill what is left in the instance cgroups under `parent`, remove them, then it (and
    each of its own empty levels, e.g. `<test>/node-1`)."""
    cg, _ = detect(parent)
    if cg is None:
        return
    bases = {d.parent for d in cg.dirs("x")}
    for base in bases:
        for child in base.iterdir() if base.is_dir() else []:
            if child.is_dir():
                cg.remove(child.name)
    for base in bases:
        level = base
        for _ in Path(parent).parts:
            with contextlib.suppress(OSError):
                level.rmdir()
            level = level.parent


def detect_mounts() -> tuple[int, list[Path]]:
    """(cgroup version, the roots an instance cgroup is under) as `detect` would pick them;
    (0, []) where this process cannot manage cgroups."""
    cg, _ = detect("")
    if cg is None:
        return 0, []
    return cg.version, [d.parent for d in cg.dirs("x")]
