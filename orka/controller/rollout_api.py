"""The rollout RPCs of the controller API (ListWorkloadRevisions, RollbackWorkload,
PauseRollout, ResumeRollout, PromoteRollout): ControllerApi binds these as its methods, so
they share its boundary table (roles, leader only) and its helpers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from orka.api import controller_pb2 as pb
from orka.controller import rollout
from orka.controller.repo import Change
from orka.errors import Conflict, NotFound
from orka.etags import check_etag
from orka.models import Workload
from orka.rpc import convert
from orka.security.identity import Identity

if TYPE_CHECKING:
    from orka.controller.api import ControllerApi


def _workload(api: ControllerApi, name: str) -> Workload:
    from orka.controller.api import _name  # one name check for every RPC

    w = api.repo.workloads.get(_name(name))
    if w is None:
        raise NotFound(f"workload {name!r} not found")
    return w


async def list_revisions(
    api: ControllerApi, request: pb.ListWorkloadRevisionsRequest, who: Identity
) -> pb.ListWorkloadRevisionsResponse:
    w = _workload(api, request.name)
    return pb.ListWorkloadRevisionsResponse(
        revisions=[convert.revision_to_pb(r) for r in w.history()]
    )


async def _change(
    api: ControllerApi, name: str, how: Callable[[Workload], Workload], etag: str = ""
) -> pb.Workload:
    """Apply `how` to the stored workload in one plan (a no-op when it returns it as is)."""

    def plan() -> list[Change]:
        w = _workload(api, name)
        check_etag(etag, w.etag, f"workload {name!r}")
        if w.deleting:
            raise Conflict(f"workload {name!r} is being deleted")
        new = how(w)
        return [] if new is w else [Change("workloads", w.name, new)]

    await api.repo.mutate(plan)
    api.reconciler.kick()
    return api._workload_pb(api.repo.workloads[name])


async def rollback(
    api: ControllerApi, request: pb.RollbackWorkloadRequest, who: Identity
) -> pb.Workload:
    def how(w: Workload) -> Workload:
        spec, number = rollout.rollback_spec(w, request.revision)
        if rollout.runs_same(spec, w.spec):
            raise Conflict(f"workload {w.name!r} already runs the spec of revision {number}")
        new = rollout.new_revision(w, spec, str(who), time.time(), f"undo to revision {number}")
        return new

    return await _change(api, request.name, how, request.etag)


async def pause(api: ControllerApi, request: pb.PauseRolloutRequest, who: Identity) -> pb.Workload:
    return await _change(api, request.name, lambda w: rollout.pause(w, time.time()))


async def resume(
    api: ControllerApi, request: pb.ResumeRolloutRequest, who: Identity
) -> pb.Workload:
    return await _change(api, request.name, lambda w: rollout.resume(w, time.time()))


async def promote(
    api: ControllerApi, request: pb.PromoteRolloutRequest, who: Identity
) -> pb.Workload:
    return await _change(api, request.name, lambda w: rollout.promote(w, time.time()))
