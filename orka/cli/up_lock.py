"""One `orka up` per data dir, and what an earlier run left running.

`orka up` holds an advisory lock on `<data-dir>/up.lock` while it runs (the kernel drops it when
the process dies, however it dies) and records its children in `<data-dir>/up.pids`. A new run
that gets the lock finds in that file any child of an earlier run still alive; it stops them when
they are provably that run's (same pid, same start time, an `orka` command line naming this data
dir) and otherwise only reports what holds a port.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import psutil

from orka.errors import OrkaError

LOCK_FILE = "up.lock"
PIDS_FILE = "up.pids"
# Start times read twice from /proc agree to the clock tick; allow for float rounding.
START_TIME_SLACK = 0.05


SERVICES = ("scheduler", "controller", "agent")


def orka_command(argv: list[str]) -> str | None:
    """The orka subcommand a command line runs (`python -m orka.cli.main agent ...`,
    `/path/orka agent ...`, `python /path/orka agent ...`), or None for anything else."""
    for i, arg in enumerate(argv[:3]):
        if arg == "orka.cli.main" or os.path.basename(arg) == "orka":
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


@dataclass(frozen=True)
class Recorded:
    """A child of an `orka up` run, as that run wrote it down."""

    name: str
    role: str
    pid: int
    started: float

    def signal(self) -> signal.Signals:
        # An agent of `orka up` stops plainly (its instances too, no leave): every node of the
        # cluster is going away, so there is no one to hand the instances to.
        return signal.SIGINT if self.role == "agent" else signal.SIGTERM


def _owner_text(path: Path) -> str:
    try:
        data = json.loads(path.read_text())
        return f" (pid {int(data['pid'])})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


class UpLock:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.lock_path = data_dir / LOCK_FILE
        self.pids_path = data_dir / PIDS_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        """Hold the data dir for this process, or say which `orka up` holds it."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            owner = _owner_text(self.pids_path)
            raise OrkaError(
                f"another `orka up`{owner} is running on {self.data_dir}: stop it first "
                "(Ctrl-C in its terminal, or kill its pid), or pick another --data-dir"
            ) from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                self.pids_path.unlink()
            os.close(self.fd)
            self.fd = None

    def record(self, children: list[tuple[str, str, int]]) -> None:
        """Write down this run's pid and its children (name, role, pid) with their start times."""
        entries = []
        for name, role, pid in children:
            try:
                started = psutil.Process(pid).create_time()
            except psutil.NoSuchProcess:
                continue
            entries.append({"name": name, "role": role, "pid": pid, "started": started})
        tmp = self.pids_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "children": entries}))
        tmp.replace(self.pids_path)

    def recorded(self) -> list[Recorded]:
        try:
            data = json.loads(self.pids_path.read_text())
            return [
                Recorded(str(c["name"]), str(c["role"]), int(c["pid"]), float(c["started"]))
                for c in data["children"]
            ]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def stale(self) -> list[tuple[Recorded, psutil.Process]]:
        """The recorded children of an earlier run that still run, proven to be those children."""
        found = []
        for rec in self.recorded():
            try:
                proc = psutil.Process(rec.pid)
                same = abs(proc.create_time() - rec.started) < START_TIME_SLACK
                argv = proc.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            ours = orka_command(argv) in SERVICES
            if same and ours and any(str(self.data_dir) in a for a in argv):
                found.append((rec, proc))
        return found

    def unrecorded(self) -> list[int]:
        """Pids of orka services naming this data dir that no record proves ours (an `orka up`
        from before it recorded them, a removed pidfile): reported, never stopped."""
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            argv = proc.info["cmdline"] or []
            if orka_command(argv) in SERVICES and any(str(self.data_dir) in a for a in argv):
                found.append(proc.info["pid"])
        return sorted(found)


def stop_processes(stale: list[tuple[Recorded, psutil.Process]], grace: float) -> list[str]:
    """Stop an earlier run's children as `orka up` would; what had to be killed."""
    for rec, proc in stale:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(rec.signal())
            # A stopped process (SIGSTOP, ^Z) cannot act on the signal until it continues.
            proc.resume()
    _, alive = psutil.wait_procs([p for _, p in stale], timeout=grace)
    killed = []
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            killed.append(str(proc.pid))
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    return killed


def port_holder(port: int) -> str:
    """Who listens on `port`, as far as this user may see: ' (pid N: command)' or ''."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return ""
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            try:
                cmd = " ".join(psutil.Process(c.pid).cmdline())[:120]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                cmd = "?"
            return f" (held by pid {c.pid}: {cmd})"
    return ""
