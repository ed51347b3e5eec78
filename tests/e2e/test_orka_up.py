"""End to end: `orka up` and the README tour, run as a user would, each command its own process.

`orka up` runs a scheduler, a controller and two agents as child processes on free loopback
ports with a temporary data dir; the client commands (`orka apply`, `get`, `describe`) and
grpcurl are separate processes too. The test walks the tour: apply, an unschedulable workload,
losing a node with `kill -9`, Ctrl-C (nothing may be left running, not even the instances of the
killed agent), and a second `orka up` that resumes the same cluster; on the way it runs the
README's grpcurl lines as the README writes them. A second test ends `orka up` with SIGHUP,
SIGTERM and SIGKILL in turn (nothing of the cluster may be left 10 s later) and covers a data dir
already taken, a held port, and the survivors of an earlier run.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import re
import shlex
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from cryptography import x509

from orka.cli.up import host_port_range
from orka.runtime.network import host_unavailable
from orka.runtime.volume_ext4 import Ext4Backend
from orka.security.issue import init_certs, issue_cert
from orka.security.tls import due_for_renewal
from tests.e2e.procs import free_port
from tests.integration.cluster import eventually
from tests.integration.test_grpcurl import Result, _json_stream
from tests.netenv import scrub_agent
from tests.ports import http_get

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GRPCURL = Path(sys.executable).parent / "grpcurl"
UP_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
COMMAND_TIMEOUT = 30.0
AGENT_LINE = re.compile(r"^\s+(node-\d+)\s+pid\s+(\d+)\s", re.MULTILINE)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without the user's ORKA_* settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORKA_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _belongs(proc: psutil.Process, data_dir: str) -> bool:
    """A service of this cluster (named in its argv) or a workload process (cwd in its task dir)."""
    try:
        if any(data_dir in arg for arg in proc.cmdline()):
            return True
        return _under(proc.cwd(), data_dir)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def cluster_processes(data_dir: Path) -> list[psutil.Process]:
    """Every live process that belongs to the cluster in `data_dir`."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.info["pid"] == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if _belongs(proc, str(data_dir)):
            found.append(proc)
    return found


def workload_processes(workload: str, data_dir: Path, instances: set[str]) -> list[str]:
    """`pid name instance` of each live process with ORKA_WORKLOAD=`workload` from this cluster.

    The `hello` example runs `sh -c '... sleep 5'`, so both the shell and its `sleep` count. A
    process is ours when it runs in a task dir under `data_dir` or names one of our instances.
    """
    found = []
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
            if env.get("ORKA_WORKLOAD") != workload:
                continue
            ours = env.get("ORKA_INSTANCE") in instances or _under(proc.cwd(), str(data_dir))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if ours:
            found.append(f"{proc.info['pid']} {proc.info['name']} {env.get('ORKA_INSTANCE')}")
    return found


