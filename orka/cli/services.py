"""`orka controller|scheduler|agent`: run one service in the foreground (compose, systemd, up)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import math
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from orka import eventloop, gctune, log
from orka.cli.defaults import (
    DEFAULT_CONTROLLER,
    DEFAULT_SCHEDULER,
    UsageError,
    add_flag,
    add_location_flags,
    resolve_certs,
    resolve_data_dir,
)
from orka.errors import Invalid
from orka.notify import Notifier
from orka.rpc.client import split_targets
from orka.rpc.server import split_hostport
from orka.security import tls as tls_files
from orka.security.ca import validate_name
from orka.security.identity import check_serves_as
from orka.security.tls import TlsFiles, load_and_check
from orka.supervision import PartFailed
from orka.taskdump import dump_tasks
from orka.validation import RESERVED_LABEL_PREFIX, check_label_key, check_label_value

POLICIES = ("spread", "binpack")
DOMAIN_TYPES = ("auto", "kvm", "qemu")


def default_node_name() -> str:
    # The short host name: node names are DNS labels, so an FQDN's dots cannot be kept.
    return socket.gethostname().split(".")[0].lower()


def check_tls(certs: Path, role: str, name: str, reload_interval: float) -> TlsFiles:
    """Fail at start-up, naming the file, rather than on the first handshake."""
    _positive("--tls-reload-interval", reload_interval)
    files = replace(TlsFiles.for_service(certs, role, name), reload_interval=reload_interval)
    identity = load_and_check(files)
    if identity.role != role:
        raise Invalid(
            f"certs: {files.cert} has role {identity.role!r} ({identity.uri}); "
            f"the {role} needs a {role} certificate"
        )
    check_serves_as(files.cert.read_bytes(), role, str(files.cert))
    if role == "agent" and identity.name != name:
        raise Invalid(
            f"certs: {files.cert} is for node {identity.name!r} but --name is {name!r}; "
            f"the scheduler names the node after its certificate"
        )
    return files


def warn_if_expiring(files: TlsFiles) -> None:
    """At start (once logging is set up): warn when the service's certificate is near expiry;
    servers warn again each time they load a re-issued one (tls.ServerCertificates)."""
    tls_files.warn_if_expiring(files.cert, tls_files.Pems.read(files).leaf)


def _positive(flag: str, value: float | int | None) -> None:
    if value is not None and value <= 0:
        raise UsageError(f"{flag}: must be > 0, got {value:g}")


def _listen(value: str) -> str:
    try:
        split_hostport(value)
    except Invalid as e:
        raise UsageError(e.message) from None
    return value


def _metrics_listen(value: str | None) -> str:
    """--metrics-listen checked before anything starts ('' or unset: no endpoint)."""
    if not value:
        return ""
    from orka.metrics import check_listen

    try:
        check_listen(value)
    except Invalid as e:
        raise UsageError(e.message) from None
    return value


@contextlib.contextmanager
def metrics_endpoint(listen: str, role: str, read: Callable[[], Any]) -> Iterator[int]:
    """The service's metrics endpoint while the block runs (its port; 0: none asked for)."""
    if not listen:
        yield 0
        return
    from orka import metrics

    try:
        endpoint = metrics.serve(listen, role, read)
    except Invalid as e:
        raise UsageError(e.message) from None
    try:
        yield endpoint.port
    finally:
        endpoint.close()


def _targets(value: str, flag: str = "--scheduler") -> list[str]:
    try:
        return split_targets(value, flag)
    except Invalid as e:
        raise UsageError(e.message) from None


