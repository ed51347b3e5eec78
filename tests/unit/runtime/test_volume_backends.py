"""The volume backends on the real tools: ext4 loop mounts and qemu-img."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.errors import RuntimeFailure
from orka.runtime.volume_ext4 import Ext4Backend
from orka.runtime.volume_qcow2 import Qcow2Backend

MIB = 1 << 20

ext4_missing = Ext4Backend(Path("/nonexistent")).unavailable()
qcow2_missing = Qcow2Backend(Path("/nonexistent")).unavailable()


@pytest.fixture
async def ext4(tmp_path: Path) -> AsyncIterator[Ext4Backend]:
    if ext4_missing:
        pytest.skip(ext4_missing)
    backend = Ext4Backend(tmp_path / "ext4")
    yield backend
    # Whatever a test left mounted goes, with its loop device.
    await Ext4Backend(tmp_path / "ext4").unmount_all()


def _fill(path: Path, mib: int) -> None:
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(b"x" * MIB)
            f.flush()
            os.fsync(f.fileno())


def _run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def _loops_of(path: Path) -> list[str]:
    out = _run("losetup", "-a")
    return [line for line in out.splitlines() if str(path) in line]


async def test_ext4_provision_write_limit_adopt_delete(ext4: Ext4Backend, tmp_path: Path) -> None:
    vol = await ext4.provision("data-1", 16 * MIB)
    assert vol.backend == "ext4" and vol.size_bytes == 16 * MIB
    assert await asyncio.to_thread(os.path.ismount, vol.host_path)
    (vol.host_path / "kept.txt").write_text("hello")

    # The size is the file system's: writing past it fails with ENOSPC.
    with pytest.raises(OSError) as info:
        await asyncio.to_thread(_fill, vol.host_path / "big", 32)
    assert info.value.errno == errno.ENOSPC
    (vol.host_path / "big").unlink()

    # Provisioning again is idempotent; another size is refused, data untouched.
    again = await ext4.provision("data-1", 16 * MIB)
    assert again.host_path == vol.host_path
    with pytest.raises(RuntimeFailure, match="exists on this node with 16777216 bytes"):
        await ext4.provision("data-1", 32 * MIB)

    # A "reboot": unmounted, then a new backend object adopts and mounts it again.
    await ext4.unmount_all()
    assert not await asyncio.to_thread(os.path.ismount, vol.host_path)
    assert _loops_of(tmp_path) == []
    fresh = Ext4Backend(tmp_path / "ext4")
    adopted = await fresh.adopt()
    assert [(v.name, v.size_bytes) for v in adopted] == [("data-1", 16 * MIB)]
    assert (adopted[0].host_path / "kept.txt").read_text() == "hello"

    await fresh.delete("data-1")
    assert not (tmp_path / "ext4" / "data-1").exists()
    assert _loops_of(tmp_path) == []
    await fresh.delete("data-1")  # not there: not an error
    assert await fresh.adopt() == []


async def test_ext4_unfinished_volume_is_made_again(ext4: Ext4Backend, tmp_path: Path) -> None:
    # A crash between the file and its meta: not adopted, and made anew when asked for.
    half = tmp_path / "ext4" / "half"
    (half / "mnt").mkdir(parents=True)
    (half / "disk.img").write_bytes(b"garbage")
    assert await ext4.adopt() == []
    vol = await ext4.provision("half", 8 * MIB)
    assert await asyncio.to_thread(os.path.ismount, vol.host_path)
    await ext4.delete("half")


async def test_ext4_bad_name_refused(ext4: Ext4Backend) -> None:
    with pytest.raises(Exception, match="not a valid volume name"):
        await ext4.provision("../etc", MIB)


async def test_qcow2_provision_adopt_delete(tmp_path: Path) -> None:
    if qcow2_missing:
        pytest.skip(qcow2_missing)
    backend = Qcow2Backend(tmp_path / "qcow2")
    vol = await backend.provision("disk-1", 64 * MIB)
    info = json.loads(
        await asyncio.to_thread(_run, "qemu-img", "info", "--output=json", str(vol.host_path))
    )
    assert info["format"] == "qcow2" and info["virtual-size"] == 64 * MIB
    assert (await backend.provision("disk-1", 64 * MIB)).host_path == vol.host_path
    adopted = await Qcow2Backend(tmp_path / "qcow2").adopt()
    assert [(v.name, v.size_bytes, v.host_path) for v in adopted] == [
        ("disk-1", 64 * MIB, vol.host_path)
    ]
    assert backend.capacity_bytes() > 0
    await backend.delete("disk-1")
    assert not vol.host_path.exists()
