"""The parent-death signal `orka up` and the tests' etcd rely on, with real processes.

A small reaper process (a child subreaper, so orphans come back to it) starts a parent, the
parent starts `sleep` behind `die_with_parent`, and the reaper kills the parent with SIGKILL:
the orphaned `sleep` must then end of the signal asked for, which the reaper reads from its
wait status.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from orka.cli.parent_death import die_with_parent

pytestmark = pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv")

REAPER = textwrap.dedent(
    """
    import ctypes, os, signal, subprocess, sys
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    parent = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True
    )
    grandchild = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    # The orphan is ours now; a bounded wait, so a missing signal fails rather than hangs.
    signal.alarm(20)
    pid, status = os.waitpid(grandchild, 0)
    print(signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else "exited")
    """
)

PARENT = textwrap.dedent(
    """
    import json, subprocess, sys, time
    child = subprocess.Popen([*json.loads(sys.argv[1]), "sleep", "60"])
    # Until setpriv has set the signal and exec'd the command; a parent killed before that
    # leaves the child without one (a window of microseconds, which this test would hit).
    with open(f"/proc/{child.pid}/cmdline", "rb") as f:
        while not f.read().startswith(b"sleep"):
            time.sleep(0.01)
            f.seek(0)
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


def _orphan_ends_with(sig: signal.Signals) -> str:
    done = subprocess.run(
        [sys.executable, "-c", REAPER, PARENT, json.dumps(die_with_parent(sig))],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_the_child_gets_the_signal_asked_for_when_its_parent_is_killed(
    sig: signal.Signals,
) -> None:
    assert _orphan_ends_with(sig) == sig.name


def test_the_prefix_is_setprivs_and_ends_before_the_command() -> None:
    prefix = die_with_parent(signal.SIGINT)
    assert prefix[1:] == ["--pdeathsig", "INT", "--"]
    assert prefix[0] == shutil.which("setpriv")
