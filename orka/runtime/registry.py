"""The explicit table of runtime drivers an agent can be configured with (`--runtime`)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from orka.errors import Invalid
from orka.runtime.base import Driver
from orka.runtime.containerd import ContainerdDriver
from orka.runtime.fake import FakeDriver
from orka.runtime.libvirt import LibvirtDriver
from orka.runtime.process import ProcessDriver

DRIVERS: dict[str, type[Driver]] = {
    "process": ProcessDriver,
    "containerd": ContainerdDriver,
    "libvirt": LibvirtDriver,
    "fake": FakeDriver,
}


def make_driver(name: str, data_dir: Path, **opts: Any) -> Driver:
    cls = DRIVERS.get(name)
    if cls is None:
        known = ", ".join(sorted(DRIVERS))
        raise Invalid(f"unknown runtime driver {name!r}; known: {known}")
    return cls(data_dir, **opts)  # type: ignore[call-arg]


def takes(name: str, option: str) -> bool:
    """Whether driver `name` has a keyword option `option` (e.g. "network", "host_ports")."""
    cls = DRIVERS.get(name)
    return cls is not None and option in inspect.signature(cls.__init__).parameters