def parse_labels(value: str | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for part in (value or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--labels: {part!r} is not KEY=VALUE")
        key, val = key.strip(), val.strip()
        if key.startswith(RESERVED_LABEL_PREFIX):
            raise UsageError(
                f"--labels: {key!r}: the {RESERVED_LABEL_PREFIX} prefix is set by the scheduler"
                " only (orka.io/node is the node's name, from its certificate)"
            )
        try:
            check_label_key(key)
            check_label_value(val)
        except ValueError as err:
            raise UsageError(f"--labels: {key!r}: {err}") from None
        labels[key] = val
    return labels


def parse_list(value: str, flag: str) -> list[str]:
    items = [p.strip() for p in value.split(",") if p.strip()]
    if not items:
        raise UsageError(f"{flag}: at least one value is required")
    return items


async def serve(
    run: Callable[[], Awaitable[None]], handlers: dict[signal.Signals, Callable[[], None]]
) -> None:
    loop = asyncio.get_running_loop()
    for sig, handler in handlers.items():
        loop.add_signal_handler(sig, handler)
    try:
        await run()
    finally:
        for sig in handlers:
            loop.remove_signal_handler(sig)


async def notified(
    run: Callable[[], Awaitable[None]],
    ready: Callable[[], Awaitable[str]],
    notifier: Notifier,
) -> None:
    """Run a service and keep systemd told: READY=1 (with `ready`'s STATUS) once `ready`
    returns, WATCHDOG=1 from this event loop meanwhile, STOPPING=1 when it ends (a signal
    handler may have said so first; it is sent once)."""

    async def announce() -> None:
        notifier.ready(await ready())

    tasks = [asyncio.create_task(notifier.watchdog()), asyncio.create_task(announce())]
    try:
        await run()
    finally:
        notifier.stopping()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class GracefulStop:
    """SIGINT and SIGTERM both mean a graceful stop for the controller and the scheduler.

    The stop runs as its own task; `run()` may return (its own idempotent `stop()` sees one
    already under way) before that task has closed the store, so `wait()` must be awaited
    before the loop closes, or a half-closed store's worker thread keeps the process alive.
    """

    def __init__(self, service: Any, notifier: Notifier | None = None) -> None:
        self.service = service
        self.notifier = notifier or Notifier()
        self.tasks: set[asyncio.Task[None]] = set()

    def handler(self) -> None:
        self.notifier.stopping()
        self.tasks.add(asyncio.ensure_future(self.service.stop()))

    @property
    def handlers(self) -> dict[signal.Signals, Callable[[], None]]:
        # SIGUSR1: every task's stack on stderr, to see what a service that seems stuck
        # waits on (it goes on running).
        return {
            signal.SIGINT: self.handler,
            signal.SIGTERM: self.handler,
            signal.SIGUSR1: dump_tasks,
        }

    async def run(self, ready: Callable[[], Awaitable[str]]) -> None:
        try:
            await serve(lambda: notified(self.service.run, ready, self.notifier), self.handlers)
        finally:
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)


# ---- controller ----


def cmd_controller(args: argparse.Namespace) -> int:
    from orka.controller.api import Quotas
    from orka.controller.reconciler import History
    from orka.controller.service import Controller, ControllerConfig

    listen = _listen(args.listen)
    metrics_listen = _metrics_listen(args.metrics_listen)
    schedulers = _targets(args.scheduler)
    audit_log = _audit_log(args.audit_log)
    data_dir = resolve_data_dir(args.data_dir)
    certs = resolve_certs(args.certs, data_dir)
    tls = check_tls(certs, "controller", "controller", args.tls_reload_interval)
    log.configure(level=args.log_level, service="controller")
    warn_if_expiring(tls)
    _check_advertise(args.advertise)
    etcd_tls = _etcd_tls(args)
    _positive("--max-workloads", args.max_workloads)
    _positive("--max-instances", args.max_instances)
    _positive("--max-spec-bytes", args.max_spec_bytes)
    _positive("--finished-retention", args.finished_retention)
    if args.keep_finished < 0:
        raise UsageError(f"--keep-finished: must be >= 0, got {args.keep_finished}")
    config = ControllerConfig(
        listen=listen,
        schedulers=schedulers,
        store_url=args.store or "",
        data_dir=data_dir,
        advertise=args.advertise or "",
        audit_log=audit_log,
        audit_reads=args.audit_reads,
        quotas=Quotas(
            max_workloads=args.max_workloads,
            max_instances=args.max_instances,
            max_spec_bytes=args.max_spec_bytes,
        ),
        history=History(keep=args.keep_finished, retention=args.finished_retention),
        **etcd_tls,
    )

    notifier = Notifier()  # before anything else reads the environment

    async def main() -> None:
        controller = Controller(config, tls)

        async def ready() -> str:
            # Listening, and leading with the store loaded (or following a live leader).
            await controller.listening.wait()
            assert controller.leadership is not None
            await controller.leadership.settled.wait()
            role = "leading" if controller.is_leader else "standby, following the leader"
            return f"serving the API on port {controller.port}, {role}"

        from orka.metrics import controller_view

        with metrics_endpoint(metrics_listen, "controller", lambda: controller_view(controller)):
            await GracefulStop(controller, notifier).run(ready)

    gctune.tune()
    try:
        eventloop.run(main())
    except PartFailed as e:
        return _failed(e)
    return 0


# etcd grants no lease shorter than about 1.5 s (its election timeout): 2 s is the least.
MIN_ELECTION_TTL = 2


def _check_advertise(value: str | None) -> None:
    if value:
        try:
            _, port = split_hostport(value, "--advertise")
        except Invalid as e:
            raise UsageError(e.message) from None
        if port == 0:
            raise UsageError(f"--advertise: {value!r} needs a real port, not 0")


def _etcd_tls_flags(p: argparse.ArgumentParser) -> None:
    """The client TLS flags of a service that can keep its state in (or elect on) etcd."""
    add_flag(p, "--etcd-ca", metavar="FILE", help="CA bundle that signed etcd's certificate")
    add_flag(p, "--etcd-cert", metavar="FILE", help="client certificate for etcd")
    add_flag(p, "--etcd-key", metavar="FILE", help="client key for etcd")


def _etcd_tls(args: argparse.Namespace) -> dict[str, Path | None]:
    """The --etcd-ca/--etcd-cert/--etcd-key files, each checked to exist."""
    etcd_tls = {
        name: Path(value).expanduser() if value else None
        for name, value in (
            ("etcd_ca", args.etcd_ca),
            ("etcd_cert", args.etcd_cert),
            ("etcd_key", args.etcd_key),
        )
    }
    for name, path in etcd_tls.items():
        if path is not None and not path.is_file():
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag}: {path} is not a file")
    return etcd_tls


