"""Property tests (hypothesis) over every controller RPC and over agent messages to the
scheduler, on a real cluster (grpc.aio servers on port 0, mutual TLS, a fake-driver agent):

- no request is answered INTERNAL or UNKNOWN, and no error message is long;
- a refused request leaves the state it could have changed as it was;
- the services keep serving afterwards (a new workload still runs).

Example counts are modest: the whole file runs in well under a minute.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc import status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.rpc import server
from orka.rpc.client import secure_channel
from orka.security.tls import TlsFiles
from tests.integration.cluster import Cluster, eventually

T = TypeVar("T")

NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# Errors quote at most 64 characters of any value; a message this long echoes input.
MAX_DETAILS = 1500

SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


async def check_examples(
    strategy: st.SearchStrategy[T], check: Callable[[T], Awaitable[None]], max_examples: int
) -> None:
    """Run `check` on examples of `strategy`. Hypothesis drives from a worker thread and
    each example runs on this event loop, where the cluster's servers run too."""
    loop = asyncio.get_running_loop()

    @settings(SETTINGS, max_examples=max_examples)
    @given(strategy)
    def example(value: T) -> None:
        asyncio.run_coroutine_threadsafe(check(value), loop).result(timeout=60)

    await asyncio.to_thread(example)


# ---- strategies ----

# Text as an attacker sends it: control characters, NUL, paths, long runs, reserved prefixes.
# (No surrogates: protobuf strings are UTF-8 and cannot hold them.)
_chars = st.characters(exclude_categories=("Cs",))
hostile = st.one_of(
    st.text(_chars, max_size=40),
    st.sampled_from(
        [
            "",
            "web",
            "a\0b",
            "a\x1b[2J",
            "../etc",
            "/ok/path",
            "/a/../b",
            "//x",
            "rel/path",
            "orka.io/node",
            "Web",
            "a" * 64,
            "\n",
            "x\x85y",
        ]
    ),
    st.integers(1_000, 200_000).map(lambda n: "z" * n),
)
# A few names come up again and again, so creates, updates and deletes meet the same objects.
POOL = st.sampled_from(["web", "db", "api"])
names = st.one_of(
    POOL,
    POOL,
    st.from_regex(r"[a-z][a-z0-9-]{0,6}[a-z0-9]", fullmatch=True),
    hostile,
)
ints = st.one_of(
    st.integers(-3, 4),
    st.sampled_from([-(2**31), -1, 1001, 2**31 - 1, 10_000]),
)
int64s = st.one_of(st.integers(0, 4000), st.sampled_from([-1, -(2**63), 2**63 - 1]))
floats = st.one_of(
    st.floats(-10, 4000),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308]),
)
enum_ints = st.integers(-2, 6)


# Each field a spec can be spoiled in, with what goes there. A spec is mostly valid with at
# most two fields spoiled, so most examples get past the first check to the later ones.
SPEC_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "name": hostile,
    "kind": enum_ints,
    "image": st.one_of(hostile, st.just("oci-archive:/x.tar")),
    "command": st.lists(hostile, max_size=4),
    "env": st.dictionaries(hostile, hostile, max_size=3),
    "replicas": ints,
    "resources": st.builds(pb.Resources, cpu_millis=int64s, memory_bytes=int64s),
    "node_selector": st.dictionaries(hostile, hostile, max_size=2),
    "restart_policy": enum_ints,
    "working_dir": hostile,
    "max_per_node": ints,
    "stop_grace_period": st.builds(
        Duration,
        seconds=st.one_of(st.integers(-10, 4000), int64s),
        nanos=st.integers(-(2**31), 2**31 - 1),
    ),
    "vm": st.builds(pb.VmSpec, kernel=hostile, initrd=hostile, cmdline=hostile),
}


def spoil(msg: Any, field: str, value: Any) -> None:
    target = getattr(msg, field)
    if hasattr(target, "CopyFrom") and hasattr(value, "SerializeToString"):
        target.CopyFrom(value)
    elif isinstance(value, dict):
        target.clear()
        target.update(value)
    elif isinstance(value, list):
        del target[:]
        target.extend(value)
    else:
        setattr(msg, field, value)


