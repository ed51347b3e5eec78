"""`orka up`: a whole local cluster as child OS processes, supervised in the foreground.

Children are separate processes (not tasks) so a user can `kill -9` one agent and watch its
instances heal onto the others. They run in their own sessions, so a Ctrl-C in the terminal
reaches only `orka up`, which then stops them in order: agents first (they stop their
instances), then the controller and the scheduler. SIGTERM and SIGHUP (a closed terminal) do the
same. If `orka up` dies without stopping them (SIGKILL), the kernel's parent-death signal stops
them all at once, as `orka up` would: agents get SIGINT (a plain stop, their instances too),
the services SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from orka.cli.client import AdminClient
from orka.cli.defaults import (
    DEFAULT_CONTROLLER,
    DEFAULT_SCHEDULER,
    UsageError,
    add_flag,
    default_data_dir,
    resolve_data_dir,
)
from orka.cli.parent_death import die_with_parent
from orka.cli.up_lock import UpLock, port_holder, stop_processes
from orka.errors import Invalid, OrkaError
from orka.log import configure as configure_logging
from orka.models import NodeState
from orka.rpc.server import split_hostport
from orka.runtime.base import TaskState
from orka.runtime.process import ProcessDriver
from orka.security.issue import CA_CERT, init_certs, pair_dir
from orka.security.rotate import rotate

READY_TIMEOUT = 60.0
AGENT_STOP_GRACE = 30.0
SERVICE_STOP_GRACE = 10.0
# An earlier run's leftovers: agents stop their instances (each up to its stop grace) first.
STALE_STOP_GRACE = 20.0
# Signals that stop the cluster gracefully, like Ctrl-C.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MAX_AGENTS = 50
# Host ports of a local cluster's agents: 20000-29999, a slice of its own for each agent.
HOST_PORTS_FIRST = 20000
HOST_PORTS_PER_AGENT = 10000 // MAX_AGENTS


def network_line() -> str:
    """What instances get here: their own address on each agent's bridge, or why not."""
    from orka.runtime.network import host_unavailable

    why = host_unavailable()
    if why is None:
        return (
            "Instances with a network of their own (containers, processes with network: bridge)"
            " get an address on their agent's bridge."
        )
    return (
        f"Instances get no address of their own here: {why}. Host ports (ports: in a spec)"
        " still work."
    )


def host_port_range(index: int) -> str:
    """The `--host-port-range` of the index-th agent (from 0) of `orka up`."""
    first = HOST_PORTS_FIRST + index * HOST_PORTS_PER_AGENT
    return f"{first}-{first + HOST_PORTS_PER_AGENT - 1}"


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    log: Path
    proc: asyncio.subprocess.Process | None = None
    reported: bool = field(default=False)

    @property
    def death_signal(self) -> signal.Signals:
        """What the child gets when `orka up` dies: what `orka up` would send it to stop."""
        return signal.SIGINT if self.role == "agent" else signal.SIGTERM

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


def client_host(listen: str) -> str:
    """The address a client dials for a listen address (a wildcard is dialed on loopback)."""
    host, port = split_hostport(listen)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port_free(listen: str, flag: str) -> None:
    host, port = split_hostport(listen, flag)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise Invalid(
                    f"{flag}: {listen} is already in use{port_holder(port)}: stop that "
                    f"process (another `orka up` or orka service?) or pick another port "
                    f"with {flag}"
                ) from None
            raise Invalid(f"{flag}: cannot listen on {listen}: {e.strerror or e}") from None