def kill_cluster(data_dir: Path) -> list[str]:
    """SIGKILL whatever of the cluster is still running; what was killed, for the report."""
    killed = []
    for proc in cluster_processes(data_dir):
        try:
            killed.append(f"{proc.pid} {proc.name()} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return killed


class Up:
    """One `orka up` run in its own session, its stdout and stderr in a file."""

    def __init__(self, data_dir: Path, out: Path, controller_port: int, scheduler_port: int):
        self.data_dir = data_dir
        self.out = out
        self.controller_port = controller_port
        self.scheduler_port = scheduler_port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "orka.cli.main",
                    "up",
                    "--data-dir",
                    str(self.data_dir),
                    "--controller-listen",
                    f"127.0.0.1:{self.controller_port}",
                    "--scheduler-listen",
                    f"127.0.0.1:{self.scheduler_port}",
                    "--agents",
                    "2",
                ],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=_clean_env(),
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    async def wait_up(self, timeout: float = UP_TIMEOUT) -> dict[str, int]:
        """Until stdout says the cluster is up; the agent pids it printed, by node name."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.output()
            if "Orka is up" in text and "Ctrl-C stops the cluster" in text:
                return {name: int(pid) for name, pid in AGENT_LINE.findall(text)}
            rc = self.proc.poll()
            assert rc is None, f"orka up exited with {rc} before it was up:\n{text}"
            await asyncio.sleep(0.1)
        raise AssertionError(f"orka up did not say it was up within {timeout}s:\n{self.output()}")

    async def interrupt(self, timeout: float = STOP_TIMEOUT) -> tuple[int, float]:
        """Ctrl-C: SIGINT to `orka up` alone; its exit code and how long it took to exit."""
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        deadline = started + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"orka up did not exit within {timeout}s of SIGINT:\n{self.output()}"
                )
            await asyncio.sleep(0.1)
        return self.proc.returncode, time.monotonic() - started

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


class Tour:
    """The state of one test: the data dir, the ports, every `orka up` run and the client env."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.data_dir = (tmp_path / "orka").resolve()
        self.controller_port = free_port()
        self.scheduler_port = free_port()
        while self.scheduler_port == self.controller_port:
            self.scheduler_port = free_port()
        self.runs: list[Up] = []
        self.seen_instances: set[str] = set()
        self.env = _clean_env(
            ORKA_CONTROLLER=f"127.0.0.1:{self.controller_port}",
            ORKA_DATA_DIR=str(self.data_dir),
        )

    def up(self) -> Up:
        run = Up(
            self.data_dir,
            self.tmp / f"up-{len(self.runs) + 1}.out",
            self.controller_port,
            self.scheduler_port,
        )
        self.runs.append(run)
        run.start()
        return run

    async def run(
        self, *argv: str, timeout: float = COMMAND_TIMEOUT, env: dict[str, str] | None = None
    ) -> tuple[int, str, str]:
        """One command as its own process; exit code, stdout, stderr."""
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=ROOT,
            env=self.env if env is None else env,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"{argv} did not finish within {timeout}s") from None
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    async def orka(self, *args: str, timeout: float = COMMAND_TIMEOUT) -> str:
        """`orka ARGS`, which must exit 0; its stdout."""
        rc, out, err = await self.run(sys.executable, "-m", "orka.cli.main", *args, timeout=timeout)
        assert rc == 0, f"orka {' '.join(args)} exited {rc}\nstdout:\n{out}\nstderr:\n{err}"
        return out

    async def json(self, *args: str) -> Any:
        return json.loads(await self.orka(*args, "-o", "json"))

    async def instances(self, workload: str) -> list[dict[str, Any]]:
        found = [i for i in await self.json("get", "instances") if i["workload"] == workload]
        self.seen_instances.update(i["name"] for i in found)
        return found

    async def running(self, workload: str) -> list[dict[str, Any]]:
        return [i for i in await self.instances(workload) if i["phase"] == "RUNNING"]

    async def nodes(self) -> dict[str, str]:
        return {n["name"]: n["state"] for n in await self.json("get", "nodes")}

    def hello_processes(self) -> list[str]:
        return workload_processes("hello", self.data_dir, self.seen_instances)

    def report(self) -> str:
        parts = []
        for i, run in enumerate(self.runs, 1):
            parts.append(f"==== orka up #{i} stdout\n{run.output()}")
        logs = self.data_dir / "logs"
        if logs.is_dir():
            for log in sorted(logs.glob("*.log")):
                tail = log.read_text(errors="replace").splitlines()[-30:]
                parts.append(f"==== {log.name} (last 30 lines)\n" + "\n".join(tail))
        return "\n".join(parts)


async def day2_tour(tour: Tour, instances: list[str]) -> None:
    """The README's day-2 lines on the web workload: logs, exec, a rollout, a release that
    rolls itself back, and the activity that says so."""
    first = instances[0]
    # Logs: the health checks' GETs, each replica's lines prefixed with its name.
    # (http.server writes its request log to stderr: `orka logs` prints it on its own stderr.)
    rc, out, logs = await tour.run(
        sys.executable, "-m", "orka.cli.main", "logs", "web", "--tail", "2"
    )
    got = {line.split("] ", 1)[0].lstrip("[") for line in logs.splitlines() if line}
    assert (rc, out) == (0, "") and got == set(instances), (rc, out, logs)
    lines = logs.splitlines()
    assert len(lines) == 4 and all('"GET /' in line for line in lines), logs
    for name in instances:  # its agent's health check, in its own log
        assert f"[{name}] 127.0.0.1 - - " in logs and '"GET /index.html HTTP/1.0" 200' in logs
    rc, out, err = await tour.run(
        sys.executable, "-m", "orka.cli.main", "exec", first, "--", "sh", "-c",
        "cat index.html; exit 3",
    )  # fmt: skip
    assert (rc, out.strip()) == (3, f"hello from {first}"), (rc, out, err)

    # A good release rolls out; every replica answers with the new page.
    await tour.orka("apply", "-f", str(EXAMPLES / "web-v2.yaml"), "--wait", timeout=90)
    v2 = await tour.running("web")
    assert len(v2) == 2 and not {i["name"] for i in v2} & set(instances), v2
    for inst in v2:
        port = inst["ports"][0]["host_port"]
        body = (await asyncio.to_thread(http_get, "127.0.0.1", port))[1]
        assert body.decode().strip() == f"hello v2 from {inst['name']}"

    # A broken one: apply --wait fails, and the rollout goes back to revision 2's spec.
    rc, out, err = await tour.run(
        sys.executable, "-m", "orka.cli.main", "apply", "-f",
        str(EXAMPLES / "web-broken.yaml"), "--wait", timeout=90,
    )  # fmt: skip
    assert rc == 1 and "revision 3 failed and is being rolled back" in out + err, (out, err)
    # The rollback's own rollout finishes: revision 4, running revision 2's spec.
    status = await _soon(lambda: _status_when(tour, "ROLLED_BACK"), timeout=60)
    history = await tour.json("rollout", "history", "web")
    assert [r["revision"] for r in history] == [1, 2, 3, 4], history
    assert status["rollout"]["revision"] == 4, status
    assert status["spec"]["command"] == history[1]["command"] == history[3]["command"], status
    described = await tour.orka("describe", "workload", "web")
    assert re.search(r"Warning\s+RollingBack\s+revision 3 failed; revision 4 rolls back", described)
    assert re.search(r"Warning\s+RolledBack\s+revision 4: rolled back", described), described
    running = await tour.running("web")
    assert {i["name"] for i in running} == {i["name"] for i in v2}, running  # kept, not restarted


