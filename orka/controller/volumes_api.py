"""PLACEHOLDER: the volumes_api RPCs; the slice that owns this file replaces it whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orka.security.identity import Identity

if TYPE_CHECKING:
    from orka.controller.api import ControllerApi


async def create_volume(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("CreateVolume")


async def get_volume(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("GetVolume")


async def list_volumes(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("ListVolumes")


async def delete_volume(api: ControllerApi, request: Any, who: Identity) -> Any:
    raise NotImplementedError("DeleteVolume")