def _audit_log(value: str | None) -> Path | None:
    """Fail at start-up, naming the flag, when the audit log cannot be written."""
    if not value:
        return None
    from orka.controller.audit import open_private

    path = Path(value).expanduser()
    try:
        open_private(path)
    except OSError as e:
        raise UsageError(f"--audit-log: cannot write {path}: {e.strerror or e}") from None
    return path


# ---- scheduler ----


def cmd_scheduler(args: argparse.Namespace) -> int:
    from orka.scheduler.pipeline import PipelineConfig
    from orka.scheduler.service import Scheduler, SchedulerConfig

    listen = _listen(args.listen)
    metrics_listen = _metrics_listen(args.metrics_listen)
    for flag, value in (
        ("--heartbeat-interval", args.heartbeat_interval),
        ("--node-lost-after", args.node_lost_after),
        ("--offer-timeout", args.offer_timeout),
    ):
        _positive(flag, value)
    if args.node_lost_after <= 2 * args.heartbeat_interval:
        raise UsageError(
            f"--node-lost-after: {args.node_lost_after:g}s must be more than two "
            f"--heartbeat-interval ({args.heartbeat_interval:g}s), or nodes are lost "
            "before they are even marked not ready"
        )
    if not math.isfinite(args.max_heartbeats_per_second) or args.max_heartbeats_per_second < 0:
        raise UsageError(
            f"--max-heartbeats-per-second: must be 0 (no bound) or more, got"
            f" {args.max_heartbeats_per_second:g}"
        )
    if args.policy not in POLICIES:
        raise UsageError(f"--policy: {args.policy!r} is not one of {', '.join(POLICIES)}")
    data_dir = resolve_data_dir(args.data_dir)
    _check_advertise(args.advertise)
    etcd_tls = _etcd_tls(args)
    if args.election_ttl < MIN_ELECTION_TTL:
        raise UsageError(
            f"--election-ttl: must be at least {MIN_ELECTION_TTL} (etcd's shortest lease),"
            f" got {args.election_ttl}"
        )
    if args.store and args.store.strip().lower().partition(":")[0] != "etcd":
        # SQLite and memory have no leases: every scheduler would win its own election.
        raise UsageError(
            f"--store: {args.store!r} cannot elect an active scheduler (only etcd has leases);"
            " use etcd://HOST:PORT[,...], or leave --store out to run one scheduler alone"
        )
    tls = check_tls(
        resolve_certs(args.certs, data_dir), "scheduler", "scheduler", args.tls_reload_interval
    )
    log.configure(level=args.log_level, service="scheduler")
    warn_if_expiring(tls)
    config = SchedulerConfig(
        listen=listen,
        heartbeat_interval=args.heartbeat_interval,
        node_lost_after=args.node_lost_after,
        max_heartbeats_per_second=args.max_heartbeats_per_second,
        offer_timeout=args.offer_timeout,
        pipeline=PipelineConfig(policy=args.policy),
        store_url=args.store or "",
        data_dir=data_dir,
        advertise=args.advertise or "",
        election_ttl=args.election_ttl,
        **etcd_tls,
    )

    notifier = Notifier()

    async def main() -> None:
        scheduler = Scheduler(config, tls)

        async def ready() -> str:
            await scheduler.listening.wait()
            if scheduler.leadership is None:
                return f"serving agents on port {scheduler.port}"
            return f"listening on port {scheduler.port}, in the election for the active scheduler"

        from orka.metrics import scheduler_view

        with metrics_endpoint(metrics_listen, "scheduler", lambda: scheduler_view(scheduler)):
            await GracefulStop(scheduler, notifier).run(ready)

    gctune.tune()
    try:
        eventloop.run(main())
    except PartFailed as e:
        return _failed(e)
    return 0


