from __future__ import annotations

from pathlib import Path

import pytest

from orka.errors import Invalid
from orka.runtime.base import Driver
from orka.runtime.containerd import ContainerdDriver
from orka.runtime.fake import FakeDriver
from orka.runtime.process import ProcessDriver
from orka.runtime.registry import driver_class, make_driver
from tests.subprocs import fresh_python


@pytest.mark.parametrize(
    ("name", "cls"),
    [("process", ProcessDriver), ("fake", FakeDriver), ("containerd", ContainerdDriver)],
)
def test_make_driver(tmp_path: Path, name: str, cls: type) -> None:
    driver = make_driver(name, tmp_path)
    assert isinstance(driver, cls) and driver.name == name


def test_unknown_driver(tmp_path: Path) -> None:
    with pytest.raises(
        Invalid, match=r"unknown runtime driver 'x'; known: containerd, fake, (libvirt, )?process"
    ):
        make_driver("x", tmp_path)


@pytest.mark.parametrize("name", ["process", "containerd", "libvirt", "fake"])
def test_each_named_driver_resolves_to_its_class(name: str) -> None:
    cls = driver_class(name)
    assert cls is not None and issubclass(cls, Driver) and cls.name == name


def test_the_agent_loads_no_driver_it_is_not_configured_with() -> None:
    """An agent imports a driver's module when it makes that driver: starting an agent
    (a hundred of them, in a benchmark) does not load containerd's or libvirt's libraries."""
    code = (
        "import sys, orka.agent.service, orka.cli.services\n"
        "print(sorted(m for m in sys.modules if m.startswith('orka.runtime.')"
        " and m.rsplit('.', 1)[1] in ('process', 'containerd', 'libvirt', 'fake')))"
    )
    out = fresh_python(code)
    assert out.strip() == "[]"