@st.composite
def specs(draw: st.DrawFn) -> pb.WorkloadSpec:
    spec = pb.WorkloadSpec(
        name=draw(names),
        kind=pb.WorkloadSpec.PROCESS,
        command=draw(st.sampled_from([["sleep", "100"], ["true"], ["sh", "-c", "exit 1"]])),
        replicas=draw(st.integers(0, 3)),
        resources=pb.Resources(cpu_millis=draw(st.integers(0, 50)), memory_bytes=1 << 20),
        restart_policy=draw(st.integers(0, 3)),
        env=draw(st.sampled_from([{}, {"A": "1"}, {"FAKE_EXIT_AFTER": "0.2"}])),
    )
    for field in draw(st.lists(st.sampled_from(sorted(SPEC_FIELDS)), max_size=2, unique=True)):
        spoil(spec, field, draw(SPEC_FIELDS[field]))
    return spec


node_names = st.one_of(st.just("node-1"), names)
creates = st.tuples(st.just("CreateWorkload"), st.builds(pb.CreateWorkloadRequest, spec=specs()))
updates = st.tuples(st.just("UpdateWorkload"), st.builds(pb.UpdateWorkloadRequest, spec=specs()))
controller_calls = st.one_of(
    creates,
    creates,
    creates,
    updates,
    updates,
    updates,
    st.tuples(st.just("GetWorkload"), st.builds(pb.GetWorkloadRequest, name=names)),
    st.tuples(st.just("DeleteWorkload"), st.builds(pb.DeleteWorkloadRequest, name=names)),
    st.tuples(st.just("ListWorkloads"), st.just(pb.ListWorkloadsRequest())),
    st.tuples(
        st.just("ListInstances"),
        st.builds(pb.ListInstancesRequest, workload=names, node=node_names, phase=enum_ints),
    ),
    st.tuples(st.just("GetInstance"), st.builds(pb.GetInstanceRequest, name=names)),
    st.tuples(st.just("ListNodes"), st.just(pb.ListNodesRequest())),
    st.tuples(st.just("GetNode"), st.builds(pb.GetNodeRequest, name=node_names)),
    st.tuples(st.just("CordonNode"), st.builds(pb.CordonNodeRequest, name=node_names)),
    st.tuples(st.just("UncordonNode"), st.builds(pb.UncordonNodeRequest, name=node_names)),
    st.tuples(st.just("DrainNode"), st.builds(pb.DrainNodeRequest, name=node_names)),
    st.tuples(st.just("WatchEvents"), st.builds(pb.WatchEventsRequest, workload=names)),
    st.tuples(st.just("WatchEventBatches"), st.builds(pb.WatchEventsRequest, workload=names)),
)


def api_state(cluster: Cluster) -> dict[str, Any]:
    """What the API itself writes: workload specs and generations, node cordon and drain.
    (Workload status, instances and deletions in progress are the reconciler's, which runs
    meanwhile.)"""
    assert cluster.controller is not None
    repo = cluster.controller.repo
    return {
        "workloads": {
            n: (w.spec.model_dump_json(), w.generation)
            for n, w in repo.workloads.items()
            if not w.deleting
        },
        "nodes": {n: (node.schedulable, node.draining) for n, node in repo.nodes.items()},
    }


async def call_controller(cluster: Cluster, method: str, request: Any) -> grpc.StatusCode:
    assert cluster.api is not None
    rpc = getattr(cluster.api, method)
    try:
        if method.startswith("Watch"):
            stream = rpc(request, timeout=10)
            try:
                async with asyncio.timeout(0.1):
                    await stream.read()  # an error at once, or nothing to say yet
            except TimeoutError:
                pass
            finally:
                stream.cancel()
        else:
            await rpc(request, timeout=10)
    except grpc.aio.AioRpcError as err:
        assert err.code() not in NEVER, (method, err.code(), err.details())
        assert len(err.details() or "") < MAX_DETAILS, (method, err.details())
        return err.code()
    return grpc.StatusCode.OK


