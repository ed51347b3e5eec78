"""A container's log writer: containerd's `binary://` logging driver runs it per task.

The runc shim starts it with the container's stdout on fd 3 and its stderr on fd 4, and waits
for fd 5 to be closed before it starts the task; CONTAINER_ID names the task. It appends each
stream to its own file, `<root>/<id>/stdout.log` and `stderr.log` (O_APPEND, so the agent's
copytruncate rotation, orka.runtime.logs, works under it), and exits when both streams end
(the task's IO is closed). It belongs to the shim, not to the agent: logs keep being written
while the agent restarts. The driver writes the launcher script the shim runs
(`launcher_script`), which fixes the interpreter and import path: the shim gives the binary
no environment but CONTAINER_ID and CONTAINER_NAMESPACE.

    python -m orka.runtime.logwriter ROOT
"""

from __future__ import annotations

import os
import selectors
import sys
from pathlib import Path

STDOUT_FD, STDERR_FD, READY_FD = 3, 4, 5


def launcher_script(root: Path) -> str:
    import orka

    package_root = Path(orka.__file__).resolve().parent.parent
    return (
        "#!/bin/sh\n"
        f"PYTHONPATH='{package_root}' exec '{sys.executable}' -m orka.runtime.logwriter"
        f" '{root}'\n"
    )


def copy_streams(sources: dict[int, int]) -> None:
    """Copy each readable fd to its file fd until every source is at EOF."""
    sel = selectors.DefaultSelector()
    for src, dst in sources.items():
        sel.register(src, selectors.EVENT_READ, dst)
    while sel.get_map():
        for key, _ in sel.select():
            data = os.read(key.fd, 64 << 10)
            if not data:
                sel.unregister(key.fd)
                continue
            view = memoryview(data)
            while view:
                view = view[os.write(key.data, view) :]


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    instance = os.environ.get("CONTAINER_ID", "")
    if not instance or "/" in instance or instance.startswith("."):
        print(f"logwriter: bad CONTAINER_ID {instance!r}", file=sys.stderr)
        return 2
    directory = root / instance
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
    out = os.open(directory / "stdout.log", flags, 0o600)
    err = os.open(directory / "stderr.log", flags, 0o600)
    os.close(READY_FD)  # the shim may start the task now
    copy_streams({STDOUT_FD: out, STDERR_FD: err})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
