"""Volumes through the scheduler: what agents report of their volumes, on to the controller,
and the controller's provision and delete commands, on to the agents.

The scheduler keeps each node's last report of every volume (NodeRecord.volumes) only to hand
the whole list to a controller that (re)connects (NodeSync.volumes); the controller is where
volumes are decided. Reports are agent input and are checked (orka/rpc/convert_volumes.py)
before they are kept or passed on: a bad one ends the agent's stream, like a bad instance
status.
"""

from __future__ import annotations

from orka.api import agent_pb2 as apb
from orka.errors import Invalid
from orka.rpc import convert_volumes
from orka.scheduler.feed import Feed
from orka.scheduler.registry import NodeRecord
from orka.scheduler.session import next_id


def registered(reg: apb.Register) -> dict[str, apb.VolumeStatus]:
    """Every volume the node holds (replacing what it said before), checked."""
    convert_volumes.reports_from_pb(reg.volumes, "register: volumes")
    return {v.name: v for v in reg.volumes}


def on_status(node: NodeRecord, feed: Feed, status: apb.VolumeStatus) -> None:
    """One volume changed: kept, and passed on unless it says what it said last time."""
    convert_volumes.report_from_pb(status)
    if node.volumes.get(status.name) == status:
        return
    if len(node.volumes) >= convert_volumes.MAX_NODE_VOLUMES and status.name not in node.volumes:
        raise Invalid(f"volume status: at most {convert_volumes.MAX_NODE_VOLUMES} volumes a node")
    node.volumes[status.name] = status
    feed.hub.publish(apb.ClusterUpdate(volume=apb.VolumeUpdate(node=node.name, status=status)))


def command_message(cmd: apb.NodeCommand) -> tuple[apb.SchedulerMessage, str] | None:
    """The agent's message for a volume command and the id its ack answers; None: not one."""
    which = cmd.WhichOneof("command")
    if which == "provision_volume":
        msg = apb.SchedulerMessage(provision_volume=cmd.provision_volume)
        key = cmd.provision_volume.command_id or next_id("c")
        msg.provision_volume.command_id = key
        return msg, key
    if which == "delete_volume":
        msg = apb.SchedulerMessage(delete_volume=cmd.delete_volume)
        key = cmd.delete_volume.command_id or next_id("c")
        msg.delete_volume.command_id = key
        return msg, key
    return None
