"""The public API as a user sees it: the real grpcurl binary against an in-process cluster."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orka.security.issue import init_certs
from tests.integration.cluster import Cluster, eventually

SERVICE = "orka.v1.Controller"
GRPCURL_TIMEOUT = 30.0
# The messages gRPC and Go's TLS stack print when a handshake or connection is refused.
REFUSED_HINTS = (
    "failed to dial",
    "handshake",
    "tls",
    "certificate",
    "broken pipe",
    "connection reset",
    "connection closed",
    "eof",
    "code: unavailable",
)


def _grpcurl_binary() -> str:
    beside = Path(sys.executable).parent / "grpcurl"
    if beside.exists():
        return str(beside)
    found = shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl not found; install the dev extras: pip install -e '.[dev]'")
    return found


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        assert self.code == 0, f"grpcurl failed ({self.code}): {self.err}"
        return json.loads(self.out)

    def status(self) -> str:
        """The gRPC code grpcurl printed as `Code: X`, or "" when it printed none."""
        for line in self.err.splitlines():
            key, _, value = line.strip().partition(":")
            if key == "Code":
                return value.strip()
        return ""

    def details(self) -> list[dict[str, Any]]:
        """The google.rpc detail messages grpcurl printed under `Details:` (`1)\t{json}`)."""
        out = []
        for line in self.err.splitlines():
            number, sep, doc = line.strip().partition(")")
            if sep and number.isdigit() and doc.strip().startswith("{"):
                out.append(json.loads(doc))
        return out

    def detail(self, type_name: str) -> dict[str, Any]:
        found = [d for d in self.details() if d["@type"].endswith(f"/google.rpc.{type_name}")]
        assert len(found) == 1, self.err
        return found[0]

    def message(self) -> str:
        for line in self.err.splitlines():
            key, _, value = line.strip().partition(":")
            if key == "Message":
                return value.strip()
        return ""


class Grpcurl:
    def __init__(self, target: str, certs: Path) -> None:
        self.binary = _grpcurl_binary()
        self.target = target
        self.certs = certs
        # grpc-go honours proxy variables; a local test server must be dialled directly.
        self.env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}

    def tls(self, stem: str | None = "admin", certs: Path | None = None) -> list[str]:
        args = ["-cacert", str(self.certs / "ca.crt")]
        if stem is not None:
            d = certs or self.certs
            # A service's pair lives in its own folder (orka.security.issue), an admin's on top.
            d = d / stem if (d / stem).is_dir() else d
            args += ["-cert", str(d / f"{stem}.crt"), "-key", str(d / f"{stem}.key")]
        return args

    async def run(self, *args: str, tls: list[str] | None = None) -> Result:
        argv = [self.binary, *(self.tls() if tls is None else tls), *args]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), GRPCURL_TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"grpcurl timed out: {argv}") from None
        assert proc.returncode is not None
        return Result(proc.returncode, out.decode(), err.decode())

    async def list(self, tls: list[str] | None = None) -> Result:
        return await self.run("-connect-timeout", "10", self.target, "list", tls=tls)

    async def call(
        self, method: str, data: dict[str, Any] | None = None, tls: list[str] | None = None
    ) -> Result:
        return await self.run(
            "-connect-timeout",
            "10",
            "-max-time",
            "20",
            "-d",
            json.dumps(data or {}),
            self.target,
            f"{SERVICE}/{method}",
            tls=tls,
        )


def web_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "web",
        "kind": "PROCESS",
        "command": ["sleep", "60"],
        "replicas": 2,
    }
    spec.update(overrides)
    return spec


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path / "data")
    try:
        await c.start(agents=2, runtimes=["fake"])
        yield c
    finally:
        await c.stop()


@pytest.fixture
def grpcurl(cluster: Cluster, certs_dir: Path) -> Grpcurl:
    assert cluster.controller is not None
    return Grpcurl(f"127.0.0.1:{cluster.controller.port}", certs_dir)


async def _workload_names(grpcurl: Grpcurl) -> list[str]:
    body = (await grpcurl.call("ListWorkloads")).json()
    return sorted(w["spec"]["name"] for w in body.get("workloads", []))


async def test_list_shows_controller_health_and_reflection(grpcurl: Grpcurl) -> None:
    result = await grpcurl.list()
    assert result.code == 0, result.err
    services = set(result.out.split())
    assert SERVICE in services
    assert "grpc.health.v1.Health" in services
    assert any(s.startswith("grpc.reflection.") for s in services), services


async def test_create_list_and_run_a_workload(grpcurl: Grpcurl) -> None:
    created = (await grpcurl.call("CreateWorkload", {"spec": web_spec()})).json()
    assert created["spec"]["name"] == "web"
    assert created["spec"]["kind"] == "PROCESS"
    assert created["spec"]["replicas"] == 2

    assert await _workload_names(grpcurl) == ["web"]
    got = (await grpcurl.call("GetWorkload", {"name": "web"})).json()
    assert got["spec"]["command"] == ["sleep", "60"]

    async def two_running() -> list[dict[str, Any]] | None:
        body = (await grpcurl.call("ListInstances", {"workload": "web"})).json()
        running = [i for i in body.get("instances", []) if i.get("phase") == "RUNNING"]
        return running if len(running) == 2 else None

    running = await eventually(two_running, interval=0.2)
    assert {i["workload"] for i in running} == {"web"}
    assert {i["node"] for i in running} <= {"node-1", "node-2"}
    assert all(i["node"] for i in running)


# What grpcurl prints for a google.protobuf.Timestamp: RFC 3339 in UTC, with 0, 3, 6 or 9
# digits (the controller keeps microseconds). grpcurl names fields as the .proto does.
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3}|\.\d{6}|\.\d{9})?Z$")


async def test_times_are_rfc3339_and_a_stale_etag_is_aborted(
    grpcurl: Grpcurl, cluster: Cluster
) -> None:
    before = dt.datetime.now(dt.UTC)
    created = (await grpcurl.call("CreateWorkload", {"spec": web_spec()})).json()
    assert RFC3339.match(created["create_time"]), created
    when = dt.datetime.fromisoformat(created["create_time"])
    assert before - dt.timedelta(seconds=1) <= when <= dt.datetime.now(dt.UTC)
    assert created["spec"]["stop_grace_period"] == "10s"  # the default, as a Duration

    async def running_on_a_node() -> dict[str, Any] | None:
        body = (await grpcurl.call("ListInstances", {"workload": "web"})).json()
        started = [i for i in body.get("instances", []) if "start_time" in i]
        return started[0] if started else None

    inst = await eventually(running_on_a_node, interval=0.2)
    for key in ("create_time", "update_time", "schedule_time", "start_time"):
        assert RFC3339.match(inst[key]), (key, inst)
    assert "end_time" not in inst  # not ended: unset, not 1970

    async def counted() -> list[dict[str, Any]] | None:
        nodes = (await grpcurl.call("ListNodes")).json()["nodes"]
        return nodes if sum(n.get("instance_count", 0) for n in nodes) == 2 else None

    nodes = await eventually(counted, interval=0.2)
    assert all(RFC3339.match(n["last_heartbeat_time"]) for n in nodes), nodes

    # The etag as grpcurl shows it makes an update conditional; once stale, ABORTED.
    etag = created["etag"]
    update = {"spec": web_spec(replicas=3), "etag": etag}
    assert (await grpcurl.call("UpdateWorkload", update)).json()["spec"]["replicas"] == 3
    stale = await grpcurl.call("UpdateWorkload", {"spec": web_spec(replicas=1), "etag": etag})
    assert stale.status() == "Aborted", stale.err
    assert "re-read it" in stale.message()
    assert (await grpcurl.call("GetWorkload", {"name": "web"})).json()["spec"]["replicas"] == 3


def _assert_refused(result: Result) -> None:
    assert result.code != 0, f"call without a trusted client cert succeeded: {result.out}"
    assert result.out.strip() == "", result.out
    text = result.err.lower()
    assert any(hint in text for hint in REFUSED_HINTS), result.err
    # Refused at the TLS layer, not by the servicer.
    assert result.status() not in ("PermissionDenied", "InvalidArgument", "NotFound"), result.err


async def test_no_client_certificate_is_refused(grpcurl: Grpcurl) -> None:
    _assert_refused(await grpcurl.call("ListWorkloads", tls=grpcurl.tls(stem=None)))
    _assert_refused(await grpcurl.list(tls=grpcurl.tls(stem=None)))


async def test_certificate_from_another_ca_is_refused(grpcurl: Grpcurl, tmp_path: Path) -> None:
    other = tmp_path / "other-ca"
    init_certs(other, nodes=["node-1"])
    for stem in ("admin", "agent-node-1"):
        result = await grpcurl.call("ListWorkloads", tls=grpcurl.tls(stem=stem, certs=other))
        _assert_refused(result)


async def test_agent_certificate_is_permission_denied(grpcurl: Grpcurl) -> None:
    agent = grpcurl.tls(stem="agent-node-1")
    for method, data in [
        ("ListWorkloads", {}),
        ("CreateWorkload", {"spec": web_spec(name="sneaky")}),
    ]:
        result = await grpcurl.call(method, data, tls=agent)
        assert result.code != 0, result.out
        assert result.status() == "PermissionDenied", result.err
    assert await _workload_names(grpcurl) == []


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        pytest.param(
            {k: v for k, v in web_spec().items() if k != "name"}, "spec.name", id="no-name"
        ),
        pytest.param(
            {k: v for k, v in web_spec().items() if k != "kind"}, "spec.kind", id="no-kind"
        ),
        pytest.param(
            web_spec(resources={"cpuMillis": "-5"}), "spec.resources.cpu_millis", id="negative-cpu"
        ),
        pytest.param(web_spec(replicas=100000), "spec.replicas", id="too-many-replicas"),
    ],
)
async def test_bad_spec_is_invalid_argument_naming_the_field_in_its_details(
    grpcurl: Grpcurl, spec: dict[str, Any], field: str
) -> None:
    before = await _workload_names(grpcurl)
    result = await grpcurl.call("CreateWorkload", {"spec": spec})
    assert result.code != 0, result.out
    assert result.status() == "InvalidArgument", result.err
    assert field in result.message(), result.err
    # The details grpcurl prints: the reason, and the field as a BadRequest violation.
    info = result.detail("ErrorInfo")
    assert (info["reason"], info["domain"]) == ("INVALID_ARGUMENT", "orka.io"), result.err
    violations = result.detail("BadRequest")["field_violations"]
    assert [v["field"] for v in violations] == [field], result.err
    assert violations[0]["description"], result.err
    assert await _workload_names(grpcurl) == before


async def test_not_found_and_already_exists(grpcurl: Grpcurl) -> None:
    missing = await grpcurl.call("GetWorkload", {"name": "no-such-workload"})
    assert missing.code != 0, missing.out
    assert missing.status() == "NotFound", missing.err

    assert (await grpcurl.call("CreateWorkload", {"spec": web_spec()})).code == 0
    again = await grpcurl.call("CreateWorkload", {"spec": web_spec(replicas=1)})
    assert again.code != 0, again.out
    assert again.status() == "AlreadyExists", again.err
    assert await _workload_names(grpcurl) == ["web"]
    # The rejected duplicate changed nothing.
    assert (await grpcurl.call("GetWorkload", {"name": "web"})).json()["spec"]["replicas"] == 2


def _json_stream(text: str) -> list[Any]:
    """grpcurl prints each streamed message as its own JSON document."""
    decoder, docs, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        doc, pos = decoder.raw_decode(text, pos)
        docs.append(doc)
    return docs


@pytest.mark.parametrize("rpc", ["WatchEvents", "WatchEventBatches"])
async def test_watch_streams_the_changes_of_a_workload(
    grpcurl: Grpcurl, cluster: Cluster, rpc: str
) -> None:
    assert cluster.controller is not None
    hub = cluster.controller.events
    watch = asyncio.create_task(
        grpcurl.run(
            "-connect-timeout",
            "10",
            "-max-time",
            "6",
            "-d",
            json.dumps({"workload": "web"}),
            grpcurl.target,
            f"{SERVICE}/{rpc}",
        )
    )

    async def subscribed() -> bool:
        return bool(hub.subscribers)

    await eventually(subscribed)
    assert (await grpcurl.call("CreateWorkload", {"spec": web_spec()})).code == 0
    result = await watch
    # The stream never ends by itself: grpcurl's -max-time does.
    assert result.status() == "DeadlineExceeded", result.err
    docs = _json_stream(result.out)
    events = [e for d in docs for e in d["events"]] if rpc == "WatchEventBatches" else docs
    assert events[0]["type"] == "ADDED" and events[0]["workload"]["spec"]["name"] == "web"
    phases: dict[str, list[str]] = {}
    for e in events:
        if "instance" in e:
            phases.setdefault(e["instance"]["name"], []).append(e["instance"]["phase"])
    assert len(phases) == 2
    assert all(p[0] == "PENDING" and p[-1] == "RUNNING" for p in phases.values()), phases
