"""Set up one process instance's isolation, then exec its command: the step between the
agent's wrapper shell and the workload.

Run as a plain script (`python -I -S launch.py ...`), standard library only, so that it starts
fast and imports nothing from the workload's environment. It is a fresh single-threaded process,
which is what makes the privileged steps safe here (a `preexec_fn` in the multi-threaded agent
is not). In order, each before the workload's first instruction:

0. `--netns PATH`: join the instance's own network namespace (a process with `network: bridge`);
1. join the instance's cgroup(s): write our pid to each `--cgroup-procs` file;
2. `--private-tmp`: a mount namespace of our own with a fresh tmpfs on /tmp (skipped quietly
   where the platform refuses; the driver probes this once and logs it);
2b. `--read-only PATH` (repeatable): PATH bind-mounted read-only onto itself in a mount
   namespace of our own (a volume the workload may only read); fatal when refused;
3. `--uid/--gid`: drop supplementary groups, then the group, then the user, and set
   no_new_privs so no setuid binary can take the privileges back;
4. exec the command (an absolute path the agent resolved) with the environment we were given.

A failure in steps 0, 1, 2b or 3 is fatal (the command must not run with less isolation than asked):
it prints `orka-launch: ...` to stderr, which is the instance's stderr log, and exits 126.
"""

from __future__ import annotations

import ctypes
import os
import sys

EXIT_SETUP_FAILED = 126
EXIT_NOT_FOUND = 127

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_PR_SET_NO_NEW_PRIVS = 38


def _fail(message: str, code: int = EXIT_SETUP_FAILED) -> None:
    sys.stderr.write(f"orka-launch: {message}\n")
    sys.stderr.flush()
    os._exit(code)


def private_tmp(size: int, keep: list[str] | None = None) -> bool:
    """A mount namespace with an empty tmpfs on /tmp; False where that is not allowed.

    `keep`: directories under /tmp (an agent's volumes when its data dir is there) that stay
    visible at the same path: held open before the tmpfs hides them, bound back in after.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        return False
    # Our mounts must not propagate back to the host's namespace.
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    held = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in keep or ()]
    options = b"mode=1777" + (b",size=%d" % size if size else b"")
    if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        return False
    for path, fd in held:
        os.makedirs(path, mode=0o755, exist_ok=True)
        source = f"/proc/self/fd/{fd}".encode()
        if libc.mount(source, path.encode(), None, _MS_BIND | _MS_REC, None) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot keep {path} visible: {os.strerror(errno)}")
        os.close(fd)
    return True


def read_only(paths: list[str]) -> None:
    """Each path read-only for us and our children only (our own mount namespace)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    check(libc.unshare(_CLONE_NEWNS), "unshare")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "private mounts")
    for path in paths:
        p = path.encode()
        check(libc.mount(p, p, None, _MS_BIND | _MS_REC, None), f"bind {path}")
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        check(libc.mount(None, p, None, flags, None), f"read-only {path}")


def join_netns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    finally:
        os.close(fd)


def drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


def main(args: list[str]) -> None:
    procs: list[str] = []
    uid = gid = None
    tmp = False
    tmp_size = 0
    probe = False
    netns = ""
    readonly: list[str] = []
    keep: list[str] = []
    while args and args[0] != "--":
        flag = args.pop(0)
        if flag == "--cgroup-procs":
            procs.append(args.pop(0))
        elif flag == "--uid":
            uid = int(args.pop(0))
        elif flag == "--gid":
            gid = int(args.pop(0))
        elif flag == "--private-tmp":
            tmp = True
        elif flag == "--tmp-size":
            tmp_size = int(args.pop(0))
        elif flag == "--keep":
            keep.append(args.pop(0))
        elif flag == "--read-only":
            readonly.append(args.pop(0))
        elif flag == "--netns":
            netns = args.pop(0)
        elif flag == "--probe":
            probe = True
        else:
            _fail(f"unknown option {flag!r}")
    argv = args[1:]
    if probe:
        # Exit 0 when a private /tmp works here, 1 when not; runs nothing.
        os._exit(0 if private_tmp(0) else 1)
    if not argv:
        _fail("no command")
    if netns:
        try:
            join_netns(netns)
        except OSError as exc:
            _fail(f"cannot join network namespace {netns}: {exc.strerror or exc}")
    pid = str(os.getpid())
    for path in procs:
        try:
            with open(path, "w") as f:
                f.write(pid)
        except OSError as exc:
            _fail(f"cannot join cgroup {os.path.dirname(path)}: {exc.strerror}")
    if tmp:
        try:
            private_tmp(tmp_size, keep)
        except OSError as exc:
            _fail(f"cannot keep a volume under /tmp visible: {exc.strerror or exc}")
    if readonly:
        try:
            read_only(readonly)
        except OSError as exc:
            _fail(f"cannot make a volume read-only: {exc.strerror or exc}")
    if uid is not None and gid is not None:
        try:
            drop_privileges(uid, gid)
        except OSError as exc:
            _fail(f"cannot switch to uid {uid} gid {gid}: {exc.strerror or exc}")
    try:
        os.execv(argv[0], argv)
    except FileNotFoundError:
        _fail(f"command {argv[0]!r} not found", EXIT_NOT_FOUND)
    except OSError as exc:
        _fail(f"cannot run {argv[0]!r}: {exc.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
