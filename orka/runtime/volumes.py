"""Volumes on a node: what a driver is given to mount, and what a backend must do.

The agent's volume manager (orka/agent/volumes.py) provisions each volume an instance uses on
one of the node's backends before the instance starts, then hands the driver a MountedVolume
per volume: a PROCESS gets `host_path` in ORKA_VOLUME_<env_name>, a CONTAINER a bind mount at
`mount_path`, a VM a virtio disk backed by `host_path`. Backends keep everything they need to
find a volume again under their own directory, so an agent that restarts re-adopts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from orka.models import volume_env_key


class MountedVolume(BaseModel):
    """A provisioned volume as a driver mounts it for one instance."""

    model_config = ConfigDict(frozen=True)

    name: str
    backend: str
    # ext4: the directory the volume's file system is mounted on; qcow2: the disk file.
    host_path: Path
    mount_path: str = ""
    read_only: bool = False
    size_bytes: int = 0
    # The name a PROCESS's variable is made from (the volume's, or its template's).
    env_name: str = ""

    @property
    def env_key(self) -> str:
        return volume_env_key(self.env_name or self.name)


class ProvisionedVolume(BaseModel):
    """What a backend holds for one volume on this node."""

    name: str
    backend: str
    size_bytes: int
    host_path: Path


class VolumeBackend(Protocol):
    """One way of keeping volumes on a node ("ext4", "qcow2"); every call is idempotent."""

    name: str

    def unavailable(self) -> str | None:
        """Why this node cannot use the backend (a tool or a device missing), or None."""
        ...

    async def provision(self, name: str, size_bytes: int) -> ProvisionedVolume:
        """Make the volume, or find the one made before (of the same size) and ready it again
        (an ext4 file system is mounted again after a reboot or an agent restart)."""
        ...

    async def adopt(self) -> list[ProvisionedVolume]:
        """Every volume this backend holds on the node, readied for use: at agent start."""
        ...

    async def delete(self, name: str) -> None:
        """Remove the volume and its data; a volume that is not there is not an error."""
        ...

    def capacity_bytes(self) -> int:
        """How many bytes the backend's directory holds in all (its file system's size)."""
        ...


def volume_dir(root: Path, backend: str, name: str) -> Path:
    """Where a backend keeps one volume's files under the agent's volume directory."""
    return root / backend / name
