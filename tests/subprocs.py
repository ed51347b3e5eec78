"""Process plumbing shared by the test environments (etcd, containerd, libvirt)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any


def reap(proc: subprocess.Popen[Any], grace: float, after_kill: float | None = None) -> None:
    """Wait up to `grace` s for an already signalled `proc` to exit; past that, SIGKILL it and
    wait `after_kill` s more (None: as long as it takes)."""
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(after_kill)


def fresh_python(code: str) -> str:
    """What `code` prints when run by a new interpreter (this one has imported most of orka
    already): for tests of what a process loads, and when."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