async def stateful_tour(tour: Tour) -> None:
    """The README's volume lines: counter.yaml's instance appends a line per start to a file on
    its volume and prints the file; deleted and applied again, it lands on the volume's node
    and prints both starts; --with-volumes removes the volume too."""

    async def volumes() -> dict[str, list[str]]:
        table = await tour.orka("get", "volumes")
        return {row.split()[0]: row.split()[1:] for row in table.splitlines()[1:] if row}

    await tour.orka("apply", "-f", str(EXAMPLES / "counter.yaml"), "--wait", timeout=60)
    (first,) = await tour.running("counter")
    # NAME SIZE STATE NODE BACKEND ATTACHED
    attached = ["64Mi", "ATTACHED", first["node"], "ext4", first["name"]]

    async def in_use() -> bool:
        return (await volumes()).get("counter-data") == attached

    await _soon(in_use, timeout=20)
    await tour.orka("delete", "workload", "counter", "--wait", timeout=60)

    async def available() -> list[str] | None:
        row = (await volumes()).get("counter-data")
        return row if row and row[1] == "AVAILABLE" else None

    assert (await _soon(available, timeout=20))[2] == first["node"]
    await tour.orka("apply", "-f", str(EXAMPLES / "counter.yaml"), "--wait", timeout=60)
    (second,) = await tour.running("counter")
    assert second["node"] == first["node"] and second["name"] != first["name"]

    async def both_starts() -> str | None:
        out = await tour.orka("logs", second["name"])
        lines = [line for line in out.splitlines() if line.startswith("started ")]
        want = [f"started {first['name']}", f"started {second['name']}"]
        return out if lines == want else None

    await _soon(both_starts, timeout=20)
    pools = (await tour.orka("get", "pools")).splitlines()
    assert pools[0].split()[:3] == ["POOL", "NODES", "READY"], pools
    assert pools[1].split()[:3] == ["default", "2", "2"], pools
    await tour.orka("delete", "workload", "counter", "--with-volumes", "--wait", timeout=60)

    async def volume_gone() -> bool:
        return "counter-data" not in await volumes()

    await _soon(volume_gone, timeout=30)


async def _status_when(tour: Tour, state: str) -> dict[str, Any] | None:
    w = await tour.json("get", "workload", "web")
    w = w[0] if isinstance(w, list) else w
    return w if w.get("rollout", {}).get("state") == state else None


async def _soon(check: Any, timeout: float) -> Any:
    """`eventually` for checks that run the CLI: a failed command is just 'not yet'."""

    failures: list[str] = []

    async def attempt() -> Any:
        try:
            return await check()
        except AssertionError as e:
            failures.append(str(e))
            return None

    try:
        return await eventually(attempt, timeout=timeout, interval=0.3)
    except AssertionError as e:
        last = failures[-1] if failures else "none"
        raise AssertionError(f"{e}\nlast command failure: {last}") from None


@pytest.fixture
def tour(tmp_path: Path) -> Iterator[Tour]:
    t = Tour(tmp_path)
    failed = True
    try:
        yield t
        failed = False
    finally:
        for run in t.runs:
            run.kill()
        leftovers = kill_cluster(t.data_dir)
        # An agent killed with SIGKILL (step 4) leaves its bridge and its localhost guard.
        for node in ("node-1", "node-2"):
            scrub_agent(node, t.data_dir / "agents" / node)
        hello = t.hello_processes()
        for line in hello:
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if failed or leftovers or hello:
            print(t.report())
            print("teardown killed:", leftovers, hello)


def service_certs(up: Up) -> dict[str, str]:
    """The `--certs` each service child of `orka up` was started with, by service name."""
    assert up.proc is not None
    found = {}
    for child in psutil.Process(up.proc.pid).children(recursive=True):
        argv = child.cmdline()
        if "orka.cli.main" not in argv or "--certs" not in argv:
            continue
        command = argv[argv.index("orka.cli.main") + 1]
        name = argv[argv.index("--name") + 1] if "--name" in argv else command
        found[name] = argv[argv.index("--certs") + 1]
    return found


