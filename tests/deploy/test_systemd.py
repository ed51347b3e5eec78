"""systemd, booted for real: the install guide (deploy/systemd/README.md) run word for word in a
Debian 12 root booted with systemd-nspawn, then the units driven as an operator would.

The guide's fenced blocks marked `<!-- tested: NAME -->` are what runs, with the default ports
swapped for free ones (nspawn shares this machine's network). `/usr/local/src/orka` is this
checkout, copied in; pip reaches the index through the host's pip configuration, already in the
root, and keeps its wheel cache between runs.

This machine's PID 1 is not systemd and its cgroups are v1 with a named `systemd` hierarchy
(hybrid): `systemd-nspawn -b --register=no --keep-unit` boots systemd 252 there as is, with no
SYSTEMD_NSPAWN_UNIFIED_HIERARCHY or --property; nspawn's child is the container's PID 1, which
`nsenter -t PID -a` joins to run systemctl.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.debian_rootfs import cache_dir, copy_rootfs, debian_rootfs, missing_tools

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "deploy" / "systemd" / "README.md"
PACKAGES = [
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-venv",
    "python3-pip",
    "ca-certificates",
    "procps",
]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
UNITS = ["orka-scheduler", "orka-controller", "orka-agent", "orka-agent@node-2"]

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="booting a container needs root"),
    pytest.mark.skipif(
        bool(missing_tools()) or shutil.which("systemd-nspawn") is None,
        reason="needs debootstrap and systemd-nspawn (systemd-container)",
    ),
]


def guide_block(name: str) -> str:
    match = re.search(
        rf"<!-- tested: {re.escape(name)} -->\n```sh\n(.*?)```", GUIDE.read_text(), re.DOTALL
    )
    assert match, f"{GUIDE}: no block marked <!-- tested: {name} -->"
    return match.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)


class Machine:
    """A Debian root booted by systemd-nspawn; commands run inside with nsenter."""

    def __init__(self, root: Path, log: Path) -> None:
        self.root = root
        self.log = log.open("wb")
        self.nspawn = subprocess.Popen(
            ["systemd-nspawn", "-b", "--register=no", "--keep-unit", "-D", str(root)],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.leader = wait_for("the container's init", self._init_pid)

    def _init_pid(self) -> int | None:
        """nspawn's child that runs systemd: PID 1 inside, the target of nsenter."""
        try:
            children = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children")
            for pid in children.read_text().split():
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return int(pid)
        except OSError:
            pass
        assert self.nspawn.poll() is None, f"systemd-nspawn exited; see {self.log.name}"
        return None

    def run(
        self, script: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-a", "bash", "-euo", "pipefail", "-c", script],
            env={"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8"},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"in the container: {script!r} exited {result.returncode}\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def out(self, script: str) -> str:
        return self.run(script).stdout.strip()

    def show(self, unit: str, prop: str) -> str:
        return self.out(f"systemctl show -p {prop} --value {unit}")

    def orka_json(self, *args: str) -> Any:
        return json.loads(self.out(f"orka {' '.join(args)} -o json"))

    def close(self) -> None:
        if self.nspawn.poll() is None:
            self.nspawn.send_signal(signal.SIGTERM)  # nspawn -b: a clean poweroff inside
            try:
                self.nspawn.wait(30)
            except subprocess.TimeoutExpired:
                self.nspawn.kill()
                self.nspawn.wait()
        self.log.close()


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Machine]:
    base = debian_rootfs("systemd", PACKAGES)
    root = copy_rootfs(base, tmp_path / "root")
    # The checkout, as the guide expects it (what git tracks or would, not .venv or caches).
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    src = root / "usr/local/src/orka"
    for name in filter(None, (f.decode() for f in files)):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    pip_cache = cache_dir() / "systemd-pip-cache"
    if pip_cache.is_dir():
        shutil.copytree(pip_cache, root / "root/.cache/pip", dirs_exist_ok=True)
    m = Machine(root, tmp_path / "console.log")
    try:
        # Until systemd inside listens, systemctl cannot even ask (and prints nothing).
        wait_for(
            "the container's boot",
            lambda: (
                m.run("systemctl is-system-running --wait", check=False).stdout.strip()
                in ("running", "degraded")
            ),
            timeout=60,
        )
        yield m
    finally:
        m.close()
        if (root / "root/.cache/pip").is_dir():
            shutil.copytree(root / "root/.cache/pip", pip_cache, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


def grpc_call(machine: Machine, port: int, role: str, call: Callable[[Any], Any]) -> Any:
    """One call from this machine (nspawn shares its network) over mutual TLS, with the admin
    certificate the guide put in /etc/orka/certs: no CLI start-up between a `systemctl start`
    returning and the question. Returns `error: ...` when refused or unavailable."""
    import asyncio

    from orka.rpc.client import secure_channel
    from orka.security.tls import TlsFiles

    certs = machine.root / "etc/orka/certs"
    tls = TlsFiles(ca=certs / "ca.crt", cert=certs / "admin.crt", key=certs / "admin.key")

    async def run() -> Any:
        async with secure_channel(f"127.0.0.1:{port}", tls, role) as channel:
            return await call(channel)

    try:
        return asyncio.run(run())
    except Exception as e:
        return f"error: {e!r}"[:300]


def health(machine: Machine, port: int, role: str, service: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def check(channel: Any) -> str:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    return grpc_call(machine, port, role, check)


def api_nodes(machine: Machine, port: int) -> Any:
    """The controller's ListNodes: {name: state}."""
    from orka.api import controller_pb2 as pb
    from orka.api import controller_pb2_grpc as pb_grpc

    async def list_nodes(channel: Any) -> dict[str, str]:
        reply = await pb_grpc.ControllerStub(channel).ListNodes(pb.ListNodesRequest(), timeout=5)
        return {n.name: pb.Node.State.Name(n.state) for n in reply.nodes}

    return grpc_call(machine, port, "controller", list_nodes)


def nodes(machine: Machine) -> dict[str, tuple[str, bool]]:
    return {n["name"]: (n["state"], n["schedulable"]) for n in machine.orka_json("get", "nodes")}


def placement(machine: Machine) -> dict[str, tuple[str, str]]:
    return {
        i["name"]: (i["phase"], i["node"])
        for i in machine.orka_json("get", "instances")
        if i["workload"] == "sleeper"
    }


def sleep_pids(machine: Machine) -> set[int]:
    out = machine.run("pgrep -x sleep", check=False).stdout
    return {int(p) for p in out.split()}


def test_systemd_install_start_drain_restart_poweroff(machine: Machine) -> None:
    figures: dict[str, float] = {}
    controller_port, scheduler_port = free_port(), free_port()

    def ported(text: str) -> str:
        return text.replace("7443", str(controller_port)).replace("7444", str(scheduler_port))

    # ---- the install block, word for word (ports aside) ----
    t0 = time.monotonic()
    machine.run(ported(guide_block("install")), timeout=600)
    figures["install"] = time.monotonic() - t0
    link = machine.root / "usr/local/bin/orka"
    assert os.readlink(link) == "/opt/orka/bin/orka"  # a link into the venv, not a loop
    for unit in ("orka-controller", "orka-scheduler", "orka-agent", "orka-agent@"):
        out = machine.run(f"systemd-analyze verify /etc/systemd/system/{unit}.service", check=False)
        assert (out.returncode, out.stdout + out.stderr) == (0, ""), unit

    # ---- start: each `systemctl enable --now` returns once its service serves ----
    checks: dict[str, Callable[[], Any]] = {
        "orka-scheduler": lambda: health(machine, scheduler_port, "scheduler", "orka.v1.Scheduler"),
        "orka-controller": lambda: health(
            machine, controller_port, "controller", "orka.v1.Controller"
        ),
        # The agent is started once it registered with the scheduler; the controller hears of
        # the node from the scheduler's feed a moment later: its first view of it is awaited.
        "orka-agent": lambda: wait_for(
            "node-1 in the controller", lambda: api_nodes(machine, controller_port), timeout=5.0
        ),
    }
    expected = {
        "orka-scheduler": "SERVING",
        "orka-controller": "SERVING",
        "orka-agent": {"node-1": "READY"},
    }
    for line in ported(guide_block("start")).splitlines():
        unit = line.removeprefix("systemctl enable --now ")
        t0 = time.monotonic()
        out = machine.run(line)
        if unit in checks:
            figures[f"start {unit}"] = time.monotonic() - t0
            assert checks[unit]() == expected[unit], f"{unit} not serving once started"
        else:  # `orka get nodes`, without flags: /etc/orka/cli.env
            assert re.search(r"^node-1\s+READY", out.stdout, re.MULTILINE), out.stdout
    status = {u: machine.show(u, "StatusText") for u in checks}
    assert status == {
        "orka-scheduler": f"serving agents on port {scheduler_port}",
        "orka-controller": f"serving the API on port {controller_port}, leading",
        "orka-agent": "registered with the scheduler as node node-1",
    }
    # Hardened: the control plane runs as orka, without capabilities.
    for unit in ("orka-scheduler", "orka-controller"):
        pid = machine.show(unit, "MainPID")
        assert machine.out(f"ps -o user= -p {pid}") == "orka"
        assert machine.out(f"grep CapEff /proc/{pid}/status").split()[1] == "0" * 16

    # ---- a second agent, as the guide's template unit ----
    t0 = time.monotonic()
    machine.run(ported(guide_block("second-agent")))
    figures["start orka-agent@node-2"] = time.monotonic() - t0
    assert api_nodes(machine, controller_port) == {"node-1": "READY", "node-2": "READY"}

    # ---- the watchdog: pinged from the event loop; a wedged loop is restarted ----
    # (the controller: a restart leaves the agents' sessions with the scheduler alone)
    machine.run(
        "mkdir -p /etc/systemd/system/orka-controller.service.d\n"
        "printf '[Service]\\nWatchdogSec=2s\\n' "
        "> /etc/systemd/system/orka-controller.service.d/watchdog.conf\n"
        "systemctl daemon-reload\nsystemctl restart orka-controller"
    )
    pid = machine.show("orka-controller", "MainPID")
    pings = [int(machine.show("orka-controller", "WatchdogTimestampMonotonic"))]
    # Longer than WatchdogSec: alive all along (the same process) and pinging meanwhile.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        time.sleep(0.5)
        assert machine.show("orka-controller", "MainPID") == pid, "killed by the watchdog"
        pings.append(int(machine.show("orka-controller", "WatchdogTimestampMonotonic")))
    assert len(set(pings)) >= 3, pings
    wedged = pid
    machine.run(f"kill -STOP {wedged}")  # the loop stops turning
    wait_for(
        "the wedged controller restarted",
        lambda: (
            machine.show("orka-controller", "MainPID") not in ("0", wedged)
            and machine.show("orka-controller", "ActiveState") == "active"
        ),
        timeout=20,
    )
    assert "Watchdog timeout" in machine.out("journalctl -q -u orka-controller")
    assert health(machine, controller_port, "controller", "orka.v1.Controller") == "SERVING"

    # ---- a workload spread over both ----
    machine.run(
        "cat > /root/sleeper.yaml <<'EOF'\n"
        "name: sleeper\nkind: process\ncommand: [sleep, '3600']\nreplicas: 2\n"
        "resources: {cpu: 50m, memory: 16Mi}\n"
        "EOF\n"
        "orka apply -f /root/sleeper.yaml --wait"
    )
    seen: list[dict[str, tuple[str, str]]] = [{}]

    def spread() -> dict[str, tuple[str, str]] | None:
        seen[0] = placement(machine)
        one_each = [("RUNNING", "node-1"), ("RUNNING", "node-2")]
        return seen[0] if sorted(seen[0].values()) == one_each else None

    try:
        before = wait_for("2 RUNNING instances, one per node", spread)
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen {seen[0]}, nodes {nodes(machine)}") from None
    pids = wait_for("two sleep processes", lambda: len(s := sleep_pids(machine)) == 2 and s)

    # ---- SIGKILL of an agent: systemd restarts it, it re-adopts its instance ----
    main_pid = machine.show("orka-agent", "MainPID")
    machine.run(f"kill -KILL {main_pid}")
    wait_for(
        "orka-agent restarted",
        lambda: (
            machine.show("orka-agent", "NRestarts") == "1"
            and machine.show("orka-agent", "ActiveState") == "active"
        ),
    )
    assert machine.show("orka-agent", "MainPID") != main_pid
    assert sleep_pids(machine) == pids  # the very processes, still running
    assert placement(machine) == before  # adopted: no replacement, no restart

    # ---- stop one agent: its instance moves to the other ----
    t0 = time.monotonic()
    machine.run("systemctl stop orka-agent")
    figures["stop orka-agent (drain)"] = time.monotonic() - t0
    after = placement(machine)
    running = sorted(v for v in after.values() if v[0] == "RUNNING")
    assert running == [("RUNNING", "node-2"), ("RUNNING", "node-2")], after

    # ---- poweroff, the last agent still holding both instances ----
    t0 = time.monotonic()
    machine.run("systemctl poweroff", check=False)
    machine.nspawn.wait(120)
    figures["poweroff"] = time.monotonic() - t0
    print("systemd figures:", {k: round(v, 2) for k, v in figures.items()})
    assert figures["poweroff"] < 10, figures
