"""The `containerd` driver: real containers through containerd's own gRPC API (v1, containerd 1.6).

Everything goes over containerd's socket (`grpc.aio`, namespace `orka` in the
`containerd-namespace` metadata), with our own minimal protos (`proto/containerd/`):

- **Images.** `oci-archive:/path.tar` is imported by the driver itself: the archive's blobs are
  streamed into the content store (`Content.Write`, with containerd's gc labels on manifests
  and indexes so children stay alive), then the image is recorded (`Images.Create`) under the
  name the archive's index gives it. Any other image is looked up by its normalised reference
  (`Images.Get`); when absent it is pulled with `ctr images pull` — the one step that shells
  out, because a registry client (auth, manifests, retries) is far more than the gRPC API
  offers in 1.6 (the transfer service only exists from containerd 2.0).
- **Unpack.** Each layer is applied onto a snapshot named by its chain id (`Snapshots.Prepare`,
  `Diff.Apply`, `Snapshots.Commit`), skipped when already committed; the image config is
  labelled `containerd.io/gc.ref.snapshot.<snapshotter>` so the unpacked layers live as long as
  the image. All of it runs under a short lease so the garbage collector cannot take a
  half-imported blob or layer.
- **Run.** A snapshot per instance (`Prepare`, key = instance), a container carrying an OCI
  runtime spec we build ourselves (`orka.runtime.oci.build_spec`: command, env, cwd, cgroups
  path, memory limit, CPU quota) and the labels `orka.instance` / `orka.workload`, then a task
  whose output goes to containerd's `binary://` logging driver: the shim runs our log writer
  (`orka.runtime.logwriter`, through a launcher script in the data dir) with the task's stdout
  and stderr on two pipes, and it appends them to `<data_dir>/instances/<instance>/stdout.log`
  and `stderr.log`. (`file://` would interleave them: the runc v2 shim of containerd 1.6 opens
  only the stdout URI of a `file://` task.) The writer belongs to the shim and keeps writing
  with no agent around, which FIFOs would not allow. The agent rotates the files
  (orka.runtime.logs).
- **Network.** With the node's instance network (`orka.runtime.network`), each container
  joins a namespace of its own on the bridge (the spec's network namespace is its path), with
  an address and its host ports mapped; remove gives both back (CNI DEL). Re-adoption reads
  them from the network's records. Without a network, or where the host cannot have one, a
  container has loopback only and one asking for ports is refused at admission.
  `Tasks.Wait` is awaited per task; exit codes come from it.
- **Stop.** `Tasks.Kill` SIGTERM, then SIGKILL (to every process) after the grace period.
  **Remove.** `Tasks.Delete`, `Containers.Delete`, `Snapshots.Remove`, and the log directory.
- **Restart of the agent.** Nothing is kept on disk but logs: a new driver finds its containers
  with `Containers.List` and a label filter, asks `Tasks.Get` for their state (a stopped task
  keeps its exit status in containerd until deleted) and waits on the running ones again.
- **Usage.** Read from the task's cgroup files (v2 `memory.current`/`cpu.stat`, or v1
  `memory.usage_in_bytes`/`cpuacct.usage`) rather than `Tasks.Metrics`: the metrics come as
  typeurl `Any`s of the cgroups stats protos, which we would have to declare as well, while the
  cgroup path is one we chose.

The snapshotter is `auto` by default: overlayfs when containerd loaded it, native otherwise
(overlayfs is unavailable in some sandboxes and nested containers).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import tarfile
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import grpc
import structlog
from google.protobuf import any_pb2, empty_pb2, field_mask_pb2

from orka.api.containerd.services.containers.v1 import containers_pb2 as cpb
from orka.api.containerd.services.containers.v1 import containers_pb2_grpc as cgrpc
from orka.api.containerd.services.content.v1 import content_pb2 as ctpb
from orka.api.containerd.services.content.v1 import content_pb2_grpc as ctgrpc
from orka.api.containerd.services.diff.v1 import diff_pb2 as dpb
from orka.api.containerd.services.diff.v1 import diff_pb2_grpc as dgrpc
from orka.api.containerd.services.images.v1 import images_pb2 as ipb
from orka.api.containerd.services.images.v1 import images_pb2_grpc as igrpc
from orka.api.containerd.services.introspection.v1 import introspection_pb2 as inpb
from orka.api.containerd.services.introspection.v1 import introspection_pb2_grpc as ingrpc
from orka.api.containerd.services.leases.v1 import leases_pb2 as lpb
from orka.api.containerd.services.leases.v1 import leases_pb2_grpc as lgrpc
from orka.api.containerd.services.snapshots.v1 import snapshots_pb2 as spb
from orka.api.containerd.services.snapshots.v1 import snapshots_pb2_grpc as sgrpc
from orka.api.containerd.services.tasks.v1 import tasks_pb2 as tpb
from orka.api.containerd.services.tasks.v1 import tasks_pb2_grpc as tgrpc
from orka.api.containerd.services.version.v1 import version_pb2_grpc as vgrpc
from orka.api.containerd.types import descriptor_pb2 as descpb
from orka.api.containerd.types.task import task_pb2 as taskpb
from orka.errors import AlreadyExists, Conflict, Invalid, NotFound, RuntimeFailure
from orka.models import WorkloadKind, WorkloadSpec
from orka.runtime import logwriter, oci
from orka.runtime.base import (
    Attachment,
    DriverHealth,
    InstanceNetwork,
    RunSpec,
    TaskInfo,
    TrackedTask,
    TrackingDriver,
    Usage,
    cancel_watchers,
    check_instance,
    exit_message,
    network_refusal,
    terminate,
    usable_network,
)
from orka.runtime.containerd_exec import ContainerdExec
from orka.runtime.execs import ExecHandle, ExecOptions

log = structlog.get_logger(__name__)

DEFAULT_SOCKET = "/run/containerd/containerd.sock"
DEFAULT_NAMESPACE = "orka"
DEFAULT_RUNTIME = "io.containerd.runc.v2"
ARCHIVE_PREFIX = "oci-archive:"
LABEL_INSTANCE = "orka.instance"
LABEL_WORKLOAD = "orka.workload"
LABEL_STARTED = "orka.started-at"
SNAPSHOTTER_PLUGIN = "io.containerd.snapshotter.v1"
# containerd's own limit on container ids (identifiers.Validate).
_MAX_ID = 76
_CHUNK = 1 << 20
_KILL_TIMEOUT = 10.0
_LEASE_TTL = dt.timedelta(hours=1)
_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(eq=False, kw_only=True)
class _Task(TrackedTask):
    driver: ClassVar[str] = "containerd"

    snapshotter: str
    killed: bool = False
    # (cpu seconds, wall time) of the previous usage sample, to turn a counter into a rate.
    cpu_sample: tuple[float, float] | None = None


@dataclass(frozen=True)
class _Image:
    name: str
    config_digest: str
    config: dict[str, Any]
    chain: list[str]


def _code(err: grpc.aio.AioRpcError) -> grpc.StatusCode:
    return err.code()


def _ts(stamp: Any) -> float | None:
    seconds = stamp.seconds + stamp.nanos / 1e9
    # containerd sends the zero time (year 1) for "not exited"; both mean "unknown" here.
    return seconds if seconds > 0 else None


# How a container's output reaches its log files (the `logs` option, `--containerd-logs`).
LOG_MODES = ("writer", "file")


class ContainerdDriver(TrackingDriver[_Task]):
    name: ClassVar[str] = "containerd"

    def __init__(
        self,
        data_dir: Path,
        socket: str = DEFAULT_SOCKET,
        namespace: str = DEFAULT_NAMESPACE,
        snapshotter: str = "auto",
        runtime: str = DEFAULT_RUNTIME,
        cgroup_parent: str = "/orka",
        ctr: str = "ctr",
        rpc_timeout: float = 30.0,
        pull_timeout: float = 600.0,
        network: InstanceNetwork | None = None,
        logs: str = "writer",
    ) -> None:
        if logs not in LOG_MODES:
            raise Invalid(f"containerd logs: {logs!r} is not one of {', '.join(LOG_MODES)}")
        # "writer": stdout and stderr apart, through the log writer the shim starts (it runs on
        # containerd's host, so the agent's Python must be there at the same path). "file":
        # containerd's own file:// logging, for an agent in a container of its own (compose):
        # one file, stdout and stderr interleaved.
        self._logs = logs
        self._root = Path(data_dir).resolve() / "instances"
        self.socket = socket
        self.namespace = namespace
        self._snapshotter: str | None = None if snapshotter == "auto" else snapshotter
        self.runtime = runtime
        self.cgroup_parent = "/" + cgroup_parent.strip("/")
        self._ctr = ctr
        self._timeout = rpc_timeout
        self._pull_timeout = pull_timeout
        self._channel: grpc.aio.Channel | None = None
        self._tasks: dict[str, _Task] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # One import/unpack per image at a time; replicas starting together share the work.
        self._image_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._closed = False
        # The node's instance network: each container joins a namespace of its own on it.
        # None: containers keep a namespace with loopback only (and ports are refused).
        self._network = network
        self._warned_loopback = False

    # -- connection --------------------------------------------------------------------------

    def _chan(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket}",
                options=[
                    ("grpc.max_receive_message_length", 16 << 20),
                    ("grpc.max_send_message_length", 16 << 20),
                ],
            )
        return self._channel

    def _md(self, lease: str | None = None) -> tuple[tuple[str, str], ...]:
        md: tuple[tuple[str, str], ...] = (("containerd-namespace", self.namespace),)
        if lease:
            md += (("containerd-lease", lease),)
        return md

    def _containers(self) -> cgrpc.ContainersStub:
        return cgrpc.ContainersStub(self._chan())

    def _task_api(self) -> tgrpc.TasksStub:
        return tgrpc.TasksStub(self._chan())

    def _snapshots(self) -> sgrpc.SnapshotsStub:
        return sgrpc.SnapshotsStub(self._chan())

    # -- interface ---------------------------------------------------------------------------

    async def health(self) -> DriverHealth:
        kinds = [WorkloadKind.CONTAINER]
        if not await asyncio.to_thread(os.path.exists, self.socket):
            return DriverHealth(
                healthy=False, message=f"containerd socket {self.socket} not found", kinds=kinds
            )
        try:
            version = await vgrpc.VersionStub(self._chan()).Version(
                empty_pb2.Empty(), timeout=min(self._timeout, 5.0)
            )
            snapshotter = await self._resolve_snapshotter()
        except grpc.aio.AioRpcError as err:
            return DriverHealth(
                healthy=False,
                message=f"containerd at {self.socket} does not answer: {err.details()}",
                kinds=kinds,
            )
        except RuntimeFailure as err:
            return DriverHealth(healthy=False, message=err.message, kinds=kinds)
        try:
            await asyncio.to_thread(self._root.mkdir, parents=True, exist_ok=True)
        except OSError as exc:
            return DriverHealth(healthy=False, message=f"data dir: {exc}", kinds=kinds)
        log.debug("containerd.healthy", version=version.version, snapshotter=snapshotter)
        return DriverHealth(healthy=True, kinds=kinds)

    def admit(self, spec: WorkloadSpec) -> str | None:
        return network_refusal(self._network) if spec.ports else None

    async def start(self, run: RunSpec) -> TaskInfo:
        instance = check_instance(run.instance)
        if len(instance) > _MAX_ID:
            raise RuntimeFailure(f"containerd: instance name {instance!r} is over {_MAX_ID} chars")
        async with self._locks[instance]:
            existing = await self._lookup(instance)
            if existing is not None:
                if not existing.done.is_set():
                    raise AlreadyExists(f"containerd: instance {instance!r} is already running")
                # A restart of an exited instance: clear the old container, keep the logs and
                # the network (the same address and host ports; its namespace outlives it).
                await self._delete(
                    instance, existing.snapshotter, keep_logs=True, keep_network=True
                )
            snapshotter = await self._resolve_snapshotter()
            started = time.monotonic()
            task = await self._create_and_start(run, snapshotter)
            log.info(
                "containerd.started",
                instance=instance,
                pid=task.pid,
                image=run.spec.image,
                seconds=round(time.monotonic() - started, 3),
            )
            return task.info()

    async def list(self) -> list[TaskInfo]:
        resp = await self._containers().List(
            cpb.ListContainersRequest(filters=[f'labels."{LABEL_INSTANCE}"']),
            metadata=self._md(),
            timeout=self._timeout,
        )
        for container in resp.containers:
            if container.id not in self._tasks:
                await self._adopt(container)
        return [task.info() for task in self._tasks.values()]

    async def usage(self, instance: str) -> Usage:
        task = await self._require(instance)
        if task.done.is_set():
            return Usage()
        mem, cpu_seconds = await asyncio.to_thread(self._read_cgroup, instance)
        now = time.monotonic()
        millis = 0
        if cpu_seconds is not None:
            if task.cpu_sample is not None:
                prev_cpu, prev_at = task.cpu_sample
                if now > prev_at:
                    millis = max(0, int((cpu_seconds - prev_cpu) / (now - prev_at) * 1000))
            task.cpu_sample = (cpu_seconds, now)
        return Usage(cpu_millis=millis, memory_bytes=mem or 0)

    def log_paths(self, instance: str) -> tuple[Path, Path]:
        task_dir = self._root / check_instance(instance)
        return task_dir / "stdout.log", task_dir / "stderr.log"

    async def exec(self, instance: str, spec: WorkloadSpec, options: ExecOptions) -> ExecHandle:
        task = await self._require(instance)
        if task.done.is_set():
            raise Conflict(f"containerd: instance {instance!r} is not running")
        return await ContainerdExec.start(
            self._containers(),
            self._task_api(),
            self._md(),
            instance,
            self._root / instance,
            options,
        )

    def _log_uri(self, instance: str) -> str:
        """Where the task's output goes: the `binary://` URI of the log writer's launcher
        (written on first use), or in "file" mode its stdout.log."""
        if self._logs == "file":
            return (self._root / instance / "stdout.log").as_uri()
        launcher = self._root.parent / "logwriter"
        script = logwriter.launcher_script(self._root)
        try:
            current = launcher.read_text()
        except OSError:
            current = ""
        if current != script:
            tmp = launcher.with_name("logwriter.tmp")
            tmp.write_text(script)
            tmp.chmod(0o700)
            os.replace(tmp, launcher)
        return f"binary://{launcher}"

    async def close(self) -> None:
        """Stop watching; containers keep running so that the next agent re-adopts them."""
        if self._closed:
            return
        self._closed = True
        await cancel_watchers(self._tasks.values())
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # -- helpers tests and operators use -----------------------------------------------------

    def cgroups_path(self, instance: str) -> str:
        """The cgroup (relative to each hierarchy's root) the instance's processes live in."""
        return f"{self.cgroup_parent}/{instance}"

    async def snapshotter(self) -> str:
        return await self._resolve_snapshotter()

    # -- start -------------------------------------------------------------------------------

    async def _connect(self, run: RunSpec) -> Attachment | None:
        """A namespace of its own on the node's bridge; loopback only without a network."""
        network, why = usable_network(self._network, run.spec, "containerd")
        if network is None:
            if why and not self._warned_loopback:
                self._warned_loopback = True
                log.warning("containerd.loopback_only", reason=why)
            return None
        return await network.attach_netns(run.instance, run.spec.ports)

    async def _disconnect(self, instance: str) -> None:
        if self._network is not None and self._network.attachment(instance) is not None:
            await self._network.detach(instance)

    async def _create_and_start(self, run: RunSpec, snapshotter: str) -> _Task:
        image = await self._ensure_image(run.spec.image, snapshotter)
        attachment = await self._connect(run)
        try:
            return await self._create_task(run, snapshotter, image, attachment)
        except BaseException:
            # A start that failed half-way gives back its address and host ports.
            with contextlib.suppress(Exception):
                await self._disconnect(run.instance)
            raise

    async def _create_task(
        self, run: RunSpec, snapshotter: str, image: _Image, attachment: Attachment | None
    ) -> _Task:
        instance = run.instance
        netns = attachment.netns if attachment else ""
        spec = oci.build_spec(run, image.config, self.cgroups_path(instance), netns)
        task_dir = self._root / instance
        await asyncio.to_thread(task_dir.mkdir, parents=True, exist_ok=True)
        log_uri = await asyncio.to_thread(self._log_uri, instance)
        # /etc/hostname names the container, as Docker's and Kubernetes' do.
        hostname = task_dir / "hostname"
        await asyncio.to_thread(hostname.write_text, f"{spec.get('hostname') or instance}\n")
        spec.setdefault("mounts", []).append(
            {
                "destination": "/etc/hostname",
                "type": "bind",
                "source": str(hostname),
                "options": ["rbind", "ro"],
            }
        )
        started_at = time.time()
        container = cpb.Container(
            id=instance,
            labels={
                LABEL_INSTANCE: instance,
                LABEL_WORKLOAD: run.workload,
                LABEL_STARTED: repr(started_at),
            },
            image=image.name,
            runtime=cpb.Container.Runtime(name=self.runtime),
            spec=any_pb2.Any(type_url=oci.SPEC_TYPE_URL, value=json.dumps(spec).encode()),
            snapshotter=snapshotter,
            snapshot_key=instance,
        )
        try:
            # The lease keeps the fresh snapshot alive until the container refers to it.
            async with self._lease() as lease:
                prepared = await self._snapshots().Prepare(
                    spb.PrepareSnapshotRequest(
                        snapshotter=snapshotter, key=instance, parent=image.chain[-1]
                    ),
                    metadata=self._md(lease),
                    timeout=self._timeout,
                )
                await self._containers().Create(
                    cpb.CreateContainerRequest(container=container),
                    metadata=self._md(lease),
                    timeout=self._timeout,
                )
            created = await self._task_api().Create(
                tpb.CreateTaskRequest(
                    container_id=instance,
                    rootfs=list(prepared.mounts),
                    stdout=log_uri,
                    stderr=log_uri,
                ),
                metadata=self._md(),
                timeout=self._timeout,
            )
            await self._task_api().Start(
                tpb.StartRequest(container_id=instance), metadata=self._md(), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as err:
            # Leave nothing half-made behind: the next start would trip over it.
            with contextlib.suppress(Exception):
                await self._delete(instance, snapshotter, keep_logs=True)
            raise RuntimeFailure(
                f"containerd: cannot start {instance!r} from image {run.spec.image!r}: "
                f"{err.details()}"
            ) from None
        task = _Task(
            instance=instance,
            workload=run.workload,
            snapshotter=snapshotter,
            started_at=started_at,
            pid=created.pid,
            address=attachment.address if attachment else "",
            ports=list(attachment.ports) if attachment else [],
        )
        self._tasks[instance] = task
        task.watcher = asyncio.create_task(self._watch(task), name=f"watch-{instance}")
        return task

    async def _resolve_snapshotter(self) -> str:
        if self._snapshotter is not None:
            return self._snapshotter
        resp = await ingrpc.IntrospectionStub(self._chan()).Plugins(
            inpb.PluginsRequest(filters=[f"type=={SNAPSHOTTER_PLUGIN}"]),
            metadata=self._md(),
            timeout=min(self._timeout, 5.0),
        )
        loaded = {p.id for p in resp.plugins if not p.HasField("init_err")}
        for candidate in ("overlayfs", "native"):
            if candidate in loaded:
                self._snapshotter = candidate
                log.info("containerd.snapshotter", snapshotter=candidate)
                return candidate
        raise RuntimeFailure(
            f"containerd: neither the overlayfs nor the native snapshotter is loaded "
            f"(loaded: {', '.join(sorted(loaded)) or 'none'})"
        )

    @contextlib.asynccontextmanager
    async def _lease(self) -> AsyncIterator[str]:
        """A lease that expires on its own, in case we die before deleting it."""
        expire = dt.datetime.now(dt.UTC) + _LEASE_TTL
        lease_id = f"orka-{uuid.uuid4().hex[:16]}"
        leases = lgrpc.LeasesStub(self._chan())
        await leases.Create(
            lpb.CreateRequest(
                id=lease_id,
                labels={"containerd.io/gc.expire": expire.strftime("%Y-%m-%dT%H:%M:%SZ")},
            ),
            metadata=self._md(),
            timeout=self._timeout,
        )
        try:
            yield lease_id
        finally:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await leases.Delete(
                    lpb.DeleteRequest(id=lease_id), metadata=self._md(), timeout=self._timeout
                )

    # -- images ------------------------------------------------------------------------------

    async def _ensure_image(self, image: str, snapshotter: str) -> _Image:
        async with self._image_locks[image]:
            try:
                async with self._lease() as lease:
                    if image.startswith(ARCHIVE_PREFIX):
                        name = await self._import_archive(image, lease)
                    else:
                        name = await self._find_or_pull(image)
                    return await self._unpack(image, name, snapshotter, lease)
            except grpc.aio.AioRpcError as err:
                raise RuntimeFailure(
                    f"containerd: image {image!r} could not be prepared: {err.details()}"
                ) from None

    async def _find_or_pull(self, image: str) -> str:
        name = oci.normalize_ref(image)
        try:
            await igrpc.ImagesStub(self._chan()).Get(
                ipb.GetImageRequest(name=name), metadata=self._md(), timeout=self._timeout
            )
            return name
        except grpc.aio.AioRpcError as err:
            if _code(err) != grpc.StatusCode.NOT_FOUND:
                raise
        await self._pull(image, name)
        return name

    async def _pull(self, image: str, name: str) -> None:
        """`ctr images pull`: containerd 1.6 has no gRPC pull (see the module docstring)."""
        ctr = await asyncio.to_thread(shutil.which, self._ctr)
        if ctr is None:
            raise RuntimeFailure(
                f"containerd: image {image!r} is not present and {self._ctr!r} (needed to pull)"
                " is not installed; import it as oci-archive: instead"
            )
        argv = [ctr, "-a", self.socket, "-n", self.namespace, "images", "pull", name]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(self._pull_timeout):
                _, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeFailure(
                f"containerd: pulling image {image!r} took over {self._pull_timeout:g}s"
            ) from None
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            raise RuntimeFailure(
                f"containerd: image {image!r} not found or not pullable: "
                f"{lines[-1] if lines else f'ctr exited with {proc.returncode}'}"
            )

    async def _import_archive(self, image: str, lease: str) -> str:
        path = Path(image.removeprefix(ARCHIVE_PREFIX))
        try:
            layout = await asyncio.to_thread(_read_layout, path)
        except FileNotFoundError:
            raise RuntimeFailure(f"containerd: image {image!r}: {path} not found") from None
        except (OSError, tarfile.TarError, ValueError, KeyError) as exc:
            raise RuntimeFailure(
                f"containerd: image {image!r} is not an OCI image archive: {exc}"
            ) from None
        entry = oci.select_manifest(layout.index, image)
        annotations = entry.get("annotations") or {}
        tag = annotations.get("org.opencontainers.image.ref.name") or "latest"
        name = annotations.get("io.containerd.image.name") or f"import.orka.local/{path.stem}:{tag}"

        # Children before parents, so a parent's gc labels never point at missing content.
        await self._write_tree(layout, entry, lease, image)
        target = descpb.Descriptor(
            media_type=entry["mediaType"], digest=entry["digest"], size=int(entry["size"])
        )
        images = igrpc.ImagesStub(self._chan())
        record = ipb.Image(name=name, target=target)
        try:
            await images.Create(
                ipb.CreateImageRequest(image=record),
                metadata=self._md(lease),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as err:
            if _code(err) != grpc.StatusCode.ALREADY_EXISTS:
                raise
            current = await images.Get(
                ipb.GetImageRequest(name=name), metadata=self._md(), timeout=self._timeout
            )
            if current.image.target.digest != target.digest:
                # The archive was rebuilt: point the name at its new content.
                await images.Delete(
                    ipb.DeleteImageRequest(name=name), metadata=self._md(), timeout=self._timeout
                )
                await images.Create(
                    ipb.CreateImageRequest(image=record),
                    metadata=self._md(lease),
                    timeout=self._timeout,
                )
        log.info("containerd.imported", image=image, name=name, digest=target.digest)
        return name

    async def _write_tree(
        self, layout: _Layout, desc: dict[str, Any], lease: str, image: str
    ) -> None:
        digest = desc["digest"]
        labels: dict[str, str] = {}
        if desc.get("mediaType") in oci.INDEX_TYPES | oci.MANIFEST_TYPES:
            blob = json.loads(await asyncio.to_thread(layout.read, digest))
            children = list(blob.get("manifests", []))
            if "config" in blob:
                children.append(blob["config"])
            children.extend(blob.get("layers", []))
            for child in children:
                if child["digest"] in layout.blobs:
                    await self._write_tree(layout, child, lease, image)
                elif desc.get("mediaType") in oci.MANIFEST_TYPES:
                    raise RuntimeFailure(
                        f"containerd: image {image!r}: blob {child['digest']} missing in archive"
                    )
            labels = oci.gc_labels(blob)
        await self._write_blob(layout, digest, labels, lease)

    async def _write_blob(
        self, layout: _Layout, digest: str, labels: dict[str, str], lease: str
    ) -> None:
        content = ctgrpc.ContentStub(self._chan())
        try:
            await content.Info(
                ctpb.InfoRequest(digest=digest), metadata=self._md(lease), timeout=self._timeout
            )
            return  # already there (an earlier import wrote it, with its labels)
        except grpc.aio.AioRpcError as err:
            if _code(err) != grpc.StatusCode.NOT_FOUND:
                raise
        offset, size = layout.blobs[digest]
        ref = f"orka-import-{digest}-{uuid.uuid4().hex[:8]}"
        call = content.Write(metadata=self._md(lease), timeout=max(self._timeout, 300.0))
        # containerd answers every request on the stream; we keep in lockstep with it.
        written = 0
        f = await asyncio.to_thread(open, layout.path, "rb")
        try:
            while written < size or written == 0:
                chunk = await asyncio.to_thread(_read_at, f, offset + written, size - written)
                await call.write(
                    ctpb.WriteContentRequest(
                        action=ctpb.WRITE,
                        ref=ref,
                        total=size,
                        expected=digest,
                        offset=written,
                        data=chunk,
                    )
                )
                await call.read()
                written += len(chunk)
                if not chunk:
                    break
        finally:
            await asyncio.to_thread(f.close)
        await call.write(
            ctpb.WriteContentRequest(
                action=ctpb.COMMIT,
                ref=ref,
                total=size,
                expected=digest,
                offset=written,
                labels=labels,
            )
        )
        try:
            await call.read()
        except grpc.aio.AioRpcError as err:
            if _code(err) != grpc.StatusCode.ALREADY_EXISTS:
                raise
        await call.done_writing()

    async def _read_blob(self, digest: str, lease: str) -> bytes:
        parts = []
        stream = ctgrpc.ContentStub(self._chan()).Read(
            ctpb.ReadContentRequest(digest=digest), metadata=self._md(lease), timeout=self._timeout
        )
        async for resp in stream:
            parts.append(resp.data)
        return b"".join(parts)

    async def _unpack(self, image: str, name: str, snapshotter: str, lease: str) -> _Image:
        got = await igrpc.ImagesStub(self._chan()).Get(
            ipb.GetImageRequest(name=name), metadata=self._md(), timeout=self._timeout
        )
        desc = got.image.target
        manifest = json.loads(await self._read_blob(desc.digest, lease))
        if desc.media_type in oci.INDEX_TYPES or "manifests" in manifest:
            entry = oci.select_manifest(manifest, image)
            manifest = json.loads(await self._read_blob(entry["digest"], lease))
        config_digest = manifest["config"]["digest"]
        config = json.loads(await self._read_blob(config_digest, lease))
        diff_ids = list(config.get("rootfs", {}).get("diff_ids", []))
        layers = list(manifest.get("layers", []))
        if not diff_ids or len(diff_ids) != len(layers):
            raise RuntimeFailure(f"containerd: image {image!r} has no layers or a bad config")
        chain = oci.chain_ids(diff_ids)
        snaps = self._snapshots()
        for i, (layer, chain_id) in enumerate(zip(layers, chain, strict=True)):
            try:
                await snaps.Stat(
                    spb.StatSnapshotRequest(snapshotter=snapshotter, key=chain_id),
                    metadata=self._md(),
                    timeout=self._timeout,
                )
                continue  # unpacked before
            except grpc.aio.AioRpcError as err:
                if _code(err) != grpc.StatusCode.NOT_FOUND:
                    raise
            await self._apply_layer(
                snapshotter, layer, diff_ids[i], chain_id, chain[i - 1] if i else "", lease
            )
        # Keep the unpacked layers for as long as the image exists (what containerd's own
        # unpacker does), so the next instance of this image starts without unpacking.
        label = f"containerd.io/gc.ref.snapshot.{snapshotter}"
        await ctgrpc.ContentStub(self._chan()).Update(
            ctpb.UpdateRequest(
                info=ctpb.Info(digest=config_digest, labels={label: chain[-1]}),
                update_mask=field_mask_pb2.FieldMask(paths=[f"labels.{label}"]),
            ),
            metadata=self._md(lease),
            timeout=self._timeout,
        )
        return _Image(name=name, config_digest=config_digest, config=config, chain=chain)

    async def _apply_layer(
        self,
        snapshotter: str,
        layer: dict[str, Any],
        diff_id: str,
        chain_id: str,
        parent: str,
        lease: str,
    ) -> None:
        snaps = self._snapshots()
        key = f"orka-extract-{uuid.uuid4().hex[:12]} {chain_id}"
        prepared = await snaps.Prepare(
            spb.PrepareSnapshotRequest(snapshotter=snapshotter, key=key, parent=parent),
            metadata=self._md(lease),
            timeout=self._timeout,
        )
        try:
            applied = await dgrpc.DiffStub(self._chan()).Apply(
                dpb.ApplyRequest(
                    diff=descpb.Descriptor(
                        media_type=layer["mediaType"],
                        digest=layer["digest"],
                        size=int(layer["size"]),
                    ),
                    mounts=list(prepared.mounts),
                ),
                metadata=self._md(lease),
                timeout=max(self._timeout, 300.0),
            )
            if applied.applied.digest != diff_id:
                raise RuntimeFailure(
                    f"containerd: layer {layer['digest']} unpacked to {applied.applied.digest},"
                    f" the image config says {diff_id}"
                )
            await snaps.Commit(
                spb.CommitSnapshotRequest(snapshotter=snapshotter, name=chain_id, key=key),
                metadata=self._md(lease),
                timeout=self._timeout,
            )
        except BaseException as err:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await snaps.Remove(
                    spb.RemoveSnapshotRequest(snapshotter=snapshotter, key=key),
                    metadata=self._md(),
                    timeout=self._timeout,
                )
            # Someone else committed the same layer meanwhile: theirs is as good as ours.
            if isinstance(err, grpc.aio.AioRpcError) and (
                _code(err) == grpc.StatusCode.ALREADY_EXISTS
            ):
                return
            raise

    # -- tracking (the `TrackingDriver` hooks first) -------------------------------------------

    async def _stop_running(self, task: _Task, grace: float) -> None:
        instance = task.instance

        async def kill() -> None:
            task.killed = True
            # all=True: every process of the container, not just its init.
            await self._kill(instance, signal.SIGKILL, all_procs=True)

        await terminate(
            task.done.wait,
            lambda: self._kill(instance, signal.SIGTERM),
            kill,
            grace,
            _KILL_TIMEOUT,
            f"containerd: task {instance!r}",
        )
        log.info("containerd.stopped", instance=instance, exit_code=task.exit_code)

    async def _discard(self, instance: str, task: _Task | None, keep_network: bool) -> None:
        snapshotter = task.snapshotter if task else await self._resolve_snapshotter()
        await self._delete(instance, snapshotter, keep_logs=False, keep_network=keep_network)

    async def _require(self, instance: str) -> _Task:
        task = await self._lookup(check_instance(instance))
        if task is None:
            raise NotFound(f"containerd: no container {instance!r}")
        return task

    async def _lookup(self, instance: str) -> _Task | None:
        task = self._tasks.get(instance)
        if task is not None:
            return task
        try:
            resp = await self._containers().Get(
                cpb.GetContainerRequest(id=instance), metadata=self._md(), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as err:
            if _code(err) == grpc.StatusCode.NOT_FOUND:
                return None
            raise RuntimeFailure(f"containerd: {err.details()}") from None
        if LABEL_INSTANCE not in resp.container.labels:
            return None  # not ours, even though it sits in our namespace
        return await self._adopt(resp.container)

    async def _adopt(self, container: cpb.Container) -> _Task:
        instance = container.id
        if instance in self._tasks:
            return self._tasks[instance]
        try:
            started_at = float(container.labels.get(LABEL_STARTED, ""))
        except ValueError:
            started_at = _ts(container.created_at) or time.time()
        task = _Task(
            instance=instance,
            workload=container.labels.get(LABEL_WORKLOAD, ""),
            snapshotter=container.snapshotter,
            started_at=started_at,
        )
        # Its address and host ports are the network's records (kept across agent restarts).
        attachment = self._network.attachment(instance) if self._network is not None else None
        if attachment is not None:
            task.address = attachment.address
            task.ports = list(attachment.ports)
        try:
            got = await self._task_api().Get(
                tpb.GetRequest(container_id=instance), metadata=self._md(), timeout=self._timeout
            )
            process: taskpb.Process | None = got.process
        except grpc.aio.AioRpcError as err:
            if _code(err) != grpc.StatusCode.NOT_FOUND:
                raise RuntimeFailure(f"containerd: {err.details()}") from None
            process = None
        self._tasks[instance] = task
        if process is None:
            task.message = "container has no task (exit code unknown)"
            task.done.set()
        elif process.status == taskpb.STOPPED:
            task.pid = process.pid
            task.exit_code = process.exit_status
            task.finished_at = _ts(process.exited_at)
            task.message = exit_message(task.exit_code)
            task.done.set()
        elif process.status == taskpb.CREATED:
            # Created but never started (we died in between): it will never run on its own.
            task.pid = process.pid
            task.message = "task was created but never started"
            task.done.set()
        else:
            task.pid = process.pid
            log.info("containerd.adopted", instance=instance, pid=task.pid)
            task.watcher = asyncio.create_task(self._watch(task), name=f"watch-{instance}")
        return task

    async def _watch(self, task: _Task) -> None:
        backoff = 0.2
        while True:
            try:
                # No deadline: Wait returns when the task exits, however long that is.
                resp = await self._task_api().Wait(
                    tpb.WaitRequest(container_id=task.instance), metadata=self._md()
                )
                code: int | None = resp.exit_status
                finished = _ts(resp.exited_at)
                break
            except grpc.aio.AioRpcError as err:
                if _code(err) == grpc.StatusCode.NOT_FOUND:
                    code, finished = None, None
                    break
                # containerd restarting, or the socket briefly gone: its shims keep the task
                # alive, so wait again rather than declare it dead.
                log.warning("containerd.wait_failed", instance=task.instance, error=err.details())
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        task.exit_code = code
        task.finished_at = finished or time.time()
        if task.killed:
            task.message = "killed after the stop grace period"
        elif code is None:
            task.message = "task vanished from containerd; exit code unknown"
        else:
            task.message = exit_message(code)
        task.done.set()
        log.info("containerd.exited", instance=task.instance, exit_code=code)

    async def _kill(self, instance: str, sig: signal.Signals, all_procs: bool = False) -> None:
        try:
            await self._task_api().Kill(
                tpb.KillRequest(container_id=instance, signal=int(sig), all=all_procs),
                metadata=self._md(),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as err:
            # Already exited (NOT_FOUND: "process already finished") is what we wanted.
            if _code(err) not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise RuntimeFailure(f"containerd: kill {instance!r}: {err.details()}") from None

    async def _delete(
        self, instance: str, snapshotter: str, keep_logs: bool, keep_network: bool = False
    ) -> None:
        """Task, container and snapshot, each ignoring "not found" so it is idempotent."""
        task = self._tasks.pop(instance, None)
        if task is not None and task.watcher is not None:
            task.watcher.cancel()
        steps = (
            (self._task_api().Delete, tpb.DeleteTaskRequest(container_id=instance)),
            (self._containers().Delete, cpb.DeleteContainerRequest(id=instance)),
            (
                self._snapshots().Remove,
                spb.RemoveSnapshotRequest(snapshotter=snapshotter, key=instance),
            ),
        )
        for call, request in steps:
            try:
                await call(request, metadata=self._md(), timeout=self._timeout)
            except grpc.aio.AioRpcError as err:
                if _code(err) != grpc.StatusCode.NOT_FOUND:
                    raise RuntimeFailure(
                        f"containerd: removing {instance!r}: {err.details()}"
                    ) from None
        if not keep_network:
            await self._disconnect(instance)
        if not keep_logs:
            await asyncio.to_thread(shutil.rmtree, self._root / instance, True)

    def _read_cgroup(self, instance: str) -> tuple[int | None, float | None]:
        """(memory bytes, cpu seconds) of the container's cgroup, v2 or v1."""
        rel = self.cgroups_path(instance).lstrip("/")
        if (_CGROUP_ROOT / "cgroup.controllers").exists():
            base = _CGROUP_ROOT / rel
            mem = _read_int(base / "memory.current")
            cpu = None
            with contextlib.suppress(OSError, ValueError):
                for line in (base / "cpu.stat").read_text().splitlines():
                    key, _, val = line.partition(" ")
                    if key == "usage_usec":
                        cpu = int(val) / 1e6
            return mem, cpu
        mem = _read_int(_CGROUP_ROOT / "memory" / rel / "memory.usage_in_bytes")
        ns = _read_int(_CGROUP_ROOT / "cpuacct" / rel / "cpuacct.usage")
        return mem, (ns / 1e9 if ns is not None else None)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_at(f: Any, offset: int, remaining: int) -> bytes:
    f.seek(offset)
    return f.read(min(_CHUNK, remaining))


@dataclass
class _Layout:
    """An OCI image layout inside a tar: its index and where each blob's bytes sit."""

    path: Path
    index: dict[str, Any]
    blobs: dict[str, tuple[int, int]]  # digest -> (offset in the tar, size)

    def read(self, digest: str) -> bytes:
        offset, size = self.blobs[digest]
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(size)


def _read_layout(path: Path) -> _Layout:
    """Index the archive without extracting it (runs in a thread: it reads the whole tar)."""
    blobs: dict[str, tuple[int, int]] = {}
    index: dict[str, Any] | None = None
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if not member.isfile():
                continue
            if name == "index.json":
                f = tar.extractfile(member)
                assert f is not None
                index = json.loads(f.read())
            elif name.startswith("blobs/"):
                _, algo, hexdigest = name.split("/", 2)
                blobs[f"{algo}:{hexdigest}"] = (member.offset_data, member.size)
    if index is None:
        raise ValueError("no index.json")
    return _Layout(path=path, index=index, blobs=blobs)
