"""orka.rpc.server.boundaries: every RPC handler a servicer overrides gets its role check."""

from __future__ import annotations

from typing import Any

import pytest

from orka.api import controller_pb2_grpc as pb_grpc
from orka.controller.api import ControllerApi
from orka.rpc.server import boundaries
from orka.scheduler.service import Scheduler


def tag(label: str) -> Any:
    def wrap(fn: Any) -> Any:
        async def handler(*args: Any) -> list[str]:
            return [label, *(await fn(*args))]

        return handler

    return wrap


async def test_wrappers_apply_like_stacked_decorators_first_outermost() -> None:
    @boundaries(GetNode=(tag("outer"), tag("inner")), ListNodes=tag("only"))
    class Api(pb_grpc.ControllerServicer):
        async def GetNode(self) -> list[str]:
            return ["body"]

        async def ListNodes(self) -> list[str]:
            return ["body"]

    assert await Api().GetNode() == ["outer", "inner", "body"]
    assert await Api().ListNodes() == ["only", "body"]


def test_an_rpc_handler_without_a_boundary_is_refused() -> None:
    with pytest.raises(
        TypeError, match=r"^Api: RPC handlers without a boundary: DrainNode, GetNode$"
    ):

        @boundaries(ListNodes=tag("x"))
        class Api(pb_grpc.ControllerServicer):
            async def ListNodes(self) -> None: ...
            async def GetNode(self) -> None: ...
            async def DrainNode(self) -> None: ...
            async def _helper(self) -> None: ...


def test_a_boundary_for_a_missing_method_is_refused() -> None:
    with pytest.raises(TypeError, match=r"^Api\.GetNode: no such method to guard$"):

        @boundaries(GetNode=tag("x"))
        class Api(pb_grpc.ControllerServicer):
            pass


@pytest.mark.parametrize(
    ("servicer", "base"), [(ControllerApi, "ControllerServicer"), (Scheduler, "SchedulerServicer")]
)
def test_every_rpc_of_orka_servicers_is_guarded(servicer: type, base: str) -> None:
    # Each handler the class defines is the wrapper, not the body: the wrapper's closure holds
    # the roles it checks.
    generated = next(b for b in servicer.__mro__ if b.__name__ == base)
    rpcs = [n for n, v in vars(generated).items() if callable(v) and not n.startswith("_")]
    assert rpcs
    for name in rpcs:
        handler = servicer.__dict__[name]
        cells = [c.cell_contents for c in handler.__closure__ or ()]
        assert any(isinstance(c, frozenset | set) and c for c in cells), name
