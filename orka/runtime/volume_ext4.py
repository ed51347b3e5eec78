"""The "ext4" volume backend: a directory of enforced size for processes and containers.

Each volume is a sparse file holding its own ext4 file system, loop-mounted on a directory:
the file system's size is the limit (a write past it fails with ENOSPC inside the instance,
nothing else on the node fills up). Under `<root>/<name>/`: `disk.img`, `mnt/` and
`meta.json` (written last: a volume without it was never finished and is made again)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import structlog

from orka.errors import RuntimeFailure
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

TOOLS = ("mkfs.ext4", "mount", "umount")


class Ext4Backend(LocalVolumes):
    name = "ext4"
    host_file = "mnt"

    def unavailable(self) -> str | None:
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            return f"ext4 volumes need {', '.join(missing)}"
        if os.geteuid() != 0:
            return "ext4 volumes need root (loop mounts)"
        if not Path("/dev/loop-control").exists():
            return "ext4 volumes need loop devices (/dev/loop-control is missing)"
        return None

    async def provision(self, name: str, size_bytes: int) -> ProvisionedVolume:
        check_volume_name(name)
        async with self._lock(name):
            directory = self.root / name
            meta = await asyncio.to_thread(read_meta, directory)
            if meta is not None:
                check_size(name, meta, size_bytes)
                await self._mount(directory)
                return self._provisioned(name, meta)
            await self._unmount(directory)  # a half-made one from before: made again
            await asyncio.to_thread(shutil.rmtree, directory, True)
            await asyncio.to_thread(self._make_file, directory, size_bytes)
            image = str(directory / "disk.img")
            # -m 0: the whole size is the instance's (no blocks kept for root); lazy init
            # so a large volume is ready at once.
            await run_tool(
                "mkfs.ext4", "-q", "-F", "-m", "0",
                "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
                image, what=f"volume {name}: mkfs.ext4",
            )  # fmt: skip
            meta = VolumeMeta(name=name, backend=self.name, size_bytes=size_bytes)
            await self._mount(directory)
            await asyncio.to_thread(write_meta, directory, meta)
            log.info("volume provisioned", volume=name, backend=self.name, size=size_bytes)
            return self._provisioned(name, meta)

    def _make_file(self, directory: Path, size_bytes: int) -> None:
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        directory.mkdir(mode=0o711)
        (directory / "mnt").mkdir(mode=0o755)
        try:
            with open(directory / "disk.img", "xb") as f:
                f.truncate(size_bytes)  # sparse: takes no room until written
        except OSError as err:
            raise RuntimeFailure(
                f"volume {directory.name}: cannot make its file: {err.strerror or err}"
            ) from None

    async def _mount(self, directory: Path) -> None:
        mnt = directory / "mnt"
        if await asyncio.to_thread(os.path.ismount, mnt):
            return
        await asyncio.to_thread(mnt.mkdir, 0o755, True, True)
        await run_tool(
            "mount", "-t", "ext4", "-o", "loop,nodev,nosuid", str(directory / "disk.img"), str(mnt),
            what=f"volume {directory.name}: mount",
        )  # fmt: skip

    async def _unmount(self, directory: Path) -> None:
        mnt = directory / "mnt"
        if await asyncio.to_thread(os.path.ismount, mnt):
            # A loop mount frees its loop device on umount (autoclear).
            await run_tool("umount", str(mnt), what=f"volume {directory.name}: umount")

    async def adopt(self) -> list[ProvisionedVolume]:
        found: list[ProvisionedVolume] = []
        names = await asyncio.to_thread(subdirs, self.root)
        for name in names:
            meta = await asyncio.to_thread(read_meta, self.root / name)
            if meta is None:
                continue  # never finished: made again when asked for
            try:
                async with self._lock(name):
                    await self._mount(self.root / name)
            except RuntimeFailure as err:
                log.warning("volume not re-adopted", volume=name, error=err.message)
                continue
            found.append(self._provisioned(name, meta))
        return found

    async def delete(self, name: str) -> None:
        check_volume_name(name)
        async with self._lock(name):
            directory = self.root / name
            await self._unmount(directory)
            await asyncio.to_thread(shutil.rmtree, directory, True)
            log.info("volume deleted", volume=name, backend=self.name)

    async def unmount_all(self) -> None:
        """Unmount every volume, keeping its data (tests; a node being wiped)."""
        for name in await asyncio.to_thread(subdirs, self.root):
            await self._unmount(self.root / name)
