"""The placer: Place by offers to the best nodes, with reservations held until bound."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from orka import fit
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import Invalid
from orka.models import MAX_VOLUMES, PortProtocol, WorkloadKind
from orka.rpc.place_reasons import place_result_to_pb
from orka.scheduler.pipeline import Pipeline, Ranking
from orka.scheduler.registry import NodeRecord, Registry
from orka.scheduler.session import TIMED_OUT, AgentSession, Expected, Reply, next_id, replies
from orka.scheduler.snapshot import PlacementRequest

# Candidates ranked per placement; each retry ranks this many more than were tried.
RANK_FIRST = 8
# Nodes one instance is offered to in one Place call, at most; past that it comes back
# unplaced with the refusals, and the controller tries it again later. Walking the whole
# cluster per instance was how a scheduler fell over at 5,000 nodes: a batch whose offers
# timed out (a busy scheduler reads replies late) ranked every node for each instance, which
# kept its event loop busier, which timed out more offers, until it did nothing else.
MAX_OFFERS = 32
# A Place batch's first round ranks this many instances, then lets the event loop run
# (agents' heartbeats and replies are read meanwhile): ranked in one go, a batch stalls the
# loop for its whole length (0.5 s was seen for 4,096 instances on 1,000 nodes).
PLACE_CHUNK = 256
# Offers made but not sent yet, with the session each goes to (see Placer.place).
_Held = list[tuple[AgentSession, apb.SchedulerMessage]]

_KINDS = {pb.WorkloadSpec.Kind.Value(k.value): k for k in WorkloadKind}
_PROTOCOLS = {
    pb.PortSpec.PROTOCOL_UNSPECIFIED: PortProtocol.TCP,
    pb.PortSpec.TCP: PortProtocol.TCP,
    pb.PortSpec.UDP: PortProtocol.UDP,
}


def request_of(a: apb.Assignment) -> PlacementRequest:
    spec = a.spec
    kind = _KINDS.get(spec.kind)
    if kind is None:
        raise Invalid(f"assignment {a.instance}: spec.kind is required")
    return PlacementRequest(
        instance=a.instance,
        workload=spec.name,
        kind=kind,
        cpu_millis=spec.resources.cpu_millis,
        memory_bytes=spec.resources.memory_bytes,
        node_selector=dict(spec.node_selector),
        max_per_node=spec.max_per_node,
        host_ports=_fixed_host_ports(a) if spec.ports else fit.NO_HOST_PORTS,
        pool=spec.pool,
        class_name=spec.class_name,
        volumes=_volumes(a) if a.volumes else fit.NO_VOLUMES,
    )


def _volumes(a: apb.Assignment) -> tuple[fit.VolumeNeed, ...]:
    """The volumes the controller resolved for the instance (bound or not), bounded."""
    if len(a.volumes) > MAX_VOLUMES + 1:  # the spec's and the template's
        raise Invalid(f"assignment {a.instance}: volumes: at most {MAX_VOLUMES + 1}")
    return tuple(
        fit.VolumeNeed(
            name=v.name, size_bytes=v.size_bytes, backend=v.backend, node=v.node, pool=v.pool
        )
        for v in a.volumes
    )


def _fixed_host_ports(a: apb.Assignment) -> frozenset[fit.HostPort]:
    """The host ports the assignment's instance binds on its node: those it fixes (0: the
    agent picks one, which asks nothing of the scheduler)."""
    fixed = []
    for i, p in enumerate(a.spec.ports):
        if not p.host_port:
            continue
        protocol = _PROTOCOLS.get(p.protocol)
        if protocol is None or not 0 < p.host_port <= 65535:
            what = "protocol" if protocol is None else "host_port"
            raise Invalid(
                f"assignment {a.instance}: spec.ports[{i}].{what}: {getattr(p, what)} is not a"
                " port the controller accepts"
            )
        fixed.append((p.host_port, protocol))
    return frozenset(fixed)


def release_message(instance: str) -> apb.SchedulerMessage:
    """Tell an agent to drop its reservation for `instance`."""
    return apb.SchedulerMessage(
        release=apb.ReleaseOffer(command_id=next_id("r"), instance=instance)
    )


@dataclass(slots=True)
class _Attempt:
    """One instance of a Place batch: what was tried, why nodes said no, and the outcome."""

    assignment: apb.Assignment
    req: PlacementRequest
    tried: set[str] = field(default_factory=set)
    refusals: dict[str, fit.Reason] = field(default_factory=dict)
    result: apb.PlaceResult | None = None
    # What the filters left out on the first ranking, when it counted that (for the record).
    passed_over: Mapping[fit.Reason, int] | None = None


# Up to this many nodes a placed instance also says why the other nodes were passed over
# (recorded as the instance's activity); beyond it only when the ranking counted that anyway.
EXPLAIN_NODES = 64


class Placer:
    """Ranks nodes for each instance, reserves on the best and offers it there; the next
    node on a refusal or a timeout. Reservations not bound in time are released
    (`expire_reservations`, paced by the liveness clock)."""

    def __init__(
        self,
        registry: Registry,
        pipeline: Pipeline,
        offer_timeout: float,
        hold_seconds: float,
    ) -> None:
        self.registry = registry
        self.pipeline = pipeline
        self.offer_timeout = offer_timeout
        self.hold_seconds = hold_seconds
        # How late the scheduler reads its agents' streams (liveness.lag): offers wait that
        # much longer (session.replies).
        self.behind: Callable[[], float] = lambda: 0.0

    async def place(self, request: apb.PlaceRequest) -> apb.PlaceResponse:
        attempts = [_Attempt(a, request_of(a)) for a in request.items]
        # Round one: each instance's best node gets its offer, all sent before any reply is
        # awaited, and the batch waits for them once. Each ranking sees the reservations made
        # before it (they are made at once, on the live records). The offers are held until
        # the whole round is ranked, then sent together: the round yields to the event loop
        # every PLACE_CHUNK instances, and a node's offers still leave together.
        held: _Held = []
        first = []
        for i, at in enumerate(attempts, 1):
            first.append((at, self._first_offer(at, held)))
            if i % PLACE_CHUNK == 0 and i < len(attempts):
                await asyncio.sleep(0)
        for session, msg in held:
            session.send(msg)
        sent = [(at, offer) for at, offer in first if offer is not None]
        answers = await replies([e for _, (_, e) in sent], self.offer_timeout, self.behind)
        for (at, (node, e)), reply in zip(sent, answers, strict=True):
            if self._settle_offer(at, node, e.session, reply):
                at.result = place_result_to_pb(
                    at.req.instance, node.name, at.refusals, passed_over=at.passed_over
                )
        # The rest (refused, timed out, nothing reservable) go on one by one.
        rest = [at for at in attempts if at.result is None]
        if rest:
            await asyncio.gather(*(self._place_rest(at) for at in rest))
        return apb.PlaceResponse(results=[at.result for at in attempts])

    def _first_offer(self, at: _Attempt, held: _Held) -> tuple[NodeRecord, Expected] | None:
        """Reserve on the best node that takes it and hold the offer in `held` for the caller
        to send; None when no node could be reserved."""
        snapshot = self.registry.snapshot()
        ranking = self.pipeline.rank(at.req, snapshot, limit=RANK_FIRST)
        at.passed_over = ranking.counted_rejections()
        if at.passed_over is None and len(snapshot) <= EXPLAIN_NODES:
            # Counting is one filter pass over the nodes: cheap on a small cluster, where an
            # operator reads why a replica went where it did; skipped on a large one.
            at.passed_over = ranking.rejections
        for name in ranking.candidates:
            offer = self._reserve_and_offer(at, name, held)
            if offer is not None:
                return offer
        return None

    def _reserve_and_offer(
        self,
        at: _Attempt,
        name: str,
        held: _Held | None = None,
    ) -> tuple[NodeRecord, Expected] | None:
        """Reserve on `name` and offer it the instance: sent at once, or appended to `held`."""
        at.tried.add(name)
        node = self.registry.get(name)
        if node is None:
            at.refusals[name] = fit.GONE
            return None
        reason = self.registry.try_reserve(node, at.req, self.hold_seconds)
        if reason is not None:
            at.refusals[name] = reason
            return None
        session = node.session
        assert session is not None  # try_reserve checked it
        offer_id = next_id("o")
        msg = apb.SchedulerMessage(
            offer=apb.Offer(
                offer_id=offer_id, assignment=at.assignment, hold_seconds=self.hold_seconds
            )
        )
        expected = session.expect(msg, offer_id, send=held is None)
        if held is not None:
            held.append((session, msg))
        return node, expected

    def _settle_offer(
        self, at: _Attempt, node: NodeRecord, session: AgentSession, reply: Reply
    ) -> bool:
        """True when the agent took it; otherwise free the reservation and say why not."""
        if reply.ok:
            return True
        self.registry.release(node, at.req.instance)
        if reply is TIMED_OUT:
            session.send(release_message(at.req.instance))
            at.refusals[node.name] = fit.OFFER_TIMED_OUT
        else:
            at.refusals[node.name] = fit.refused(reply.reason)
        return False

    async def _place_rest(self, at: _Attempt) -> None:
        """Offer to the next nodes in turn until one accepts: each ranking asks for the best
        few not tried yet (a few more than were tried, which the indexed stage answers
        without scoring every node), up to MAX_OFFERS nodes in all."""
        ranking: Ranking | None = None
        while len(at.tried) < MAX_OFFERS:
            limit = len(at.tried) + RANK_FIRST
            ranking = self.pipeline.rank(at.req, self.registry.snapshot(), limit=limit)
            for name in ranking.candidates:
                if name in at.tried:
                    continue
                if len(at.tried) >= MAX_OFFERS:
                    break
                offer = self._reserve_and_offer(at, name)
                if offer is None:
                    continue
                node, e = offer
                (reply,) = await replies([e], self.offer_timeout, self.behind)
                if self._settle_offer(at, node, e.session, reply):
                    at.result = place_result_to_pb(
                        at.req.instance, name, at.refusals, passed_over=at.passed_over
                    )
                    return
            if len(ranking.candidates) < limit:
                break  # every feasible node was ranked
        # Reason counts are only computed now that nothing took the instance.
        rejections = dict(ranking.rejections) if ranking is not None else {}
        for reason in at.refusals.values():
            rejections[reason] = rejections.get(reason, 0) + 1
        at.result = place_result_to_pb(at.req.instance, "", at.refusals, rejections)

    def expire_reservations(self, now: float) -> None:
        """Release the reservations whose offers were never bound, on the agents as well."""
        for node_name, instance in self.registry.expire_reservations(now):
            node = self.registry.get(node_name)
            if node is not None and node.session is not None:
                node.session.send(release_message(instance))