def check_least_privilege(certs: Path, up: Up) -> None:
    """Each service was handed only its own folder, holding only ca.crt and its own pair."""
    stems = {"scheduler": "scheduler", "controller": "controller"}
    stems |= {n: f"agent-{n}" for n in ("node-1", "node-2")}
    assert service_certs(up) == {n: str(certs / stem) for n, stem in stems.items()}
    for stem in stems.values():
        folder = certs / stem
        assert {p.name for p in folder.iterdir()} == {"ca.crt", f"{stem}.crt", f"{stem}.key"}
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / f"{stem}.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    assert (certs / "ca" / "ca.key").is_file() and not (certs / "ca.key").exists()


async def test_orka_up_tour(tour: Tour) -> None:
    timings: dict[str, float] = {}
    t0 = time.monotonic()

    # 1. `orka up` comes up and prints each agent's pid.
    up = tour.up()
    pids = await up.wait_up()
    timings["up"] = time.monotonic() - t0
    assert sorted(pids) == ["node-1", "node-2"], up.output()
    assert all(psutil.pid_exists(p) for p in pids.values()), pids
    check_least_privilege(tour.data_dir / "certs", up)

    # 2. The tour's first commands.
    t = time.monotonic()
    out = await tour.orka("apply", "-f", str(EXAMPLES / "hello.yaml"), "--wait", timeout=60)
    assert "hello" in out
    running = await tour.running("hello")
    assert len(running) == 3, running
    nodes_table = await tour.orka("get", "nodes")
    rows = {line.split()[0]: line.split()[1] for line in nodes_table.splitlines()[1:] if line}
    assert rows.get("node-1") == "READY" and rows.get("node-2") == "READY", nodes_table
    timings["apply hello --wait"] = time.monotonic() - t

    # 2b. A web workload, reached where `orka get endpoints` says it answers.
    t = time.monotonic()
    await tour.orka("apply", "-f", str(EXAMPLES / "web.yaml"), "--wait", timeout=60)
    table = await tour.orka("get", "endpoints", "web")
    header, *rows = table.splitlines()
    assert header.split() == ["INSTANCE", "NODE", "ADDRESS", "HOST", "IP", "PORTS"], table
    web = {i["name"]: i for i in await tour.running("web")}
    assert len(rows) == 2 and {r.split()[0] for r in rows} == set(web), table
    for row in rows:
        instance, node, _, host_ip, port = row.split()
        # node-1 picks from the first agent's slice, node-2 from the second's.
        first = int(host_port_range(int(node.removeprefix("node-")) - 1).split("-")[0])
        assert host_ip == "127.0.0.1" and first <= int(port) < first + 200, table

        async def answers(p: int = int(port)) -> bytes | None:
            try:
                return (await asyncio.to_thread(http_get, "127.0.0.1", p))[1]
            except OSError:
                return None

        assert (await _soon(answers, timeout=20)).decode().strip() == f"hello from {instance}"
    timings["apply web --wait -> answers at its endpoints"] = time.monotonic() - t
    t = time.monotonic()
    await day2_tour(tour, sorted(web))
    await tour.orka("delete", "workload", "web", "--wait", timeout=60)
    timings["day-2: logs, exec, rollout, automatic rollback"] = time.monotonic() - t

    # 2c. The same with network: bridge: an address of its own, and a host port mapped to it.
    if host_unavailable() is None:
        t = time.monotonic()
        await tour.orka("apply", "-f", str(EXAMPLES / "web-bridge.yaml"), "--wait", timeout=60)
        table = await tour.orka("get", "endpoints", "web-bridge")
        rows = table.splitlines()[1:]
        assert len(rows) == 2, table
        for row in rows:
            instance, _, address, host_ip, port = row.split()
            host_port, _, inner = port.partition("->")
            assert inner == "8080" and host_ip == "127.0.0.1", table
            assert ipaddress.ip_address(address).is_private, table
            for host, p in ((address, 8080), ("127.0.0.1", int(host_port))):

                async def bridged(h: str = host, n: int = p) -> bytes | None:
                    try:
                        return (await asyncio.to_thread(http_get, h, n))[1]
                    except OSError:
                        return None

                body = await _soon(bridged, timeout=20)
                assert body.decode().strip() == f"hello from {instance}", (host, p)
        await tour.orka("delete", "workload", "web-bridge", "--wait", timeout=60)
        timings["apply web-bridge --wait -> answers at address and host port"] = (
            time.monotonic() - t
        )

    # 2d. A volume keeps its data across its workload's delete and re-create (ext4: root).
    if Ext4Backend(Path("/")).unavailable() is None:
        t = time.monotonic()
        await stateful_tour(tour)
        timings["counter: data kept across delete and re-create"] = time.monotonic() - t

    # 3. A workload that does not fit, and why.
    t = time.monotonic()
    await tour.orka("apply", "-f", str(EXAMPLES / "too-big.yaml"))

    async def unschedulable() -> str | None:
        text = await tour.orka("describe", "workload", "too-big")
        section = text.split("Unschedulable:", 1)
        if len(section) == 2 and re.search(r"^\s+2 nodes: cpu request exceeds", section[1], re.M):
            return text
        return None

    await _soon(unschedulable, timeout=20)
    timings["too-big unschedulable"] = time.monotonic() - t

    # 4. Lose node-1 the hard way; its instances come back on node-2.
    t = time.monotonic()
    os.kill(pids["node-1"], signal.SIGKILL)

    async def healed() -> list[dict[str, Any]] | None:
        running = await tour.running("hello")
        if len(running) == 3 and {i["node"] for i in running} == {"node-2"}:
            return running
        return None

    async def node_lost() -> dict[str, str] | None:
        nodes = await tour.nodes()
        return nodes if nodes.get("node-1") == "LOST" else None

    await _soon(healed, timeout=30)
    nodes = await _soon(node_lost, timeout=10)
    assert nodes["node-2"] == "READY", nodes
    timings["kill -9 node-1 -> healed on node-2"] = time.monotonic() - t

    # 5. The README's grpcurl lines, word for word but for the address and the certs dir.
    t = time.monotonic()
    await check_readme_grpcurl(tour)
    timings["README grpcurl lines"] = time.monotonic() - t

    # 6. Ctrl-C: `orka up` exits 0 and leaves nothing running, not even what node-1 left behind.
    # Instances outlive an agent crash (a restarted agent re-adopts them), so node-1's LOST
    # instances still run: `orka up` has to stop them itself when it ends the cluster.
    lost = {i["name"] for i in await tour.instances("hello") if i["node"] == "node-1"}
    assert lost, "node-1 had hello instances before it was killed"
    orphans = [p for p in tour.hello_processes() if p.split()[2] in lost]
    assert orphans, f"expected the orphans of node-1 ({lost}) to be alive before Ctrl-C"
    rc, took = await up.interrupt()
    timings["SIGINT #1 -> exit"] = took
    assert rc == 0, f"orka up exited {rc} on SIGINT:\n{up.output()}"
    await asyncio.sleep(0.5)  # processes signalled at the very end may still be dying
    left = [f"{p.pid} {' '.join(p.cmdline())[:160]}" for p in cluster_processes(tour.data_dir)]
    assert not left, f"processes of the cluster still running after orka up exited: {left}"
    hello_after = tour.hello_processes()
    assert not hello_after, f"hello processes still running after orka up exited: {hello_after}"

    # 7. `orka up` again on the same data dir resumes the cluster.
    t = time.monotonic()
    up2 = tour.up()
    pids2 = await up2.wait_up()
    timings["up again"] = time.monotonic() - t
    assert sorted(pids2) == ["node-1", "node-2"], up2.output()
    workloads = {w["spec"]["name"] for w in await tour.json("get", "workloads")}
    assert {"hello", "too-big"} <= workloads, workloads
    table = await tour.orka("get", "workloads")
    assert re.search(r"^hello\s", table, re.M) and re.search(r"^too-big\s", table, re.M), table

    async def three_running() -> list[dict[str, Any]] | None:
        running = await tour.running("hello")
        return running if len(running) == 3 else None

    await _soon(three_running, timeout=30)
    timings["resume -> hello 3 RUNNING"] = time.monotonic() - t

    rc, took = await up2.interrupt()
    timings["SIGINT #2 -> exit"] = took
    assert rc == 0, f"orka up exited {rc} on the second SIGINT:\n{up2.output()}"
    await asyncio.sleep(0.5)
    assert not cluster_processes(tour.data_dir)
    assert not tour.hello_processes()

    timings["total"] = time.monotonic() - t0
    print("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))


def _serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


async def test_orka_up_certs_lifecycle_flat_dir_renewal_live_rotation_and_revocation(
    tour: Tour,
) -> None:
    # A data dir from before the split: every pair and the CA key flat in certs/, 0755; and
    # node-1's certificate 5 days from expiry.
    certs = tour.data_dir / "certs"
    init_certs(certs, ["node-1", "node-2"])
    end = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=5)
    issue_cert(
        certs,
        "agent",
        "node-1",
        not_valid_before=end - datetime.timedelta(days=90),
        not_valid_after=end,
    )
    for p in sorted(certs.rglob("*")):
        if p.is_file() and p.parent != certs:
            if p.name == "ca.crt":
                p.unlink()
            else:
                p.rename(certs / p.name)
    for p in list(certs.iterdir()):
        if p.is_dir():
            p.rmdir()
    certs.chmod(0o755)
    ca = (certs / "ca.crt").read_bytes()
    kept = {stem: _serial(certs / f"{stem}.crt") for stem in ("controller", "agent-node-2")}
    expiring = _serial(certs / "agent-node-1.crt")

    up = tour.up()
    await up.wait_up()
    check_least_privilege(certs, up)
    assert (certs / "ca.crt").read_bytes() == ca  # the same CA: nothing issued is invalidated
    for stem, serial in kept.items():
        assert _serial(certs / stem / f"{stem}.crt") == serial
    renewed = certs / "agent-node-1" / "agent-node-1.crt"
    assert _serial(renewed) != expiring
    assert not due_for_renewal(x509.load_pem_x509_certificate(renewed.read_bytes()))
    assert "re-issued 1 certificate(s) due for renewal" in up.output()
    assert (await tour.nodes()) == {"node-1": "READY", "node-2": "READY"}

    # Rotate every certificate while the cluster runs: no restart, no stream dropped.
    registered = {n: _count(tour, n, '"registered"') for n in ("node-1", "node-2")}
    old_serial = _serial(certs / "controller" / "controller.crt")
    await tour.orka("certs", "rotate", "--dir", str(certs), "--all")
    new_serial = _serial(certs / "controller" / "controller.crt")
    assert new_serial != old_serial
    served = await asyncio.to_thread(served_serial, tour.controller_port, certs)
    assert served == new_serial
    assert (await tour.nodes()) == {"node-1": "READY", "node-2": "READY"}  # new admin cert
    assert {n: _count(tour, n, '"registered"') for n in registered} == registered

    # A second admin, then revoked: refused within the services' reload interval (5 s).
    await tour.orka("certs", "issue", "--dir", str(certs), "--role", "admin", "--name", "eve")
    eve = [
        str(GRPCURL),
        "-cacert",
        str(certs / "ca.crt"),
        "-cert",
        str(certs / "admin-eve.crt"),
        "-key",
        str(certs / "admin-eve.key"),
        f"127.0.0.1:{tour.controller_port}",
        "orka.v1.Controller/ListNodes",
    ]
    rc, _, err = await tour.run(*eve)
    assert rc == 0, err
    await tour.orka("certs", "revoke", "--dir", str(certs), "--role", "admin", "--name", "eve")
    revoked_at = time.monotonic()

    async def refused() -> str | None:
        rc, _, err = await tour.run(*eve)
        return err if rc != 0 else None

    err = await eventually(refused, timeout=5.0 + 3.0, interval=0.2)
    print(f"eve refused {time.monotonic() - revoked_at:.1f}s after `orka certs revoke`")
    # grpcurl asks server reflection first, which refuses a revoked peer too (the revocation
    # interceptor covers every service), so the refusal comes from there; or, when the new
    # CRL is loaded between grpcurl's reflection query and its call (seen in CI), from the
    # call itself, with its ErrorInfo.
    by_reflection = (
        'Error invoking method "orka.v1.Controller/ListNodes": rpc error: code = '
        'Unauthenticated desc = failed to query for service descriptor "orka.v1.Controller": '
        "certificate revoked\n"
    )
    by_the_call = "ERROR:\n  Code: Unauthenticated\n  Message: certificate revoked\n  Details:\n"
    assert err == by_reflection or err.startswith(by_the_call), err
    assert (await tour.nodes()) == {"node-1": "READY", "node-2": "READY"}  # admin still in

    rc, _ = await up.interrupt()
    assert rc == 0, up.output()