async def keeps_serving(cluster: Cluster, name: str) -> None:
    assert cluster.api is not None
    await cluster.api.UncordonNode(pb.UncordonNodeRequest(name="node-1"))
    spec = pb.WorkloadSpec(
        name=name, kind=pb.WorkloadSpec.PROCESS, command=["sleep", "100"], replicas=1
    )
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
    [inst] = await eventually(lambda: cluster.running(name))
    assert inst.node == "node-1"


# ---- the controller API ----


async def test_controller_rpcs_never_fail_internally_nor_change_state_on_refusal(
    cluster: Cluster,
) -> None:
    codes: dict[str, set[grpc.StatusCode]] = {}

    async def one(calls: list[tuple[str, Any]]) -> None:
        for method, request in calls:
            before = api_state(cluster)
            code = await call_controller(cluster, method, request)
            codes.setdefault(method, set()).add(code)
            if code is not grpc.StatusCode.OK:
                assert api_state(cluster) == before, (method, code)

    # A few calls per example, so one example can create a workload and then change it.
    await check_examples(st.lists(controller_calls, min_size=1, max_size=3), one, max_examples=120)
    assert sum(len(c) for c in codes.values()) >= 20  # many examples, many outcomes
    # The examples did reach both sides of the API: refusals and successes.
    assert grpc.StatusCode.INVALID_ARGUMENT in codes["CreateWorkload"]
    assert any(grpc.StatusCode.OK in c for c in codes.values())
    await keeps_serving(cluster, "zz-after-controller-fuzz")


# ---- agent messages to the scheduler ----

STATUS_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "name": hostile,
    "workload": hostile,
    "phase": enum_ints,
    "reason": hostile,
    "message": hostile,
    "restarts": ints,
    "started_at": floats,
    "finished_at": floats,
    "generation": int64s,
    "resources": st.builds(pb.Resources, cpu_millis=int64s, memory_bytes=int64s),
}


@st.composite
def statuses(draw: st.DrawFn) -> apb.InstanceStatus:
    status = apb.InstanceStatus(
        name=draw(st.sampled_from(["web-1", "web-2", "db-1"])),
        workload=draw(st.sampled_from(["web", "db"])),
        phase=draw(st.integers(1, 9)),
        started_at=draw(st.sampled_from([0.0, 1.7e9])),
    )
    for field in draw(st.lists(st.sampled_from(sorted(STATUS_FIELDS)), max_size=1)):
        spoil(status, field, draw(STATUS_FIELDS[field]))
    return status


NODE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "capacity": st.builds(pb.Resources, cpu_millis=int64s, memory_bytes=int64s),
    "allocatable": st.builds(pb.Resources, cpu_millis=int64s, memory_bytes=int64s),
    "labels": st.dictionaries(hostile, hostile, max_size=3),
    "drivers": st.lists(st.one_of(st.just("fake"), hostile), max_size=3),
    "version": hostile,
}


@st.composite
def registers(draw: st.DrawFn) -> apb.Register:
    cpu = draw(st.integers(1, 4000))
    node = apb.NodeInfo(
        capacity=pb.Resources(cpu_millis=cpu, memory_bytes=1 << 30),
        allocatable=pb.Resources(cpu_millis=cpu, memory_bytes=1 << 30),
        labels=draw(st.sampled_from([{}, {"zone": "a"}, {"zone": "b", "disk": "ssd"}])),
        drivers=["fake"],
    )
    for field in draw(st.lists(st.sampled_from(sorted(NODE_FIELDS)), max_size=2, unique=True)):
        spoil(node, field, draw(NODE_FIELDS[field]))
    return apb.Register(node=node, instances=draw(st.lists(statuses(), max_size=2)))


# A google.rpc.Status as an agent might send one: any code (unknown ones too), any message.
rpc_statuses = st.builds(
    status_pb2.Status, code=st.one_of(st.integers(-1, 20), ints), message=hostile
)


