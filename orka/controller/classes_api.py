"""PLACEHOLDER: the classes_api RPCs; the slice that owns this file replaces it whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orka.security.identity import Identity

if TYPE_CHECKING:
    from orka.controller.api import ControllerApi


async def create_class(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("CreateClass")


async def get_class(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("GetClass")


async def list_classes(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("ListClasses")


async def update_class(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("UpdateClass")


async def delete_class(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("DeleteClass")


async def list_pools(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("ListPools")
