"""ListActivities: an object's recent activity (orka/controller/activity.py), newest first."""

from __future__ import annotations

from orka.api import controller_pb2 as pb
from orka.controller import paging
from orka.controller.activity import KINDS, NORMAL, ActivityLog
from orka.controller.repo import Repo
from orka.errors import Invalid, NotFound
from orka.rpc import convert
from orka.validation import quote

# "instance/NAME" at most: names are bounded far below this.
MAX_OBJECT_CHARS = 512
_TABLES = {"workload": "workloads", "instance": "instances", "node": "nodes"}
_ALIASES = {**{k: k for k in KINDS}, **{v: k for k, v in _TABLES.items()}}


def parse_object(value: str) -> tuple[str, str]:
    """'instance/web-1' -> ('instance', 'web-1'); Invalid naming `object` otherwise."""
    if len(value) > MAX_OBJECT_CHARS:
        raise Invalid.at("object", f"longer than {MAX_OBJECT_CHARS} characters")
    kind, sep, name = value.partition("/")
    if not sep or not name or kind.lower() not in _ALIASES:
        raise Invalid.at(
            "object",
            f"{quote(value)} is not KIND/NAME with KIND workload, instance or node"
            " (e.g. instance/web-1)",
        )
    return _ALIASES[kind.lower()], name


def list_activities(
    log: ActivityLog, repo: Repo, request: pb.ListActivitiesRequest
) -> pb.ListActivitiesResponse:
    kind, name = parse_object(request.object)
    size = paging.page_size(request.page_size)
    filters = paging.fingerprint("activities", kind, name)
    start = paging.decode_token(request.page_token, filters, (int,))
    if name not in getattr(repo, _TABLES[kind]):
        raise NotFound(f"{kind} {quote(name)} not found")
    entries = log.entries(kind, name)
    if start is not None:
        entries = [e for e in entries if e.seq < start[0]]
    page, rest = entries[:size], entries[size:]
    token = paging.encode_token((page[-1].seq,), filters) if rest else ""
    return pb.ListActivitiesResponse(
        activities=[
            pb.Activity(
                type=pb.Activity.NORMAL if e.type == NORMAL else pb.Activity.WARNING,
                reason=e.reason,
                message=e.message,
                count=e.count,
                first_time=convert.timestamp_fields(e.first_time),
                last_time=convert.timestamp_fields(e.last_time),
            )
            for e in page
        ],
        next_page_token=token,
    )
