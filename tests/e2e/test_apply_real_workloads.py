"""End to end with real runtimes: a container (containerd) and a VM (libvirt) through `orka apply`.

Scheduler, controller and one agent (`--runtime containerd,libvirt,process`) run as separate OS
processes; the test then acts as a user would: manifest files, `orka apply -f FILE --wait`,
`orka get instances -o json`, `orka delete workload NAME --wait`, each a `python -m orka.cli.main`
subprocess. containerd is the session daemon of our own (tests/containerd_env.py), libvirt the
system daemon with a Debian cloud kernel and a busybox initramfs (tests/libvirt_env.py), booted
under TCG (`--libvirt-domain-type qemu`). `ctr` and `virsh` witness what is left after delete.

Figures (apply→RUNNING, apply→guest marker) are printed, never asserted on (run with -s).
Skipped only when containerd/runc or libvirt/QEMU/busybox are missing; `.ci/run` installs them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from orka.api import controller_pb2 as pb
from orka.runtime.libvirt import domain_name
from tests.containerd_env import Containerd, needs_containerd
from tests.e2e.procs import ProcessCluster, nodes_ready
from tests.e2e.procs import run_orka as orka
from tests.integration.cluster import eventually
from tests.libvirt_env import DOMAIN_TYPE, MARKER, RUN, Guest, LibvirtDaemons, needs_libvirt
from tests.netenv import scrub_agent
from tests.ports import http_get

pytestmark = [
    pytest.mark.e2e,
    needs_containerd,
    needs_libvirt,
    pytest.mark.skipif(shutil.which("virsh") is None, reason="virsh missing (libvirt-clients)"),
    pytest.mark.timeout(600),
]

NODE = "node-1"
CONTAINER_MARKER = "orka-e2e-container-hello"
BOOT_TIMEOUT = 180.0  # TCG on a busy two-core machine: generous, never asserted on
CLI_TIMEOUT = 240.0


@pytest.fixture
async def cluster(
    certs_dir: Path,
    tmp_path: Path,
    containerd: Containerd,
    libvirt_daemons: LibvirtDaemons,
    guest: Guest,
) -> AsyncIterator[ProcessCluster]:
    c = ProcessCluster(certs_dir, tmp_path, runtime="containerd,libvirt,process")
    # The archive and the guest's files live in test dirs; the agent must allow them.
    allowed = {*containerd.allowed_paths(), guest.kernel.parent, guest.initrd.parent}
    c.start_scheduler()
    c.start_controller()
    c.start_agent(
        NODE,
        *containerd.agent_flags(),
        "--host-ip",
        "127.0.0.1",
        "--libvirt-uri",
        libvirt_daemons.uri,
        "--libvirt-domain-type",
        DOMAIN_TYPE,
        "--allowed-paths",
        ",".join(str(p) for p in sorted(allowed)),
    )
    await c.connect()
    try:
        await eventually(lambda: nodes_ready(c, [NODE]), timeout=60)
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()
        # A killed agent leaves its containers and domains running by design (re-adoption),
        # and with them their namespaces, forwarding rules and the agent's bridge.
        containerd.clean_namespace()
        libvirt_daemons.cleanup_domains()
        scrub_agent(NODE, tmp_path / "agents" / NODE)


async def instances(c: ProcessCluster, workload: str) -> list[dict[str, Any]]:
    text = await orka(c, "get", "instances", "--workload", workload, "-o", "json")
    return [i for i in json.loads(text) if i["workload"] == workload]


async def apply_and_time(
    c: ProcessCluster, manifest: Path, workload: str, then: Callable[[str], Awaitable[Any]]
) -> tuple[str, float, float, float]:
    """`orka apply -f manifest --wait` while watching the API (every 20 ms) for the instance to
    run and then for `then(instance)`; returns (instance, to RUNNING, to `then`, apply's own
    wall time), all from the moment apply was launched."""
    t0 = time.monotonic()
    apply = asyncio.create_task(
        orka(c, "apply", "-f", str(manifest), "--wait", timeout=CLI_TIMEOUT)
    )

    async def one_running() -> str | None:
        running = await c.running(workload)
        return running[0].name if len(running) == 1 else None

    try:
        instance = await eventually(one_running, timeout=BOOT_TIMEOUT, interval=0.02)
        to_running = time.monotonic() - t0
        await then(instance)
        to_then = time.monotonic() - t0
        out = await apply
        apply_wall = time.monotonic() - t0
    finally:
        if not apply.done():
            apply.cancel()
    assert f"workload/{workload} created" in out, out
    assert f"workload/{workload} ready: 1/1 running" in out, out
    return instance, to_running, to_then, apply_wall


async def http_contains(host: str, port: int, text: str, timeout: float) -> None:
    """Wait until GET / at host:port answers with a page containing `text`."""

    async def check() -> bool:
        try:
            _, body = await asyncio.to_thread(http_get, host, port, "/", 2.0)
        except (OSError, ValueError, IndexError):
            return False
        return text in body.decode(errors="replace")

    await eventually(check, timeout=timeout, interval=0.02)


async def file_shows(path: Path, text: str, timeout: float) -> None:
    async def check() -> bool:
        try:
            content = await asyncio.to_thread(path.read_text, errors="replace")
        except FileNotFoundError:
            return False
        return text in content

    await eventually(check, timeout=timeout, interval=0.1)


def virsh_domains(uri: str) -> list[str]:
    out = subprocess.run(
        ["virsh", "-c", uri, "list", "--all", "--name"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return out.split()


async def test_container_and_vm_through_orka_apply(
    cluster: ProcessCluster,
    tmp_path: Path,
    containerd: Containerd,
    libvirt_daemons: LibvirtDaemons,
    guest: Guest,
) -> None:
    agent_data = tmp_path / "agents" / NODE
    box, vm = f"box-{RUN}", f"vm-{RUN}"

    # ---- a container from an OCI archive built by the test (no registry), serving HTTP ----
    box_file = tmp_path / "box.yaml"
    box_file.write_text(
        f"""name: {box}
