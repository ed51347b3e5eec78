"""Human resource quantities (`500m`, `0.5`, `256Mi`, `1G`) to the integers the API carries."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from orka.errors import Invalid

_NUMBER_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")

_MEMORY_UNITS: dict[str, int] = {
    "": 1,
    "k": 1000,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
}


def _decimal(value: object) -> tuple[Decimal, str] | None:
    # bool is an int subclass; `cpu: true` is a typo, never a quantity.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value), ""
    if isinstance(value, float):
        try:
            return Decimal(repr(value)), ""
        except InvalidOperation:
            return None
    if isinstance(value, str):
        m = _NUMBER_RE.match(value)
        if not m:
            return None
        return Decimal(m.group(1)), m.group(2)
    return None


def parse_cpu(value: object, field: str = "resources.cpu") -> int:
    """Cores (`2`, `0.5`) or millicores (`500m`) to millicores."""
    parsed = _decimal(value)
    bad = Invalid(f"{field}: {value!r} is not a CPU quantity (use e.g. 500m, 0.5 or 2)")
    if parsed is None or not parsed[0].is_finite():
        raise bad
    number, unit = parsed
    if unit == "m":
        millis = number
    elif unit == "":
        millis = number * 1000
    else:
        raise bad
    if millis != millis.to_integral_value():
        raise Invalid(f"{field}: {value!r} is finer than one millicore (1m)")
    return int(millis)


def parse_memory(value: object, field: str = "resources.memory") -> int:
    """`256Mi`, `1Gi`, `512M`, `1G`, `100Ki` or plain bytes to bytes; a trailing `B` is allowed."""
    parsed = _decimal(value)
    bad = Invalid(
        f"{field}: {value!r} is not a memory quantity (use e.g. 256Mi, 1Gi, 512M or bytes)"
    )
    if parsed is None or not parsed[0].is_finite():
        raise bad
    number, unit = parsed
    if unit.endswith("B") and unit != "B":
        unit = unit[:-1]
    elif unit == "B":
        unit = ""
    if unit not in _MEMORY_UNITS:
        raise bad
    total = number * _MEMORY_UNITS[unit]
    if total != total.to_integral_value():
        raise Invalid(f"{field}: {value!r} is not a whole number of bytes")
    return int(total)


def format_cpu(millis: int) -> str:
    if millis % 1000 == 0:
        return str(millis // 1000)
    return f"{millis}m"


def format_memory(n: int) -> str:
    for unit, size in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if n >= size:
            if n % size == 0:
                return f"{n // size}{unit}"
            return f"{n / size:.1f}{unit}"
    return str(n)


_DURATION_PART_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ms|s|m|h)")
_DURATION_UNITS = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600)}


def parse_duration(value: object, field: str = "stop_grace_period") -> float:
    """`10s`, `1.5s`, `500ms`, `2m`, `1m30s`, `1h` to seconds; the API's Duration JSON form
    (`10s`, `0.500s`) is one of them. A bare number is not taken: `10` could mean any unit."""
    bad = Invalid(f"{field}: {value!r} is not a duration (use e.g. 10s, 500ms, 1m30s)")
    if not isinstance(value, str):
        raise bad
    text = value.strip()
    parts = _DURATION_PART_RE.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise bad
    return float(sum(Decimal(n) * _DURATION_UNITS[u] for n, u in parts))


def format_duration(seconds: float) -> str:
    """Seconds as `parse_duration` reads them back: `10s`, `0.5s`, `90s`."""
    return f"{Decimal(repr(float(seconds))).normalize():f}s"
