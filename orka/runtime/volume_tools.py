"""What the volume backends share: running a tool off the event loop, and each volume's meta
file (written last, so a volume without one was never finished and is made again)."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

from pydantic import BaseModel, ValidationError

from orka.errors import Invalid, RuntimeFailure
from orka.runtime.volumes import ProvisionedVolume

# Volume names become directory names: the API's names (DNS labels), nothing that escapes.
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
META = "meta.json"
TOOL_TIMEOUT = 120.0


class VolumeMeta(BaseModel):
    name: str
    backend: str
    size_bytes: int


def check_volume_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise Invalid(f"volume {name!r}: not a valid volume name")
    return name


async def run_tool(*argv: str, what: str, timeout: float = TOOL_TIMEOUT) -> str:
    """Run a tool; its stdout, or RuntimeFailure naming the volume step that failed."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as err:
        raise RuntimeFailure(f"{what}: cannot run {argv[0]}: {err.strerror or err}") from None
    try:
        async with asyncio.timeout(timeout):
            out, err_text = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeFailure(f"{what}: {argv[0]} took over {timeout:g}s") from None
    if proc.returncode != 0:
        text = " ".join(err_text.decode(errors="replace").split())[:400]
        raise RuntimeFailure(f"{what}: {argv[0]} failed: {text or f'exit {proc.returncode}'}")
    return out.decode(errors="replace")


def read_meta(directory: Path) -> VolumeMeta | None:
    try:
        return VolumeMeta.model_validate_json((directory / META).read_bytes())
    except (OSError, ValidationError):
        return None


def write_meta(directory: Path, meta: VolumeMeta) -> None:
    tmp = directory / (META + ".tmp")
    tmp.write_text(json.dumps(meta.model_dump()))
    os.replace(tmp, directory / META)


def fs_size(path: Path) -> int:
    """The size of the file system `path` is on (0 when it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize


def check_size(name: str, meta: VolumeMeta, size_bytes: int) -> None:
    if meta.size_bytes != size_bytes:
        raise RuntimeFailure(
            f"volume {name}: exists on this node with {meta.size_bytes} bytes, not {size_bytes}"
        )


def subdirs(root: Path) -> list[str]:
    """The volumes' directories under a backend's root."""
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir())
    except FileNotFoundError:
        return []


class LocalVolumes:
    """What both local backends share: one directory per volume under `root`, one change at
    a time per volume, and the file or directory (`host_file`) a driver is given."""

    name = ""
    host_file = ""

    def __init__(self, root: Path) -> None:
        self.root = root
        # One change at a time per volume: a provision racing a delete of the same name.
        self._locks: dict[str, asyncio.Lock] = {}

    def capacity_bytes(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        return fs_size(self.root)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _provisioned(self, name: str, meta: VolumeMeta) -> ProvisionedVolume:
        return ProvisionedVolume(
            name=name,
            backend=self.name,
            size_bytes=meta.size_bytes,
            host_path=self.root / name / self.host_file,
        )