def _count(tour: Tour, node: str, needle: str) -> int:
    log = tour.data_dir / "logs" / f"{node}.log"
    return sum(needle in line for line in log.read_text(errors="replace").splitlines())


def served_serial(port: int, certs: Path) -> int:
    """A fresh TLS handshake with Python's ssl module: the serial the server presents now."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs / "ca.crt"))
    ctx.load_cert_chain(str(certs / "admin.crt"), str(certs / "admin.key"))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def _all_gone(tour: Tour, timeout: float) -> float:
    """Until no service, no instance and no port of the cluster is left; how long it took."""
    started = time.monotonic()

    async def gone() -> bool:
        return (
            not cluster_processes(tour.data_dir)
            and not tour.hello_processes()
            and _port_free(tour.controller_port)
            and _port_free(tour.scheduler_port)
        )

    try:
        await eventually(gone, timeout=timeout, interval=0.1)
    except AssertionError:
        left = [f"{p.pid} {' '.join(p.cmdline())[:160]}" for p in cluster_processes(tour.data_dir)]
        raise AssertionError(
            f"still running {timeout}s after: {left}, hello: {tour.hello_processes()}, ports "
            f"free: {_port_free(tour.controller_port)}, {_port_free(tour.scheduler_port)}"
        ) from None
    return time.monotonic() - started


async def test_orka_up_takes_its_cluster_along_whatever_ends_it(tour: Tour) -> None:
    """SIGHUP, SIGTERM, SIGKILL of `orka up`: nothing left within 10 s, and `orka up` again works.

    Also: a second `orka up` on a running data dir refuses naming the first; one whose port is
    held names the holder; an earlier run's child that survived (stopped with SIGSTOP, so the
    parent-death signal waits) is stopped by the next `orka up`.
    """
    timings: dict[str, float] = {}
    up = tour.up()
    await up.wait_up()
    await tour.orka("apply", "-f", str(EXAMPLES / "hello.yaml"), "--wait", timeout=60)
    assert len(await tour.running("hello")) == 3

    # The data dir is taken: a second `orka up` says by whom and starts nothing.
    assert up.proc is not None
    rc, out, err = await tour.run(
        sys.executable, "-m", "orka.cli.main", "up", "--data-dir", str(tour.data_dir)
    )
    assert rc == 1, (out, err)
    assert f"another `orka up` (pid {up.proc.pid}) is running on {tour.data_dir}" in err, err

    # Global flags before the command, as compose's example writes them (no ORKA_* set).
    rc, out, err = await tour.run(
        *(sys.executable, "-m", "orka.cli.main"),
        *("--controller", f"127.0.0.1:{tour.controller_port}"),
        *("--certs", str(tour.data_dir / "certs"), "get", "nodes", "-o", "json"),
        env=_clean_env(HOME=str(tour.tmp / "home")),
    )
    assert rc == 0, err
    assert sorted((n["name"], n["state"]) for n in json.loads(out)) == [
        ("node-1", "READY"),
        ("node-2", "READY"),
    ]

    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGKILL):
        assert up.proc is not None
        os.kill(up.proc.pid, sig)
        timings[sig.name] = await _all_gone(tour, timeout=10.0)
        # A closed terminal or a `kill` stop it as Ctrl-C does: it exits 0 after stopping all.
        expected = -signal.SIGKILL if sig is signal.SIGKILL else 0
        assert up.proc.wait(10) == expected, up.output()
        up = tour.up()
        await up.wait_up()

        async def three_running() -> list[dict[str, Any]] | None:
            running = await tour.running("hello")
            return running if len(running) == 3 else None

        await _soon(three_running, timeout=30)

    # A child that outlived its `orka up` (here: stopped, so its parent-death SIGTERM waits).
    assert up.proc is not None
    controller = next(
        c
        for c in psutil.Process(up.proc.pid).children()
        if "controller" in c.cmdline() and str(tour.data_dir) in c.cmdline()
    )
    controller.suspend()
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait(10)
    await eventually(lambda: _only(tour, controller.pid), timeout=10.0, interval=0.1)
    assert not _port_free(tour.controller_port)
    # Without the record (an `orka up` from before it wrote one): refused, naming the pid.
    pids_file = tour.data_dir / "up.pids"
    record = pids_file.read_bytes()
    pids_file.unlink()
    refused = tour.up()
    assert refused.proc is not None and refused.proc.wait(30) == 1, refused.output()
    assert (
        f"(held by pid {controller.pid}: " in refused.output()
        and f"`kill {controller.pid}`, then `orka up` again" in refused.output()
    ), refused.output()
    assert controller.status() == psutil.STATUS_STOPPED
    # With it, the next `orka up` proves the survivor its own and stops it.
    pids_file.write_bytes(record)
    up = tour.up()
    await up.wait_up()
    assert f"left controller pid {controller.pid} running; stopping them" in up.output()
    assert not psutil.pid_exists(controller.pid) or controller.status() == psutil.STATUS_ZOMBIE
    await up.interrupt()
    await _all_gone(tour, timeout=10.0)

    # A port held by a stranger: refused, naming the holder.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", tour.controller_port))
        s.listen()
        rc, out, err = await tour.run(
            sys.executable,
            "-m",
            "orka.cli.main",
            "up",
            "--data-dir",
            str(tour.data_dir),
            "--controller-listen",
            f"127.0.0.1:{tour.controller_port}",
            "--scheduler-listen",
            f"127.0.0.1:{tour.scheduler_port}",
        )
    assert rc == 1, (out, err)
    assert f"127.0.0.1:{tour.controller_port} is already in use (held by pid {os.getpid()}" in err
    print("signal -> nothing left: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))


async def _only(tour: Tour, pid: int) -> bool:
    return [p.pid for p in cluster_processes(tour.data_dir)] == [pid]


README = ROOT / "README.md"
README_CONTROLLER = "127.0.0.1:7443"


@dataclass
class ReadmeCommand:
    line: str  # continuations joined, as the shell sees it
    documented: list[str]  # the `# ...` lines under it: the output the README promises


def readme_grpcurl_commands(text: str) -> list[ReadmeCommand]:
    """The commands of every ```sh block of the README that runs grpcurl, in order."""
    commands: list[ReadmeCommand] = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S):
        if "grpcurl " not in block:
            continue
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            if not pending and line.startswith("#") and commands:
                commands[-1].documented.append(line.lstrip("# "))
                continue
            pending = f"{pending}\n{line}" if pending else line.strip()
            try:
                shlex.split(pending)  # a quote left open (JSON over two lines): read on
            except ValueError:
                continue
            if pending:
                commands.append(ReadmeCommand(pending, []))
            pending = ""
    return commands


def _rpc(line: str) -> str:
    """What a command calls: `orka.v1.Controller/X` -> X, `... list` -> list, `R=...` -> R."""
    if re.match(r"^[A-Z]=", line) and "ListWorkloads" not in line:
        return line.split("=", 1)[0]
    found = re.search(r"orka\.v1\.Controller/(\w+)", line)
    return found.group(1) if found else line.split()[-1]


def _any_source_port(text: str) -> str:
    """grpcurl names the client's ephemeral port in some errors: mask it."""
    return re.sub(r"127\.0\.0\.1:\d+->", "127.0.0.1:PORT->", text)


async def check_readme_grpcurl(tour: Tour) -> None:
    """Run the README's grpcurl commands in one shell against this cluster; check each answer."""
    port = f"127.0.0.1:{tour.controller_port}"
    commands = readme_grpcurl_commands(README.read_text())
    work = tour.tmp / "readme"
    work.mkdir()
    script = ["set -u"]
    for i, cmd in enumerate(commands):
        line = cmd.line.replace(README_CONTROLLER, port)
        if line.startswith("C="):
            script.append(f"C={shlex.quote(str(tour.data_dir / 'certs'))}")
        elif re.match(r"^[A-Z]+=", line):
            var = line.split("=", 1)[0]
            script += [line, f'echo "${var}" > {work}/{i}.out']
        else:
            script.append(f"{line} > {work}/{i}.out 2> {work}/{i}.err; echo $? > {work}/{i}.rc")
    env = {k: v for k, v in tour.env.items() if "proxy" not in k.lower()}
    env["PATH"] = f"{GRPCURL.parent}{os.pathsep}{env.get('PATH', '')}"
    rc, out, err = await tour.run("bash", "-c", "\n".join(script), env=env, timeout=90)
    assert rc == 0, (out, err, script)

    def result(i: int) -> Result:
        def read(ext: str) -> str:
            path = work / f"{i}.{ext}"
            return path.read_text() if path.exists() else ""

        return Result(int(read("rc") or 0), read("out"), read("err"))

    seen = []
    for i, cmd in enumerate(commands):
        rpc, r = _rpc(cmd.line), result(i)
        seen.append(rpc)
        if "-cert " not in cmd.line and rpc == "list":
            # Refused: the exact lines the README shows, but for the ports.
            assert r.code == 1 and r.out == "", (cmd.line, r)
            shown = [_any_source_port(d.replace(README_CONTROLLER, port)) for d in cmd.documented]
            assert shown and _any_source_port(r.err.strip()) in shown, (shown, r.err)
        elif rpc == "list":
            assert {"orka.v1.Controller", "grpc.health.v1.Health"} <= set(r.out.split()), r
        elif rpc == "C":
            pass
        elif "ListWorkloads" in cmd.line:
            assert r.out.strip().isdigit() and int(r.out) > 0, r
        elif rpc == "CreateWorkload":
            spec = r.json()["spec"]
            assert (spec["name"], spec["command"], spec["replicas"]) == ("web", ["sleep", "600"], 2)
        elif rpc == "ListInstances":
            found = r.json().get("instances", [])
            assert {(i["workload"], i["phase"]) for i in found} <= {("web", "RUNNING")}, r
        elif rpc == "WatchEvents":
            # The history since the List, then live, until -max-time: a deadline, not a failure.
            assert r.status() == "DeadlineExceeded", r
            events = _json_stream(r.out)
            assert events, f"the watch printed no event within -max-time: {r}"
            assert (events[0]["type"], events[0]["workload"]["spec"]["name"]) == ("ADDED", "web")
            phases: dict[str, list[str]] = {}
            for e in events:
                if "instance" in e:
                    phases.setdefault(e["instance"]["name"], []).append(e["instance"]["phase"])
            assert len(phases) == 2 and all(
                p[0] == "PENDING" and p[-1] == "RUNNING" for p in phases.values()
            ), phases
        elif rpc == "GetWorkload":
            got = r.json()
            assert got["spec"]["name"] == "web" and got["generation"] == "1", got
            assert got["spec"]["stop_grace_period"] == "10s", got
        elif rpc == "UpdateWorkload":
            # The README's etag is an example, long stale: refused, nothing changed.
            assert r.status() == "Aborted", r
        else:
            raise AssertionError(f"a README grpcurl line this test does not check: {cmd.line}")
    assert seen == [
        "C",
        "list",
        "ListWorkloads",
        "CreateWorkload",
        "ListInstances",
        "WatchEvents",
        "GetWorkload",
        "UpdateWorkload",
        "list",
    ], seen
