"""The audit log: who called which API on what, and how it ended.

Every call of the controller API that writes (everything but Get*, List* and Watch*; reads too
when asked) gives one record, refused calls included, as one JSON object per line:

    {"time": "2026-11-26T12:00:00.123Z", "method": "CreateWorkload",
     "caller": {"identity": "admin/admin", "role": "admin", "name": "admin",
                "serial": "5F3A...", "peer": "ipv4:127.0.0.1:51234"},
     "object": {"kind": "workload", "name": "web"},
     "outcome": {"code": "OK", "message": ""}}

The records go to a file the operator chooses (appended, 0600, written and flushed by a thread
of its own, so a slow disk never stalls the event loop) and through structlog as the logger
"orka.audit". Requests themselves are never recorded: a spec may hold secret values.
"""

from __future__ import annotations

import datetime as dt
import json
import queue
import re
import threading
from pathlib import Path
from typing import Any

import grpc
import structlog

from orka.filemodes import private_file
from orka.rpc.server import Call

LOGGER = "orka.audit"
log = structlog.get_logger(LOGGER)

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
    (CreateWorkload -> workload, DrainNode -> node), the name from the request's `name`,
    `spec.name` or `instance` (ReadLogs)."""
    kind = _CAMEL_RE.sub(r"_\1", _FIRST_WORD_RE.sub("", method, count=1)).lower()
    name = ""
    spec = getattr(request, "spec", None)
    for source, field in ((spec, "name"), (request, "name"), (request, "instance")):
        value = getattr(source, field, None)
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


class _LineWriter:
    """Appends lines to a file from a thread of its own, so the event loop only queues them.

    Each wake-up writes what is queued and flushes before waiting again: no record sits in a
    buffer while the writer is idle. (logging's QueueListener + FileHandler does the same at
    twice the CPU per record: a LogRecord, a formatter and a lock per line.)
    """

    def __init__(self, path: Path) -> None:
        open_private(path)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # closed by close()
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="orka-audit", daemon=True)
        self._thread.start()

    def write(self, line: str) -> None:
        self._queue.put(line)

    def _run(self) -> None:
        failed = False
        while True:
            lines: list[str] = []
            line = self._queue.get()
            while line is not None:
                lines.append(line)
                if self._queue.empty():
                    break
                line = self._queue.get_nowait()
            if lines:
                try:
                    self._file.writelines(f"{x}\n" for x in lines)
                    self._file.flush()
                    failed = False
                except OSError as err:
                    if not failed:  # once per outage, not once per record
                        log.error("cannot write the audit log", path=str(self.path), error=str(err))
                    failed = True
            if line is None:
                return

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._file.close()


class AuditLog:
    """The controller API's `auditor` (see orka.rpc.server.Auditor)."""

    def __init__(self, path: Path | None = None, reads: bool = False) -> None:
        self.path = path
        self.reads = reads
        self._writer = _LineWriter(path) if path is not None else None

    def wants(self, method: str) -> bool:
        return self.reads or not method.startswith(READ_PREFIXES)

    def record(self, call: Call) -> None:
        record = to_record(call)
        # The services' log renderers do not print logger names: name it in the entry, so that
        # `jq 'select(.logger == "orka.audit")'` finds the records in a service's log.
        if call.code is grpc.StatusCode.OK:
            log.info("audit", logger=LOGGER, **record)
        else:
            log.warning("audit", logger=LOGGER, **record)
        if self._writer is not None:
            # ASCII JSON: a U+2028 in a name cannot split one record over two lines.
            self._writer.write(json.dumps(record, separators=(",", ":")))

    def close(self) -> None:
        """Write what is queued and close the file; idempotent."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