def _open_log(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


class Cluster:
    def __init__(
        self,
        data_dir: Path,
        agents: int,
        controller_listen: str,
        scheduler_listen: str,
        lock: UpLock | None = None,
        metrics_port: int = 0,
    ) -> None:
        self.data_dir = data_dir
        self.lock = lock
        self.certs = data_dir / "certs"
        self.logs = data_dir / "logs"
        self.agents = agents
        self.controller_listen = controller_listen
        self.scheduler_listen = scheduler_listen
        self.controller_addr = client_host(controller_listen)
        self.node_names = [f"node-{i}" for i in range(1, agents + 1)]

        def certs(role: str, name: str) -> list[str]:
            # Each service gets only its own folder (ca.crt + its pair): no child can read the
            # CA key or another service's key. The admin files stay at the top for the CLI.
            return ["--certs", str(pair_dir(self.certs, role, name))]

        self.scheduler = Child(
            "scheduler",
            "scheduler",
            [
                "scheduler",
                "--listen",
                scheduler_listen,
                "--data-dir",
                str(data_dir),
                *certs("scheduler", "scheduler"),
            ],
            self.logs / "scheduler.log",
        )
        self.controller = Child(
            "controller",
            "controller",
            [
                "controller",
                "--listen",
                controller_listen,
                "--scheduler",
                client_host(scheduler_listen),
                "--data-dir",
                str(data_dir),
                *certs("controller", "controller"),
            ],
            self.logs / "controller.log",
        )
        self.agent_children = [
            Child(
                name,
                "agent",
                [
                    "agent",
                    "--name",
                    name,
                    "--scheduler",
                    client_host(scheduler_listen),
                    "--data-dir",
                    str(data_dir / "agents" / name),
                    *certs("agent", name),
                    # A local cluster is reached on this machine, and its agents share one
                    # host: each picks host ports from a range of its own.
                    "--host-ip",
                    "127.0.0.1",
                    "--host-port-range",
                    host_port_range(i),
                    # Where the host allows it, instances that have a network of their own
                    # (containers, processes with network: bridge) reach out through the host.
                    "--network-masquerade",
                ],
                self.logs / f"{name}.log",
            )
            for i, name in enumerate(self.node_names)
        ]
        # --metrics-port: each service's endpoint on loopback, on ports from that one up.
        self.metrics: dict[str, int] = {}
        if metrics_port:
            for i, child in enumerate(self.children):
                self.metrics[child.name] = metrics_port + i
                child.argv += ["--metrics-listen", f"127.0.0.1:{metrics_port + i}"]
        self.stop_requested = asyncio.Event()
        self.signals = 0

    @property
    def children(self) -> list[Child]:
        return [self.scheduler, self.controller, *self.agent_children]

    # ---- start ----

    async def spawn(self, child: Child) -> None:
        fd = _open_log(child.log)
        try:
            child.proc = await asyncio.create_subprocess_exec(
                # Forked in the loop's thread, the main one: it lives as long as `orka up`.
                *die_with_parent(child.death_signal),
                sys.executable,
                "-m",
                "orka.cli.main",
                *child.argv,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            os.close(fd)

    def _check_alive(self, children: list[Child]) -> None:
        for c in children:
            if c.proc is not None and c.proc.returncode is not None:
                raise OrkaError(
                    f"{c.name} exited during start-up ({_exit_text(c.proc.returncode)}); "
                    f"last lines of {c.log}:\n{_tail(c.log)}"
                )

    async def wait_ready(self, timeout: float) -> None:
        """Until the controller answers and lists every agent READY."""
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        while True:
            self._check_alive(self.children)
            if self.stop_requested.is_set():
                return
            try:
                # A fresh channel per try: a channel's reconnect backoff would otherwise
                # stretch the wait long after the controller came up.
                async with AdminClient(self.controller_addr, self.certs, timeout=2.0) as c:
                    nodes = await c.list_nodes(timeout=2.0)
                ready = {n.name for n in nodes if n.state is NodeState.READY}
                missing = [n for n in self.node_names if n not in ready]
                if not missing:
                    return
                last_error = f"waiting for nodes: {', '.join(missing)}"
            except OrkaError as e:
                last_error = e.message
            if time.monotonic() >= deadline:
                raise OrkaError(
                    f"the cluster was not ready within {timeout:g}s ({last_error}); "
                    f"see the logs in {self.logs}"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.3):
                    await self.stop_requested.wait()

    async def start(self) -> None:
        if not die_with_parent(signal.SIGTERM):
            print(
                "orka up: no setpriv (util-linux) here; if orka up is killed outright, "
                "its services keep running",
                flush=True,
            )
        await self.spawn(self.scheduler)
        await self.spawn(self.controller)
        for agent in self.agent_children:
            await self.spawn(agent)
        if self.lock is not None:
            self.lock.record([(c.name, c.role, c.pid) for c in self.children if c.proc])
        await self.wait_ready(READY_TIMEOUT)

    # ---- stop ----

    async def _stop(self, children: list[Child], sig: signal.Signals, grace: float) -> None:
        alive = [c for c in children if c.alive]
        for c in alive:
            assert c.proc is not None
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(sig)
        if not alive:
            return
        waits = [asyncio.ensure_future(c.proc.wait()) for c in alive if c.proc is not None]
        _, pending = await asyncio.wait(waits, timeout=grace)
        for w in pending:
            w.cancel()
        for c in alive:
            if c.alive and c.proc is not None:
                print(f"orka up: {c.name} did not stop within {grace:g}s; killing it", flush=True)
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()
                await c.proc.wait()

    async def shutdown(self) -> None:
        if any(c.alive for c in self.agent_children):
            print("orka up: stopping the agents (their instances stop too)...", flush=True)
        await self._stop(self.agent_children, signal.SIGINT, AGENT_STOP_GRACE)
        await self._reap_orphans()
        if self.controller.alive or self.scheduler.alive:
            print("orka up: stopping the controller and the scheduler...", flush=True)
        await self._stop([self.controller], signal.SIGTERM, SERVICE_STOP_GRACE)
        await self._stop([self.scheduler], signal.SIGTERM, SERVICE_STOP_GRACE)

    async def _reap_orphans(self) -> None:
        """Stop what a killed agent left running: a stopped local cluster leaves nothing behind.

        Instances outlive an agent crash on purpose (a restarted agent re-adopts them), but
        `orka up` is ending the whole cluster, so no agent is coming back for them this run.
        """
        reaped = 0
        for name in self.node_names:
            # The agent's default cgroup parent, so their cgroups go with them.
            driver = ProcessDriver(
                self.data_dir / "agents" / name / "runtime" / "process",
                cgroup_parent=f"orka/{name}",
            )
            try:
                for task in await driver.list():
                    if task.state is TaskState.RUNNING:
                        await driver.remove(task.instance)
                        reaped += 1
            finally:
                await driver.close()
        if reaped:
            print(f"orka up: stopped {reaped} instance(s) left by killed agents", flush=True)

    def on_signal(self) -> None:
        self.signals += 1
        if self.signals == 1:
            self.stop_requested.set()
            return
        # A second Ctrl-C: the user does not want to wait for a graceful stop.
        print("orka up: second signal, killing every child now", flush=True)
        for c in self.children:
            if c.alive and c.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()

    # ---- supervise ----

    def _report_exit(self, c: Child) -> None:
        assert c.proc is not None and c.proc.returncode is not None
        what = f"orka up: {c.name} (pid {c.pid}) exited: {_exit_text(c.proc.returncode)}"
        if c.role == "agent":
            what += "; its instances will be replaced on the other nodes (not restarting it)"
        else:
            what += f"; the cluster cannot work without it (log: {c.log}); Ctrl-C to stop"
        print(what, flush=True)

    async def supervise(self) -> int:
        waits: dict[asyncio.Future[int], Child] = {
            asyncio.ensure_future(c.proc.wait()): c
            for c in self.children
            if c.proc is not None and c.alive
        }
        stop = asyncio.ensure_future(self.stop_requested.wait())
        try:
            while waits and not self.stop_requested.is_set():
                done, _ = await asyncio.wait([*waits, stop], return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    child = waits.pop(fut, None)  # type: ignore[call-overload]
                    if child is not None:
                        self._report_exit(child)
            if not waits and not self.stop_requested.is_set():
                print("orka up: every process has exited", flush=True)
                return 1
            return 0
        finally:
            stop.cancel()
            for fut in waits:
                fut.cancel()

    def banner(self) -> str:
        ca = self.certs / CA_CERT
        admin_crt, admin_key = self.certs / "admin.crt", self.certs / "admin.key"
        client_flags = []
        if self.data_dir != default_data_dir():
            client_flags += ["--data-dir", str(self.data_dir)]
        if self.controller_addr != DEFAULT_CONTROLLER:
            client_flags += ["--controller", self.controller_addr]
        flags = (" " + shlex.join(client_flags)) if client_flags else ""
        agents = "\n".join(
            f"    {c.name:<10} pid {c.pid:<8} log {c.log}" for c in self.agent_children
        )
        first = self.agent_children[0] if self.agent_children else None
        grpcurl = (
            f"grpcurl -cacert {shlex.quote(str(ca))} -cert {shlex.quote(str(admin_crt))} "
            f"-key {shlex.quote(str(admin_key))} {self.controller_addr} list"
        )
        lines = [
            "",
            f"Orka is up ({len(self.agent_children)} agents, data in {self.data_dir}).",
            f"  controller   {self.controller_addr}   pid {self.controller.pid}   "
            f"log {self.controller.log}",
            f"  scheduler    {client_host(self.scheduler_listen)}   pid {self.scheduler.pid}   "
            f"log {self.scheduler.log}",
            f"  certs        {self.certs}",
            *(
                f"  metrics      {name:<10} http://127.0.0.1:{port}/metrics"
                for name, port in self.metrics.items()
            ),
            "  agents:",
            agents,
            "",
            "Try:",
            f"  orka get nodes{flags}",
            f"  orka apply{flags} -f workload.yaml --wait",
            f"  {grpcurl}",
        ]
        if first is not None:
            lines.append(f"  kill -9 {first.pid}    # lose {first.name}; watch its instances move")
        lines += ["", network_line()]
        lines += [
            "",
            "Ctrl-C stops the cluster (so does closing this terminal); `orka up` again resumes it.",
            "",
        ]
        return "\n".join(lines)


async def run_up(cluster: Cluster) -> int:
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, cluster.on_signal)
    try:
        try:
            await cluster.start()
        except BaseException:
            await cluster.shutdown()
            raise
        if cluster.stop_requested.is_set():
            await cluster.shutdown()
            return 0
        print(cluster.banner(), flush=True)
        rc = await cluster.supervise()
        await cluster.shutdown()
        print("orka up: stopped", flush=True)
        return rc
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def cmd_up(args: argparse.Namespace) -> int:
    if not 1 <= args.agents <= MAX_AGENTS:
        raise UsageError(f"--agents: must be between 1 and {MAX_AGENTS}, got {args.agents}")
    for flag, value in (
        ("--controller-listen", args.controller_listen),
        ("--scheduler-listen", args.scheduler_listen),
    ):
        try:
            split_hostport(value, flag)
        except Invalid as e:
            raise UsageError(e.message) from None
    if split_hostport(args.controller_listen) == split_hostport(args.scheduler_listen):
        raise UsageError("--controller-listen and --scheduler-listen must differ")
    if args.metrics_port and not 1 <= args.metrics_port <= 65535 - 2 - args.agents:
        raise UsageError(f"--metrics-port: {args.metrics_port} leaves no room for every service")
    # The children log to their own files; this process only prints for the person at the
    # terminal, so library chatter (e.g. reaping orphans) stays below warnings.
    configure_logging("warning", service="up")
    data_dir = resolve_data_dir(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = UpLock(data_dir)
    lock.acquire()
    try:
        return _up_locked(args, data_dir, lock)
    finally:
        lock.release()


def _stop_stale(lock: UpLock) -> bool:
    """Stop what an earlier `orka up` on this data dir left running; whether there was any."""
    stale = lock.stale()
    if not stale:
        return False
    what = ", ".join(f"{rec.name} pid {rec.pid}" for rec, _ in stale)
    print(f"orka up: an earlier run on {lock.data_dir} left {what} running; stopping them")
    killed = stop_processes(stale, STALE_STOP_GRACE)
    if killed:
        print(f"orka up: killed pid(s) {', '.join(killed)}: they did not stop in time")
    return True


def _up_locked(args: argparse.Namespace, data_dir: Path, lock: UpLock) -> int:
    stale = _stop_stale(lock)
    try:
        check_port_free(args.controller_listen, "--controller-listen")
        check_port_free(args.scheduler_listen, "--scheduler-listen")
    except Invalid as e:
        unrecorded = lock.unrecorded()
        if not unrecorded:
            raise
        pids = " ".join(str(p) for p in unrecorded)
        raise Invalid(
            f"{e.message}\norka services of an earlier run on {data_dir} still run (pids {pids}); "
            f"it did not record them, so they are not stopped for you: `kill {pids}`, then "
            "`orka up` again"
        ) from None
    nodes = [f"node-{i}" for i in range(1, args.agents + 1)]
    written = init_certs(data_dir / "certs", nodes=nodes)
    if written:
        print(f"orka up: wrote {len(written)} certificate files to {data_dir / 'certs'}")
    # A cluster that is only ever run through `orka up` never has to think about expiry.
    renewed = rotate(data_dir / "certs", only_due=True)
    if renewed:
        print(f"orka up: re-issued {len(renewed) // 2} certificate(s) due for renewal")

    async def main() -> int:
        # Built inside the loop: the cluster owns asyncio primitives.
        cluster = Cluster(
            data_dir,
            args.agents,
            args.controller_listen,
            args.scheduler_listen,
            lock,
            metrics_port=args.metrics_port,
        )
        if stale:
            # Instances of the stale run's agents that were killed rather than stopped.
            await cluster._reap_orphans()
        print(
            f"orka up: starting the scheduler, the controller and {args.agents} agents "
            f"(logs in {cluster.logs})...",
            flush=True,
        )
        return await run_up(cluster)

    return asyncio.run(main())


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run a whole local cluster in the foreground")
    add_flag(p, "--data-dir", metavar="DIR", help="where state, certs and logs go (~/.orka)")
    add_flag(p, "--agents", type=int, default=2, metavar="N", help="number of agents (2)")
    add_flag(p, "--controller-listen", default=DEFAULT_CONTROLLER, metavar="HOST:PORT")
    add_flag(p, "--scheduler-listen", default=DEFAULT_SCHEDULER, metavar="HOST:PORT")
    add_flag(
        p,
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve each service's Prometheus metrics on 127.0.0.1 from PORT up: the scheduler,"
        " the controller, then each agent (off by default)",
    )
    p.set_defaults(func=cmd_up)
