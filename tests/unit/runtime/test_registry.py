from __future__ import annotations

from pathlib import Path

import pytest

from orka.errors import Invalid
from orka.runtime.containerd import ContainerdDriver
from orka.runtime.fake import FakeDriver
from orka.runtime.process import ProcessDriver
from orka.runtime.registry import make_driver


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