def _failed(e: PartFailed) -> int:
    """A part of the service failed and stopped it: logged already, with its traceback; the
    last line says why the process exits 1 (like any failed command)."""
    print(f"error: {e}", file=sys.stderr)
    return 1


# ---- agent ----

# orka.runtime.identity's default, not imported here: every command would load it.
DEFAULT_WORKLOAD_USER = "nobody"


def cmd_agent(args: argparse.Namespace) -> int:
    from orka.agent.service import Agent, AgentConfig

    name = args.name or default_node_name()
    try:
        validate_name(name)
    except Invalid as e:
        raise UsageError(f"--name: {e.message.removeprefix('name: ')}") from None
    if args.listen:
        _listen(args.listen)
    metrics_listen = _metrics_listen(args.metrics_listen)
    schedulers = _targets(args.scheduler)
    runtimes = parse_list(args.runtime, "--runtime")
    _positive("--cpu-millis", args.cpu_millis)
    _positive("--memory-bytes", args.memory_bytes)
    _positive("--leave-timeout", args.leave_timeout)
    _positive("--log-max-bytes", args.log_max_bytes)
    labels = parse_labels(args.labels)
    driver_options = _driver_options(args)
    # Empty (e.g. ORKA_WORKLOAD_USER=) is the default, never "no user".
    workload_user = _account("--workload-user", args.workload_user or DEFAULT_WORKLOAD_USER)
    workload_group = _account("--workload-group", args.workload_group or "")
    cgroup_parent = _cgroup_parent(args.cgroup_parent or "")
    secret_dirs = _secret_dirs(args.secret_dir)
    host_ip = _host_ip(args.host_ip)
    host_port_range = _host_port_range(args.host_port_range)
    network = _network_options(args)
    data_dir = resolve_data_dir(args.data_dir)
    tls = check_tls(resolve_certs(args.certs, data_dir), "agent", name, args.tls_reload_interval)
    log.configure(level=args.log_level, service=f"agent/{name}")
    warn_if_expiring(tls)
    config = AgentConfig(
        name=name,
        schedulers=schedulers,
        data_dir=data_dir,
        runtimes=runtimes,
        cpu_millis=args.cpu_millis,
        memory_bytes=args.memory_bytes,
        labels=labels,
        leave_timeout=args.leave_timeout,
        log_max_bytes=args.log_max_bytes,
        driver_options=driver_options,
        workload_user=workload_user,
        workload_group=workload_group,
        allow_root_workloads=bool(args.allow_root_workloads),
        cgroup_parent=cgroup_parent,
        secret_dirs=secret_dirs,
        allowed_paths=_allowed_paths(args.allowed_paths),
        host_ip=host_ip,
        host_port_range=host_port_range,
        pool=_pool(args.pool),
        volume_dir=_volume_dir(args.volume_dir),
        **network,
    )

    notifier = Notifier()

    async def main() -> None:
        agent = Agent(config, tls)

        async def ready() -> str:
            await agent.connected.wait()
            return f"registered with the scheduler as node {name}"

        def stop(leave: bool) -> None:
            notifier.stopping("leaving: moving instances to other nodes" if leave else "stopping")
            agent.request_stop(leave=leave)

        # SIGTERM (systemd stop, docker stop): leave, so instances move before we exit.
        # SIGINT (Ctrl-C, `orka up` shutdown): just stop the instances and exit.
        handlers = {
            signal.SIGTERM: lambda: stop(True),
            signal.SIGINT: lambda: stop(False),
        }
        from orka.metrics import agent_view

        with metrics_endpoint(metrics_listen, "agent", lambda: agent_view(agent)):
            await serve(lambda: notified(agent.run, ready, notifier), handlers)

    gctune.tune()
    try:
        asyncio.run(main())  # not uvloop: the agent starts children (see orka.eventloop)
    except PartFailed as e:
        return _failed(e)
    return 0