kind: container
image: {containerd.image}
command: ["sh", "-c", "echo {CONTAINER_MARKER} from $ORKA_INSTANCE; mkdir -p /www; \
echo hello from $ORKA_INSTANCE > /www/index.html; exec httpd -f -p 8080 -h /www"]
replicas: 1
resources: {{cpu: 100m, memory: 32Mi}}
restartPolicy: Always
stopGracePeriod: 5s
ports:
  - {{name: http, port: 8080}}
"""
    )
    box_log: list[Path] = []

    async def container_answers(instance: str) -> None:
        log = agent_data / "runtime" / "containerd" / "instances" / instance / "stdout.log"
        box_log.append(log)
        (inst,) = await cluster.running(box)
        await http_contains(inst.address, 8080, f"hello from {instance}", timeout=60)

    box_inst, box_running, box_answered, box_apply = await apply_and_time(
        cluster, box_file, box, container_answers
    )
    print(
        f"\ncontainer: apply→RUNNING {box_running:.2f}s, apply→first HTTP answer at its address"
        f" {box_answered:.2f}s (`orka apply --wait` returned after {box_apply:.2f}s)"
    )
    assert box_inst in containerd.ids("containers", "ls", "-q")
    assert box_inst in containerd.ids("tasks", "ls", "-q")
    await file_shows(box_log[0], f"{CONTAINER_MARKER} from {box_inst}", timeout=30)
    (before,) = await cluster.running(box)
    (binding,) = before.ports
    assert (binding.name, binding.port) == ("http", 8080) and binding.host_port > 0
    assert before.host_ip == "127.0.0.1"
    await http_contains("127.0.0.1", binding.host_port, f"hello from {box_inst}", timeout=30)

    # ---- a VM booted straight from a kernel and initramfs ----
    vm_file = tmp_path / "vm.yaml"
    vm_file.write_text(
        f"""name: {vm}
kind: vm
vm:
  kernel: {guest.kernel}
  initrd: {guest.initrd}
  cmdline: {guest.cmdline(httpd_port=8080 if guest.networking else None)}