leaf_messages = st.one_of(
    st.builds(apb.AgentMessage, register=registers()),
    st.builds(
        apb.AgentMessage,
        heartbeat=st.builds(
            apb.Heartbeat,
            usage=st.builds(pb.Resources, cpu_millis=int64s, memory_bytes=int64s),
            instances=st.lists(statuses(), max_size=3),
            sent_at=floats,
        ),
    ),
    st.builds(apb.AgentMessage, instance_status=statuses()),
    st.builds(
        apb.AgentMessage,
        offer_reply=st.builds(apb.OfferReply, offer_id=hostile, status=rpc_statuses),
    ),
    st.builds(
        apb.AgentMessage,
        ack=st.builds(apb.CommandAck, command_id=hostile, status=rpc_statuses),
    ),
    st.builds(apb.AgentMessage, leave=st.builds(apb.Leave, reason=hostile)),
    st.just(apb.AgentMessage()),
)
agent_messages = st.one_of(
    leaf_messages,
    st.lists(leaf_messages, max_size=3).map(
        lambda ms: apb.AgentMessage(batch=apb.AgentBatch(messages=ms))
    ),
)


def node_state(cluster: Cluster, name: str) -> tuple[Any, ...] | None:
    node = cluster.scheduler.registry.get(name)
    if node is None:
        return None
    # Not its state: liveness moves that with time (NOT_READY, LOST) between examples.
    return (dict(node.labels), node.capacity, node.allocatable, node.drivers)


async def test_agent_messages_never_fail_the_scheduler(
    cluster: Cluster, certs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The codes the servers end calls with, seen where they are decided: a client whose write
    # fails because the server already ended the stream reports INTERNAL "Internal error
    # from Core" instead of the server's code (grpc/grpc#36066, a grpcio aio client bug).
    server_codes: list[grpc.StatusCode] = []
    decide = server._abort_code

    def recorded(err: Exception) -> server.Abort:
        abort = decide(err)
        server_codes.append(abort.code)
        return abort

    monkeypatch.setattr(server, "_abort_code", recorded)
    # Registrations the scheduler accepted, seen there too: after such a client-side
    # failure the client may not even read the reply that was sent before.
    accepted: list[str] = []
    register = cluster.scheduler.gateway._register

    def register_recorded(session: Any, reg: apb.Register) -> Any:
        node = register(session, reg)
        accepted.append(session.node)
        return node

    monkeypatch.setattr(cluster.scheduler.gateway, "_register", register_recorded)

    # node-2's certificate: a node of its own, apart from the agent that keeps running.
    channel = secure_channel(
        f"127.0.0.1:{cluster.scheduler.port}",
        TlsFiles.for_service(certs_dir, "agent", "node-2"),
        "scheduler",
    )
    api = apb_grpc.SchedulerStub(channel)

    streams_sent: list[int] = []

    async def one(messages: list[apb.AgentMessage]) -> None:
        streams_sent.append(len(messages))
        before = node_state(cluster, "node-2")
        call = api.Connect(timeout=10)
        accepted.clear()
        write_failed = False
        try:
            for msg in messages:
                await call.write(msg)
            await call.done_writing()
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            write_failed = True  # the scheduler ended the stream early (refused a message)
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
            code = await call.code()
        except grpc.aio.AioRpcError as err:
            code = err.code()
            assert len(err.details() or "") < MAX_DETAILS, err.details()
        assert not NEVER & set(server_codes), server_codes
        if not write_failed:
            assert code not in NEVER, (code, await call.details())
        if not accepted:
            # Refused at (or before) registration: the node is as it was.
            assert node_state(cluster, "node-2") == before
        await eventually(lambda: _node_idle(cluster, "node-2"))

    # Mostly a registration first (to reach what follows it), sometimes anything.
    first = st.one_of(st.builds(apb.AgentMessage, register=registers()), agent_messages)
    streams = st.tuples(first, st.lists(agent_messages, max_size=4)).map(lambda t: [t[0], *t[1]])
    async with channel:
        await check_examples(streams, one, max_examples=60)
    assert len(streams_sent) >= 50
    await keeps_serving(cluster, "zz-after-agent-fuzz")


async def _node_idle(cluster: Cluster, name: str) -> bool:
    """The stream is gone on the scheduler's side too (so the next example starts afresh)."""
    node = cluster.scheduler.registry.get(name)
    return node is None or node.session is None
