"""The command relay: the controller's start, stop and release commands to agents, and its
cordon and drain of nodes."""

from __future__ import annotations

from typing import Any

from google.rpc import code_pb2

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import NotFound
from orka.rpc import convert
from orka.scheduler import volumes
from orka.scheduler.feed import Feed
from orka.scheduler.registry import Registry
from orka.scheduler.session import Expected, Reply, next_id, replies


class Relay:
    """Sends each command on its node's stream and waits for the acknowledgements once per
    batch; a start acknowledged binds the reservation it was placed with."""

    def __init__(self, registry: Registry, feed: Feed, command_timeout: float) -> None:
        self.registry = registry
        self.feed = feed
        self.command_timeout = command_timeout

    async def command(self, request: apb.CommandRequest) -> apb.CommandResponse:
        sent = [self._send_command(c) for c in request.commands]
        pending = [s[1] for s in sent if not isinstance(s, apb.CommandResult)]
        answers = iter(await replies(pending, self.command_timeout))
        results = [
            s if isinstance(s, apb.CommandResult) else self._command_done(s, next(answers))
            for s in sent
        ]
        return apb.CommandResponse(results=results)

    def _send_command(
        self, cmd: apb.NodeCommand
    ) -> apb.CommandResult | tuple[apb.NodeCommand, Expected]:
        node = self.registry.get(cmd.node)
        if node is None or node.session is None:
            return apb.CommandResult(
                status=convert.error_status(
                    code_pb2.UNAVAILABLE, f"node {cmd.node} is not connected"
                ),
                unconfirmed=True,
            )
        which = cmd.WhichOneof("command")
        msg: Any
        if which == "start":
            msg = apb.SchedulerMessage(start=cmd.start)
            key = cmd.start.command_id or next_id("c")
            msg.start.command_id = key
        elif which == "stop":
            msg = apb.SchedulerMessage(stop=cmd.stop)
            key = cmd.stop.command_id or next_id("c")
            msg.stop.command_id = key
        elif which == "release":
            self.registry.release(node, cmd.release.instance)
            msg = apb.SchedulerMessage(release=cmd.release)
            key = cmd.release.command_id or next_id("c")
            msg.release.command_id = key
        elif (volume := volumes.command_message(cmd)) is not None:
            msg, key = volume
        else:
            return apb.CommandResult(
                status=convert.error_status(code_pb2.INVALID_ARGUMENT, "empty command")
            )
        return cmd, node.session.expect(msg, key)

    def _command_done(
        self, sent: tuple[apb.NodeCommand, Expected], reply: Reply
    ) -> apb.CommandResult:
        cmd = sent[0]
        if cmd.WhichOneof("command") == "start":
            node = self.registry.get(cmd.node)
            instance = cmd.start.assignment.instance
            hold = node.holds.get(instance) if node is not None else None
            if reply.ok and hold is not None:
                hold.expires_at = None  # bound now: the hold lasts until the instance ends
            elif not reply.ok and node is not None:
                self.registry.release(node, instance)
        return apb.CommandResult(status=reply.status, unconfirmed=not reply.answered)

    def set_node(self, request: apb.SetNodeRequest) -> pb.Node:
        node = self.registry.get(request.name)
        if node is None:
            raise NotFound(f"node {request.name!r} is not known to the scheduler")
        if request.HasField("schedulable"):
            node.schedulable = request.schedulable
        if request.HasField("draining"):
            node.draining = request.draining
        self.registry.changed()
        self.feed.publish_node(node)
        return self.feed.nodes.build(node)