replicas: 1
resources: {{cpu: 500m, memory: 128Mi}}
restartPolicy: Always
stopGracePeriod: 1s
"""
        + ("ports:\n  - {name: http, port: 8080}\n" if guest.networking else "")
    )
    console_log: list[Path] = []

    async def guest_spoke(instance: str) -> None:
        console = agent_data / "runtime" / "libvirt" / "instances" / instance / "console.log"
        console_log.append(console)
        # Only the guest knows its kernel release: this line comes from inside the VM.
        await file_shows(console, f"{MARKER} kernel=6.", timeout=BOOT_TIMEOUT)

    vm_inst, vm_running, vm_marker, vm_apply = await apply_and_time(
        cluster, vm_file, vm, guest_spoke
    )
    print(
        f"VM: apply→RUNNING {vm_running:.2f}s, apply→guest marker {vm_marker:.2f}s"
        f" (`orka apply --wait` returned after {vm_apply:.2f}s)"
    )
    assert domain_name(vm_inst) in virsh_domains(libvirt_daemons.uri)
    vm_before: pb.Instance | None = None
    if guest.networking:
        # The guest's page names its address: the answer comes from inside this VM.
        (vm_before,) = await cluster.running(vm)
        t = time.monotonic()
        page = f"{MARKER} kernel=6."
        await http_contains(vm_before.address, 8080, page, timeout=BOOT_TIMEOUT)
        await http_contains(vm_before.address, 8080, f"ip={vm_before.address}/", timeout=10)
        await http_contains(
            "127.0.0.1", vm_before.ports[0].host_port, f"ip={vm_before.address}/", timeout=30
        )
        print(f"VM: guest marker→first HTTP answer at its address {time.monotonic() - t:.2f}s")

    # ---- the agent SIGKILLed and started again: same addresses, same host ports, serving ----
    agent = cluster.services[NODE]
    agent.signal(signal.SIGKILL)
    await asyncio.to_thread(agent.wait)
    await http_contains(before.address, 8080, f"hello from {box_inst}", timeout=10)
    agent.start()

    async def readopted() -> pb.Instance | None:
        running = await cluster.running(box)
        again = [i for i in running if i.name == box_inst and i.ports]
        nodes = await cluster.nodes()
        return again[0] if again and nodes.get(NODE) == pb.Node.READY else None

    after = await eventually(readopted, timeout=60, interval=0.2)
    assert (after.address, list(after.ports)) == (before.address, list(before.ports))
    await http_contains(before.address, 8080, f"hello from {box_inst}", timeout=30)
    await http_contains("127.0.0.1", binding.host_port, f"hello from {box_inst}", timeout=30)
    if vm_before is not None:
        (vm_after,) = await cluster.running(vm)
        assert (vm_after.name, vm_after.address, list(vm_after.ports)) == (
            vm_before.name,
            vm_before.address,
            list(vm_before.ports),
        )
        await http_contains(vm_before.address, 8080, f"ip={vm_before.address}/", timeout=30)

    # ---- both seen by the user as RUNNING, on the one node ----
    listed = json.loads(await orka(cluster, "get", "instances", "-o", "json"))
    phases = {i["name"]: (i["workload"], i["phase"], i["node"]) for i in listed}
    assert phases[box_inst] == (box, "RUNNING", NODE)
    assert phases[vm_inst] == (vm, "RUNNING", NODE)

    # ---- delete: instances gone, container gone from containerd, domain undefined ----
    for name in (box, vm):
        out = await orka(cluster, "delete", "workload", name, "--wait", timeout=CLI_TIMEOUT)
        assert f"workload/{name} deleted" in out, out

    async def box_gone() -> bool:
        return not await instances(cluster, box) and box_inst not in containerd.ids(
            "containers", "ls", "-q"
        )

    async def vm_gone() -> bool:
        return not await instances(cluster, vm) and domain_name(
            vm_inst
        ) not in await asyncio.to_thread(virsh_domains, libvirt_daemons.uri)

    await eventually(box_gone, timeout=60, interval=0.5)
    await eventually(vm_gone, timeout=60, interval=0.5)
    assert box_inst not in containerd.ids("tasks", "ls", "-q")
    assert not box_log[0].parent.exists()
    assert not console_log[0].parent.exists()
