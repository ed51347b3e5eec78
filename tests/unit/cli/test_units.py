from __future__ import annotations

import pytest

from orka.cli.units import format_cpu, format_memory, parse_cpu, parse_memory
from orka.errors import Invalid


@pytest.mark.parametrize(
    ("value", "millis"),
    [("500m", 500), ("0.5", 500), ("2", 2000), (2, 2000), (0.25, 250), ("1.5", 1500), ("0", 0)],
)
def test_parse_cpu(value: object, millis: int) -> None:
    assert parse_cpu(value) == millis


@pytest.mark.parametrize("value", ["", "abc", "-1", "5x", "0.0005", "1.5m", True, None, [1]])
def test_parse_cpu_rejects(value: object) -> None:
    with pytest.raises(Invalid, match=r"resources\.cpu"):
        parse_cpu(value)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("256Mi", 256 * 2**20),
        ("1Gi", 2**30),
        ("512M", 512 * 10**6),
        ("1G", 10**9),
        ("100Ki", 102400),
        ("4096", 4096),
        (4096, 4096),
        ("0.5Gi", 2**29),
        ("64MiB", 64 * 2**20),
    ],
)
def test_parse_memory(value: object, size: int) -> None:
    assert parse_memory(value) == size


@pytest.mark.parametrize("value", ["", "1Xi", "-5", "1.5", "lots", False, None, "1 2"])
def test_parse_memory_rejects(value: object) -> None:
    with pytest.raises(Invalid, match=r"resources\.memory"):
        parse_memory(value)


@pytest.mark.parametrize(
    ("millis", "text"), [(500, "500m"), (2000, "2"), (0, "0"), (1500, "1500m")]
)
def test_format_cpu(millis: int, text: str) -> None:
    assert format_cpu(millis) == text


@pytest.mark.parametrize(
    ("size", "text"), [(256 * 2**20, "256Mi"), (2**30, "1Gi"), (1536 * 2**20, "1.5Gi"), (10, "10")]
)
def test_format_memory(size: int, text: str) -> None:
    assert format_memory(size) == text
