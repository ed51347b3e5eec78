"""The "qcow2" volume backend: a disk file for VMs, made with `qemu-img create -f qcow2`.

The file's virtual size is the disk's size the guest sees; it grows as the guest writes.
Under `<root>/<name>/`: `disk.qcow2` and `meta.json` (written last)."""

from __future__ import annotations

import asyncio
import shutil

import structlog

from orka.runtime.volume_tools import (
    LocalVolumes,
    VolumeMeta,
    check_size,
    check_volume_name,
    read_meta,
    run_tool,
    subdirs,
    write_meta,
)
from orka.runtime.volumes import ProvisionedVolume

log = structlog.get_logger("orka.runtime.volumes")

DISK = "disk.qcow2"


class Qcow2Backend(LocalVolumes):
    name = "qcow2"
    host_file = DISK

    def unavailable(self) -> str | None:
        if shutil.which("qemu-img") is None:
            return "qcow2 volumes need qemu-img"
        return None

    async def provision(self, name: str, size_bytes: int) -> ProvisionedVolume:
        check_volume_name(name)
        async with self._lock(name):
            directory = self.root / name
            meta = await asyncio.to_thread(read_meta, directory)
            if meta is not None:
                check_size(name, meta, size_bytes)
                return self._provisioned(name, meta)
            await asyncio.to_thread(shutil.rmtree, directory, True)
            # Traversable: QEMU opens the file as its own user (libvirt gives it the file).
            await asyncio.to_thread(self.root.mkdir, 0o711, True, True)
            await asyncio.to_thread(directory.mkdir, 0o711)
            await run_tool(
                "qemu-img", "create", "-q", "-f", "qcow2", str(directory / DISK), str(size_bytes),
                what=f"volume {name}: qemu-img create",
            )  # fmt: skip
            meta = VolumeMeta(name=name, backend=self.name, size_bytes=size_bytes)
            await asyncio.to_thread(write_meta, directory, meta)
            log.info("volume provisioned", volume=name, backend=self.name, size=size_bytes)
            return self._provisioned(name, meta)

    async def adopt(self) -> list[ProvisionedVolume]:
        found = []
        for name in await asyncio.to_thread(subdirs, self.root):
            meta = await asyncio.to_thread(read_meta, self.root / name)
            if meta is not None and (self.root / name / DISK).exists():
                found.append(self._provisioned(name, meta))
        return found

    async def delete(self, name: str) -> None:
        check_volume_name(name)
        async with self._lock(name):
            await asyncio.to_thread(shutil.rmtree, self.root / name, True)
            log.info("volume deleted", volume=name, backend=self.name)
