"""The explicit table of runtime drivers an agent can be configured with (`--runtime`).

Each driver's module is imported when an agent is configured with it, not before: the
process, containerd and libvirt drivers bring their own libraries, and an agent that runs
one driver (or a benchmark's hundred fake ones) should not pay for loading the others.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from orka.errors import Invalid
from orka.runtime.base import Driver

# name -> (module, class) of each driver.
DRIVERS: dict[str, tuple[str, str]] = {
    "process": ("orka.runtime.process", "ProcessDriver"),
    "containerd": ("orka.runtime.containerd", "ContainerdDriver"),
    "libvirt": ("orka.runtime.libvirt", "LibvirtDriver"),
    "fake": ("orka.runtime.fake", "FakeDriver"),
}


def driver_class(name: str) -> type[Driver] | None:
    """Driver `name`'s class (its module imported now), or None for an unknown name."""
    where = DRIVERS.get(name)
    if where is None:
        return None
    cls: type[Driver] = getattr(importlib.import_module(where[0]), where[1])
    return cls


def make_driver(name: str, data_dir: Path, **opts: Any) -> Driver:
    cls = driver_class(name)
    if cls is None:
        known = ", ".join(sorted(DRIVERS))
        raise Invalid(f"unknown runtime driver {name!r}; known: {known}")
    return cls(data_dir, **opts)  # type: ignore[call-arg]


def takes(name: str, option: str) -> bool:
    """Whether driver `name` has a keyword option `option` (e.g. "network", "host_ports")."""
    cls = driver_class(name)
    return cls is not None and option in inspect.signature(cls.__init__).parameters