def _host_ip(value: str | None) -> str:
    from orka.runtime.host_ports import default_host_ip

    if not value:
        return default_host_ip()
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        raise UsageError(f"--host-ip: {value[:100]!r} is not an IP address") from None


def _network_options(args: argparse.Namespace) -> dict[str, Any]:
    """The instance network's flags as `AgentConfig` fields, checked before anything starts."""
    from orka.runtime.network import check_bridge, parse_subnet

    bridge = args.network_bridge or ""
    subnet = args.network_subnet or ""
    try:
        if bridge:
            check_bridge(bridge)
        if subnet:
            parse_subnet(subnet)
    except Invalid as e:
        raise UsageError(e.message) from None
    options: dict[str, Any] = {
        "network_bridge": bridge,
        "network_subnet": subnet,
        "network_masquerade": bool(args.network_masquerade),
    }
    if args.cni_bin_dir:
        dirs = [Path(d).expanduser() for d in parse_list(args.cni_bin_dir, "--cni-bin-dir")]
        for d in dirs:
            if not d.is_absolute():
                raise UsageError(f"--cni-bin-dir: {str(d)!r} must be an absolute path")
        options["cni_bin_dirs"] = dirs
    return options


def _host_port_range(value: str) -> tuple[int, int]:
    from orka.runtime.host_ports import parse_range

    try:
        return parse_range(value or "20000-32767")
    except Invalid as e:
        raise UsageError(f"--host-port-range: {e.message}") from None


def _account(flag: str, value: str) -> str:
    from orka.models import check_account

    try:
        return check_account(value)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def _cgroup_parent(value: str) -> str:
    parts = value.strip("/").split("/") if value.strip("/") else []
    if any(p in ("", ".", "..") or not p.isprintable() for p in parts) or len(value) > 200:
        raise UsageError(f"--cgroup-parent: {value[:200]!r} is not a relative cgroup path")
    return "/".join(parts)


def _secret_dirs(value: str | None) -> list[Path]:
    dirs = [Path(p).expanduser() for p in parse_list(value, "--secret-dir")] if value else []
    for d in dirs:
        if not d.is_absolute() or not d.is_dir():
            raise UsageError(f"--secret-dir: {d} is not an absolute path to a directory")
    return dirs


