"""Pure OCI helpers for the containerd driver: image references, manifests, runtime specs.

Nothing here does I/O, so each rule (reference normalisation, platform choice, chain ids, the
runtime spec a workload becomes) is unit-tested on its own.
"""

from __future__ import annotations

import hashlib
import platform
from typing import Any

from orka.errors import RuntimeFailure
from orka.runtime.base import RunSpec

MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MEDIA_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = frozenset({MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST})
MANIFEST_TYPES = frozenset({MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST})

# The type URL containerd's typeurl registry gives the OCI runtime spec (carried as JSON).
SPEC_TYPE_URL = "types.containerd.io/opencontainers/runtime-spec/1/Spec"
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CPU_PERIOD = 100_000
# A hostname is at most 64 bytes; keep it a valid DNS label.
_HOSTNAME_MAX = 63

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}

# The capability set container runtimes (Docker, containerd's default spec) grant by default.
_CAPS = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
]
_MASKED = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
]
_READONLY = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
]


def host_arch() -> str:
    machine = platform.machine()
    return _ARCH.get(machine, machine)


def normalize_ref(ref: str) -> str:
    """Docker-style short names to the full names containerd stores ("busybox" ->
    "docker.io/library/busybox:latest"), since containerd itself does no normalisation."""
    name, at, digest = ref.partition("@")
    first, slash, _ = name.partition("/")
    if not slash or ("." not in first and ":" not in first and first != "localhost"):
        name = f"docker.io/{name}" if slash else f"docker.io/library/{name}"
    last = name.rsplit("/", 1)[-1]
    if not at and ":" not in last:
        name += ":latest"
    return f"{name}@{digest}" if at else name


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The OCI chain id of each layer prefix: how committed snapshots are named and shared."""
    chain: list[str] = []
    for diff_id in diff_ids:
        if not chain:
            chain.append(diff_id)
        else:
            digest = hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest()
            chain.append(f"sha256:{digest}")
    return chain


def select_manifest(index: dict[str, Any], image: str) -> dict[str, Any]:
    """The manifest descriptor of an index that this host can run (linux, our architecture)."""
    entries = [m for m in index.get("manifests", []) if isinstance(m, dict)]
    arch = host_arch()
    for entry in entries:
        plat = entry.get("platform")
        if plat is None:
            continue
        if plat.get("os") == "linux" and plat.get("architecture") == arch:
            return entry
    # An entry without a platform (common in single-image archives) is taken as ours.
    untagged = [m for m in entries if "platform" not in m]
    if untagged:
        return untagged[0]
    raise RuntimeFailure(f"containerd: image {image!r} has no linux/{arch} manifest")


def gc_labels(blob: dict[str, Any]) -> dict[str, str]:
    """containerd's garbage-collection labels for an index or manifest: each child it refers
    to stays alive as long as the parent does."""
    labels: dict[str, str] = {}
    if "manifests" in blob:
        for i, m in enumerate(blob["manifests"]):
            labels[f"containerd.io/gc.ref.content.m.{i}"] = m["digest"]
    if "config" in blob:
        labels["containerd.io/gc.ref.content.config"] = blob["config"]["digest"]
    for i, layer in enumerate(blob.get("layers", [])):
        labels[f"containerd.io/gc.ref.content.l.{i}"] = layer["digest"]
    return labels


def _user(value: str) -> dict[str, int]:
    """Numeric `uid[:gid]` only: names would need the image's /etc/passwd; root otherwise."""
    uid, _, gid = value.partition(":")
    if uid.isdigit() and (not gid or gid.isdigit()):
        return {"uid": int(uid), "gid": int(gid or 0)}
    if value:
        raise RuntimeFailure(f"containerd: image user {value!r} is not numeric (uid[:gid])")
    return {"uid": 0, "gid": 0}


def _merge_env(base: list[str], extra: dict[str, str]) -> list[str]:
    env: dict[str, str] = {}
    for item in base:
        key, _, val = item.partition("=")
        env[key] = val
    env.update(extra)
    return [f"{k}={v}" for k, v in env.items()]


def namespaces(netns: str = "") -> list[dict[str, str]]:
    """Fresh namespaces of every kind, but the network one given by path when the instance
    has its own on the node's bridge (a fresh one has only loopback)."""
    spaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network", "cgroup")]
    if netns:
        spaces[4] = {"type": "network", "path": netns}
    return spaces


def volume_mounts(run: RunSpec) -> list[dict[str, Any]]:
    """A bind mount per volume at its mount_path, read-only when asked (after the standard
    mounts, so a volume may sit under /run)."""
    return [
        {
            "destination": v.mount_path,
            "type": "bind",
            "source": str(v.host_path),
            "options": ["rbind", "nosuid", "nodev", "ro" if v.read_only else "rw"],
        }
        for v in run.volumes
        if v.mount_path
    ]


def build_spec(
    run: RunSpec, image_config: dict[str, Any], cgroups_path: str, netns: str = ""
) -> dict[str, Any]:
    """The OCI runtime spec of one instance: the workload's command, env and limits applied
    over what the image declares, with the usual namespaces, mounts and masked paths."""
    spec = run.spec
    conf = image_config.get("config") or {}
    args = list(spec.command) or [*(conf.get("Entrypoint") or []), *(conf.get("Cmd") or [])]
    if not args:
        raise RuntimeFailure(
            f"containerd: image {spec.image!r} has no entrypoint or cmd and the workload no command"
        )
    env = _merge_env(
        [DEFAULT_PATH, *(conf.get("Env") or [])],
        {"ORKA_INSTANCE": run.instance, "ORKA_WORKLOAD": run.workload, **spec.environment},
    )
    resources: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    if spec.resources.memory_bytes:
        resources["memory"] = {"limit": spec.resources.memory_bytes}
    if spec.resources.cpu_millis:
        # cpu_millis of one CPU per period: 1000m -> a full period of quota.
        resources["cpu"] = {"quota": spec.resources.cpu_millis * 100, "period": CPU_PERIOD}
    caps = list(_CAPS)
    return {
        "ociVersion": "1.0.2-dev",
        "process": {
            "terminal": False,
            "user": _user(str(conf.get("User") or "")),
            "args": args,
            "env": env,
            "cwd": spec.working_dir or conf.get("WorkingDir") or "/",
            "capabilities": {
                "bounding": caps,
                "effective": caps,
                "permitted": caps,
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs"},
        "hostname": run.instance[:_HOSTNAME_MAX].strip(".-_") or "orka",
        "mounts": [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            {
                "destination": "/run",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            *volume_mounts(run),
        ],
        "linux": {
            "namespaces": namespaces(netns),
            "cgroupsPath": cgroups_path,
            "resources": resources,
            "maskedPaths": _MASKED,
            "readonlyPaths": _READONLY,
        },
    }
