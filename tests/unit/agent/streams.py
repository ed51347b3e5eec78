"""An agent Stream with nothing behind it but its scheduler addresses, for tests of the
stream's own logic (its channels and sessions are the subclass's to stand in for)."""

from __future__ import annotations

from pathlib import Path

from orka.agent.stream import Stream
from orka.models import Resources
from orka.security.tls import TlsFiles


async def _no_usage() -> Resources:
    return Resources()


class BareStream(Stream):
    def __init__(self, addresses: list[str], reconnect_max: float = 1.0) -> None:
        tls = TlsFiles(ca=Path("ca"), cert=Path("c"), key=Path("k"))
        super().__init__(
            addresses, tls, Resources(), {}, {}, {}, 1.0, reconnect_max, lambda m: None,
            Resources, _no_usage, lambda: False,
        )  # fmt: skip