def _pool(value: str | None) -> str:
    from orka.models import DEFAULT_POOL, check_name

    if not value:
        return DEFAULT_POOL
    try:
        return check_name(value, "--pool")
    except ValueError as err:
        raise UsageError(str(err)) from None


def _volume_dir(value: str | None) -> Path | None:
    if not value:
        return None  # the agent's default: <data dir>/volumes
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise UsageError(f"--volume-dir: {value!r} must be an absolute path")
    return path


def _allowed_paths(value: str | None) -> list[Path] | None:
    if not value:
        return None  # the agent's default: <data dir>/images
    paths = [Path(p).expanduser() for p in parse_list(value, "--allowed-paths")]
    for path in paths:
        if not path.is_absolute():
            raise UsageError(f"--allowed-paths: {str(path)!r} must be an absolute path")
    return paths


def _driver_options(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The driver flags given, as `make_driver` keyword arguments per driver."""
    if args.libvirt_domain_type not in DOMAIN_TYPES:
        raise UsageError(
            f"--libvirt-domain-type: {args.libvirt_domain_type!r} is not one of "
            f"{', '.join(DOMAIN_TYPES)}"
        )
    containerd: dict[str, Any] = {}
    if args.containerd_socket:
        containerd["socket"] = args.containerd_socket
    if args.containerd_cgroup_parent:
        containerd["cgroup_parent"] = args.containerd_cgroup_parent
    if args.containerd_logs:
        from orka.runtime.containerd import LOG_MODES  # only when asked: it loads containerd's API

        if args.containerd_logs not in LOG_MODES:
            raise UsageError(
                f"--containerd-logs: {args.containerd_logs!r} is not one of {', '.join(LOG_MODES)}"
            )
        containerd["logs"] = args.containerd_logs
    libvirt: dict[str, Any] = {"domain_type": args.libvirt_domain_type}
    if args.libvirt_uri:
        libvirt["uri"] = args.libvirt_uri
    return {"containerd": containerd, "libvirt": libvirt}


# ---- flags ----


def _int_arg(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None


def _rate_arg(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number per second") from None


def _float_arg(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None


def _common(p: argparse.ArgumentParser, listen: str | None) -> None:
    add_flag(
        p,
        "--listen",
        default=listen,
        metavar="HOST:PORT",
        help=f"address to serve on (default {listen})" if listen else "unused by the agent",
    )
    add_location_flags(p)
    add_flag(
        p,
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics over plain HTTP at HOST:PORT (off by default; no TLS"
        " and no authentication: keep it on loopback or a private network)",
    )
    add_flag(p, "--log-level", metavar="LEVEL", help="debug, info, warning or error")
    add_flag(
        p,
        "--tls-reload-interval",
        type=_float_arg,
        default=tls_files.DEFAULT_RELOAD_INTERVAL,
        metavar="S",
        help="how often a server (controller, scheduler) re-reads its CRL: a revoked peer "
        f"is cut off within this ({tls_files.DEFAULT_RELOAD_INTERVAL:g})",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("controller", help="run the controller (the public API)")
    _common(p, DEFAULT_CONTROLLER)
    add_flag(
        p,
        "--scheduler",
        default=DEFAULT_SCHEDULER,
        metavar="HOST:PORT[,...]",
        help=f"scheduler address(es) (default {DEFAULT_SCHEDULER})",
    )
    add_flag(
        p,
        "--store",
        metavar="URL",
        help="sqlite:///path or etcd://host:port[,...] (default sqlite in the data dir)",
    )
    add_flag(
        p,
        "--advertise",
        metavar="HOST:PORT",
        help="API address followers name to clients when this controller leads "
        "(default --listen, 0.0.0.0 -> 127.0.0.1)",
    )
    _etcd_tls_flags(p)
    add_flag(
        p,
        "--audit-log",
        metavar="PATH",
        help="append one JSON line per API call that writes (who, what, outcome) to PATH "
        "(created 0600); the records also go to the log as orka.audit",
    )
    add_flag(
        p,
        "--audit-reads",
        action="store_true",
        default=False,
        help="audit Get, List and Watch calls as well",
    )
    add_flag(
        p,
        "--max-workloads",
        type=_int_arg,
        default=10_000,
        metavar="N",
        help="quota: workloads in the cluster (10000)",
    )
    add_flag(
        p,
        "--max-instances",
        type=_int_arg,
        default=100_000,
        metavar="N",
        help="quota: replicas summed over all workloads (100000)",
    )
    add_flag(
        p,
        "--max-spec-bytes",
        type=_int_arg,
        default=32 << 20,
        metavar="N",
        help="quota: serialized specs summed over all workloads (32 MiB)",
    )
    add_flag(
        p,
        "--keep-finished",
        type=_int_arg,
        default=5,  # orka.controller.reconciler.KEEP_FINISHED, not imported here (startup)
        metavar="N",
        help="finished instances (stopped, failed, lost, replaced) kept per workload; older"
        " ones are removed (5)",
    )
    add_flag(
        p,
        "--finished-retention",
        type=_float_arg,
        default=3600.0,  # orka.controller.reconciler.FINISHED_RETENTION
        metavar="S",
        help="finished instances are removed this many seconds after they ended, however few"
        " (3600)",
    )
    p.set_defaults(func=cmd_controller)

    p = sub.add_parser("scheduler", help="run the scheduler (agents connect here)")
    _common(p, DEFAULT_SCHEDULER)
    add_flag(p, "--heartbeat-interval", type=_float_arg, default=1.0, metavar="S")
    add_flag(p, "--node-lost-after", type=_float_arg, default=5.0, metavar="S")
    add_flag(
        p,
        "--max-heartbeats-per-second",
        type=_rate_arg,
        default=1000.0,
        metavar="N",
        help="heartbeats per second over all nodes: above N x --heartbeat-interval nodes, each"
        " heartbeats every nodes/N seconds and --node-lost-after stretches alike (Nomad's"
        " max_heartbeats_per_second); 0: no bound (1000)",
    )
    add_flag(p, "--offer-timeout", type=_float_arg, default=2.0, metavar="S")
    add_flag(p, "--policy", default="spread", metavar="spread|binpack", help="scoring policy")
    add_flag(
        p,
        "--store",
        metavar="URL",
        help="etcd://host:port[,...]: join the election for the active scheduler on this store"
        " (standby mode: run two or more, each agent and controller given every address);"
        " without it this scheduler runs alone and is always active",
    )
    add_flag(
        p,
        "--advertise",
        metavar="HOST:PORT",
        help="the address agents and controllers dial for this scheduler, named to them by a"
        " standby while this one is active; must be spelled as in their --scheduler lists"
        " (default --listen, 0.0.0.0 -> 127.0.0.1)",
    )
    _etcd_tls_flags(p)
    add_flag(
        p,
        "--election-ttl",
        type=_int_arg,
        default=5,  # orka.scheduler.service.SchedulerConfig.election_ttl (startup)
        metavar="S",
        help="with --store: the active scheduler's lease; a standby takes over within about"
        " this long after the active one dies (plus the agents' registrations); shorter, and"
        " a scheduler on a loaded host may lose it (5)",
    )
    p.set_defaults(func=cmd_scheduler)

    p = sub.add_parser("agent", help="run a node agent")
    _common(p, None)
    add_flag(p, "--name", metavar="NODE", help="node name (default: the host name)")
    add_flag(
        p,
        "--scheduler",
        default=DEFAULT_SCHEDULER,
        metavar="HOST:PORT[,...]",
        help=f"scheduler address(es) (default {DEFAULT_SCHEDULER})",
    )
    add_flag(p, "--runtime", default="process", metavar="DRIVER[,...]", help="(default process)")
    add_flag(p, "--cpu-millis", type=_int_arg, metavar="N", help="CPU to offer")
    add_flag(p, "--memory-bytes", type=_int_arg, metavar="N", help="memory to offer")
    add_flag(p, "--labels", metavar="k=v,k=v", help="node labels for node selectors")
    add_flag(p, "--pool", metavar="NAME", help="the pool the node joins (default: default)")
    add_flag(
        p,
        "--volume-dir",
        metavar="DIR",
        help="where the node keeps its volumes (default: <data dir>/volumes)",
    )
    add_flag(
        p,
        "--leave-timeout",
        type=_float_arg,
        default=60.0,
        metavar="S",
        help="on SIGTERM, wait this long for instances to move (60)",
    )
    add_flag(
        p,
        "--log-max-bytes",
        type=_int_arg,
        default=10 << 20,
        metavar="N",
        help="rotate each instance's stdout/stderr past this size, keeping one old file (10 MiB)",
    )
    add_flag(
        p,
        "--workload-user",
        default=DEFAULT_WORKLOAD_USER,
        metavar="USER",
        help="user (name or id) process workloads run as when their spec names none (nobody)",
    )
    add_flag(p, "--workload-group", metavar="GROUP", help="its group (default: its own)")
    add_flag(
        p,
        "--allow-root-workloads",
        action="store_true",
        default=False,
        help="let process workloads run as root (refused by default)",
    )
    add_flag(
        p,
        "--cgroup-parent",
        metavar="PATH",
        help="cgroup under which each process instance gets its own (default orka/<name>)",
    )
    add_flag(
        p,
        "--allowed-paths",
        metavar="DIR[,...]",
        help="directories VM images, kernels and oci-archive: images may be read from"
        " (default <data dir>/images)",
    )
    add_flag(
        p,
        "--host-ip",
        metavar="IP",
        help="this node's address, where instances' host ports are reached (default: the"
        " address of the default route's interface, else 127.0.0.1)",
    )
    add_flag(
        p,
        "--host-port-range",
        default="20000-32767",
        metavar="FIRST-LAST",
        help="host ports picked for ports that ask for none (20000-32767)",
    )
    add_flag(
        p,
        "--network-bridge",
        metavar="NAME",
        help="the bridge instances join (default orka-<hash of the node name and data dir>)",
    )
    add_flag(
        p,
        "--network-subnet",
        metavar="CIDR",
        help="the instances' IPv4 subnet (default: a /24 of 10.64.0.0/10 chosen by the same"
        " hash, clear of the host's routes)",
    )
    add_flag(
        p,
        "--network-masquerade",
        action="store_true",
        default=False,
        help="masquerade instance traffic leaving the node (off by default)",
    )
    add_flag(
        p,
        "--cni-bin-dir",
        metavar="DIR[,...]",
        help="where the CNI plugins are (default /usr/lib/cni, then /opt/cni/bin)",
    )
    add_flag(
        p,
        "--containerd-socket",
        metavar="PATH",
        help="containerd's socket for the containerd driver (/run/containerd/containerd.sock)",
    )
    add_flag(
        p,
        "--containerd-logs",
        metavar="writer|file",
        help="how containers' output reaches their logs: writer (stdout and stderr apart, via"
        " a log writer containerd's shim starts on the host with this agent's Python; the"
        " default) or file (containerd's own file logging, the two interleaved: for an agent"
        " in a container of its own)",
    )
    add_flag(
        p,
        "--libvirt-uri",
        metavar="URI",
        help="libvirt connection for the libvirt driver (default qemu:///system)",
    )
    add_flag(
        p,
        "--containerd-cgroup-parent",
        metavar="PATH",
        help="cgroup under which the containerd driver puts containers (default /orka)",
    )
    add_flag(
        p,
        "--secret-dir",
        metavar="DIR[,...]",
        help="directories whose files workloads may name in secretEnvFiles (default: none)",
    )
    add_flag(
        p,
        "--libvirt-domain-type",
        default="auto",
        metavar="|".join(DOMAIN_TYPES),
        help="libvirt domain type: kvm, qemu (TCG, no hardware virtualisation) or auto "
        "(kvm when /dev/kvm is usable)",
    )
    p.set_defaults(func=cmd_agent)
