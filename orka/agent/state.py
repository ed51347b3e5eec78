"""The agent's small local state file, so a restarted agent knows what it was running."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import operator
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import structlog
from pydantic import BaseModel, Field, ValidationError

from orka.agent import offload
from orka.filemodes import PRIVATE_DIR, PRIVATE_FILE, tighten_file
from orka.memo import ByIdentity
from orka.models import InstancePhase, VolumeAttachment, WorkloadSpec

log = structlog.get_logger("orka.agent.state")


class InstanceRecord(BaseModel):
    name: str
    workload: str
    generation: int
    spec: WorkloadSpec
    phase: InstancePhase
    restarts: int = 0
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    reason: str = ""
    message: str = ""
    # Its volumes as assigned (a restart after an agent restart mounts them again).
    volumes: list[VolumeAttachment] = Field(default_factory=list)


class AgentState(BaseModel):
    node: str
    instances: dict[str, InstanceRecord] = Field(default_factory=dict)


# The fields of each instance's record besides its spec, in the model's order, and one call
# that reads them all from an instance. (Their values are what json writes as is: the phase
# is a StrEnum.)
_STATUS_FIELDS = tuple(
    name for name in InstanceRecord.model_fields if name not in ("spec", "volumes")
)
_status_values = operator.attrgetter(*_STATUS_FIELDS)

# A spec's JSON text, made once per spec (specs are frozen) and spliced into every write.
_spec_json: ByIdentity[WorkloadSpec, str] = ByIdentity(
    lambda spec: spec.model_dump_json(), weigh=len, max_weight=32 << 20
)


class RecordSource(Protocol):
    """What an instance record is written from: the agent's own instance (every field of
    InstanceRecord, read as attributes)."""

    name: str
    spec: WorkloadSpec


def _entry(inst: RecordSource, values: tuple[object, ...]) -> str:
    """One instance's `"name":{record}` text; `values` are its status fields'."""
    status = json.dumps(dict(zip(_STATUS_FIELDS, values, strict=True)), separators=(",", ":"))
    # Its volumes (few, usually none) are encoded each time too.
    volumes = ",".join(v.model_dump_json() for v in getattr(inst, "volumes", ()))
    status = f'{status[:-1]},"volumes":[{volumes}]}}'
    return f'{json.dumps(inst.name)}:{status[:-1]},"spec":{_spec_json(inst.spec)}}}'


def _document(node: str, entries: Iterable[str]) -> str:
    return f'{{"node":{json.dumps(node)},"instances":{{{",".join(entries)}}}}}'


def encode_state(node: str, instances: Iterable[RecordSource]) -> str:
    """AgentState's JSON, what `AgentState(...).model_dump_json()` gives (each record's fields
    in another order), without building the models: the agent writes it on every (coalesced)
    change. The fields are the model's: each record's are InstanceRecord's, read from the
    instance; only the few status fields are encoded each time, the spec (most of the text)
    is spliced in."""
    return _document(node, (_entry(inst, _status_values(inst)) for inst in instances))


class StateEncoder:
    """`encode_state` for one node whose instances change a few at a time: each record's text
    is kept from the last write and made again only when one of its status fields differs
    (compared by value, so nothing has to say what changed). A write while many instances
    start then encodes the few that changed, not every record the node holds; what is left
    per write is joining the texts. An instance's spec and volumes are fixed for its life,
    so a record is only reused for the same instance object."""

    def __init__(self, node: str) -> None:
        self.node = node
        # name -> (the instance, its status values, its record's text), as last written.
        self._entries: dict[str, tuple[RecordSource, tuple[object, ...], str]] = {}

    def encode(self, instances: Iterable[RecordSource]) -> str:
        entries: dict[str, tuple[RecordSource, tuple[object, ...], str]] = {}
        last = self._entries
        for inst in instances:
            values = _status_values(inst)
            kept = last.get(inst.name)
            if kept is not None and kept[0] is inst and kept[1] == values:
                entries[inst.name] = kept
            else:
                entries[inst.name] = (inst, values, _entry(inst, values))
        # Rebuilt each time: instances gone since the last write are dropped with it.
        self._entries = entries
        return _document(self.node, (text for _, _, text in entries.values()))


# What `StateFile.save` takes: the state (a model, or its JSON text already encoded, as the
# agent writes it with `encode_state`), or a function that builds one of those at write time.
StateValue = AgentState | str
StateSource = StateValue | Callable[[], StateValue]


class StateFile:
    """Written atomically (temp file + rename) and coalesced, never from the event loop.

    Crash safety, and why there is no fsync: the file exists so that a restarted *agent
    process* finds the tasks it left running. A process crash (SIGKILL, OOM) leaves the page
    cache intact, so an atomic rename is all that is needed for the file to read whole and
    current. Only a kernel crash or power loss can lose an un-fsynced write, and that also
    ends every task the file describes (child processes, containers and VMs do not survive
    the reboot), so there is nothing left to re-adopt; a file lost or torn that way reads as
    empty (see `load`) and the controller, which holds the truth, replaces what was there.

    Writes are trailing-edge debounced: the first change after a write waits `delay` seconds
    for more to pile up (STARTING then RUNNING of one instance, a burst of starts), then one
    write carries all of them. `save` takes either a state or a function that builds one, so
    a burst of changes builds the state once, at write time, not once per change. What a
    crash can lose is the last `delay` seconds of changes: an instance started just before
    is then an orphan the restarted agent removes, and the controller places it again.
    """

    def __init__(self, path: Path, delay: float = 0.25) -> None:
        self.path = path
        self.delay = delay
        self._dirty = asyncio.Event()
        self._pending: StateSource | None = None
        self._task: asyncio.Task[None] | None = None
        self._dir_made = False
        # Generations of saves requested and written, so `persist` can wait for its own.
        self._requested = 0
        self._written = 0
        self._urgent = asyncio.Event()
        self._written_event = asyncio.Event()
        # How the last write ended: None, or why it failed.
        self._error: OSError | None = None

    def load(self, node: str) -> AgentState:
        tighten_file(self.path)  # one written 0644 by an older agent
        try:
            data = json.loads(self.path.read_text())
            state = AgentState.model_validate(data)
        except FileNotFoundError:
            return AgentState(node=node)
        except (ValueError, ValidationError) as err:
            # A corrupt file must not keep the agent from starting: the driver's own records
            # still let it find running tasks, which it then treats as orphans.
            # Not str(err): pydantic's message quotes the input, and specs hold secret values.
            log.warning("ignoring unreadable state file", path=str(self.path), error=_reason(err))
            return AgentState(node=node)
        if state.node != node:
            log.warning("state file belongs to another node", path=str(self.path), node=state.node)
            return AgentState(node=node)
        return state

    def save(self, state: StateSource) -> None:
        """Schedule a write of `state` (or of what the function returns at write time)."""
        self._pending = state
        self._requested += 1
        self._dirty.set()
        self.writer()

    def writer(self) -> asyncio.Task[None]:
        """The task that writes (started now if it is not running): the agent supervises it,
        since saves that silently stopped being written would leave a restarted agent
        re-adopting an old picture."""
        if self._task is None:
            self._task = asyncio.create_task(self._writer(), name="state-writer")
        return self._task

    async def persist(self) -> None:
        """Return once everything saved so far is on disk, written now rather than after the
        delay. The agent calls it before it starts a task, so a task never runs unrecorded: a
        crash right after the start still finds it in the file and re-adopts it. Raises the
        OSError of the write if it failed (a full or read-only disk)."""
        target = self._requested
        if self._written >= target or self._task is None:
            return
        self._urgent.set()
        while self._written < target:
            await self._written_event.wait()
        if self._error is not None:
            raise self._error

    def _take(self) -> bytes | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        state = pending() if callable(pending) else pending
        if isinstance(state, AgentState):
            return state.model_dump_json().encode()
        return state.encode()

    async def _writer(self) -> None:
        while True:
            await self._dirty.wait()
            if not self._urgent.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.delay):
                        await self._urgent.wait()
            self._urgent.clear()
            self._dirty.clear()
            generation = self._requested
            data = self._take()
            if data is not None:
                try:
                    await offload.run(functools.partial(self._write, data))
                    self._error = None
                except OSError as err:
                    # Waiters hear of it (see persist); the next change tries again.
                    log.error("could not write the state file", path=str(self.path), error=str(err))
                    self._error = err
            self._written = generation
            done, self._written_event = self._written_event, asyncio.Event()
            done.set()

    def _write(self, data: bytes) -> None:
        # On the offload thread, which runs writes one at a time and in order: a write whose
        # waiter was cancelled still finishes before the next one starts.
        if not self._dir_made:
            # A new folder is owner-only; an existing one keeps its mode: the agent makes its
            # data dir traversable (0711) so workloads reach their work dirs under it.
            self.path.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
            self._dir_made = True
        tmp = self.path.with_suffix(".tmp")
        # Owner-only from creation (the specs in it hold secret values); the rename carries the
        # mode over to the state file, so an older 0644 file is replaced by a 0600 one.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), PRIVATE_FILE)  # a .tmp left by a crash keeps its old mode
            f.write(data)
        os.replace(tmp, self.path)

    async def flush(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._dirty.clear()
        data = self._take()
        if data is not None:
            await offload.run(functools.partial(self._write, data))


def _reason(err: ValueError | ValidationError) -> str:
    """Why the file did not load, without the file's content."""
    if isinstance(err, ValidationError):
        where = [".".join(str(p) for p in e["loc"]) for e in err.errors(include_input=False)]
        return f"{err.error_count()} invalid field(s): {', '.join(where[:5])}"
    if isinstance(err, json.JSONDecodeError):
        return f"not JSON: {err.msg} at line {err.lineno} column {err.colno}"
    return type(err).__name__
