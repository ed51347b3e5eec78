"""The audit log: who called which API on what, and how it ended.

Every call of the controller API that writes (everything but Get*, List* and Watch*; reads too
when asked) gives one record, refused calls included, as one JSON object per line:

    {"time": "2026-11-26T12:00:00.123Z", "method": "CreateWorkload",
     "caller": {"identity": "admin/admin", "role": "admin", "name": "admin",
                "serial": "5F3A...", "peer": "ipv4:127.0.0.1:51234"},
     "object": {"kind": "workload", "name": "web"},
     "outcome": {"code": "OK", "message": ""}}

The records go to a file the operator chooses (appended, 0600, flushed after each record by
a thread of its own, so a slow disk never stalls the event loop) and through structlog as the
logger "orka.audit". Requests themselves are never recorded: a spec may hold secret values.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import logging.handlers
import queue
import re
from pathlib import Path
from typing import Any

import grpc
import structlog

from orka.filemodes import private_file
from orka.rpc.server import Call

log = structlog.get_logger("orka.audit")

# Calls whose name starts with one of these only read; anything else is taken to write, so a
# new RPC is audited until someone decides it need not be.
READ_PREFIXES = ("Get", "List", "Watch")
# Bounds on what a caller controls: an object name or an error message that echoes input.
MAX_NAME_CHARS = 253
MAX_MESSAGE_CHARS = 512

_FIRST_WORD_RE = re.compile(r"^[A-Z][a-z]+")
_CAMEL_RE = re.compile(r"(?<=[a-z0-9])([A-Z])")


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def object_of(method: str, request: Any) -> dict[str, str]:
    """The object a call is about: the kind from the method's name after its verb
    (CreateWorkload -> workload, DrainNode -> node), the name from the request's `name` or
    `spec.name`."""
    kind = _CAMEL_RE.sub(r"_\1", _FIRST_WORD_RE.sub("", method, count=1)).lower()
    name = ""
    spec = getattr(request, "spec", None)
    for source in (spec, request):
        value = getattr(source, "name", None)
        if isinstance(value, str) and value:
            name = value
            break
    return {"kind": kind, "name": _bounded(name, MAX_NAME_CHARS)}


def rfc3339(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_record(call: Call, when: dt.datetime | None = None) -> dict[str, Any]:
    who = call.caller.identity
    return {
        "time": rfc3339(when or dt.datetime.now(dt.UTC)),
        "method": call.method,
        "caller": {
            "identity": str(who) if who else "",
            "role": who.role if who else "",
            "name": who.name if who else "",
            "serial": call.caller.serial,
            "peer": call.caller.peer,
        },
        "object": object_of(call.method, call.request),
        "outcome": {
            "code": call.code.name,
            "message": _bounded(call.message, MAX_MESSAGE_CHARS),
        },
    }


def open_private(path: Path) -> None:
    """Create `path` owner-only (0600), tightening one that exists; its folder is the
    operator's choice (/var/log/orka) and only made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    private_file(path)


class AuditLog:
    """The controller API's `auditor` (see orka.rpc.server.Auditor)."""

    def __init__(self, path: Path | None = None, reads: bool = False) -> None:
        self.path = path
        self.reads = reads
        self._listener: logging.handlers.QueueListener | None = None
        self._handler: logging.FileHandler | None = None
        self._queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        if path is not None:
            open_private(path)
            # FileHandler appends and flushes after each record; the listener's thread does the
            # writing, so the event loop only puts the line on a queue.
            self._handler = logging.FileHandler(path, mode="a", encoding="utf-8")
            self._handler.setFormatter(logging.Formatter("%(message)s"))
            self._listener = logging.handlers.QueueListener(self._queue, self._handler)
            self._listener.start()

    def wants(self, method: str) -> bool:
        return self.reads or not method.startswith(READ_PREFIXES)

    def record(self, call: Call) -> None:
        record = to_record(call)
        level = logging.INFO if call.code is grpc.StatusCode.OK else logging.WARNING
        log.log(level, "audit", **record)
        if self._listener is not None:
            line = json.dumps(record, separators=(",", ":"))  # ASCII: one record, one line
            self._queue.put(logging.makeLogRecord({"msg": line, "levelno": level}))

    def close(self) -> None:
        """Write what is queued and close the file; idempotent."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()  # drains the queue first
        if self._handler is not None:
            self._handler.close()
            self._handler = None
