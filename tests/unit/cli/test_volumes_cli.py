"""Volumes in the CLI: `kind: volume` manifests and the table, text, json and yaml views."""

from __future__ import annotations

import json

import pytest
import yaml

from orka.cli import output
from orka.cli import volumes as cli
from orka.cli.manifest import parse_manifests
from orka.errors import Invalid
from orka.models import Volume, VolumeSpec, VolumeState, WorkloadSpec
from orka.rpc import convert_volumes

NOW = 1_000_000.0
MI = 1 << 20

MANIFEST = """
kind: volume
name: data-1
size: 64Mi
class: fast
pool: ssd
backend: ext4
---
kind: process
name: web
command: [sleep, "100"]
volumes: [{volume: data-1, mount_path: /data}]
"""


def test_manifest_holds_volumes_and_workloads() -> None:
    data, web = parse_manifests(MANIFEST, "f.yaml")
    assert data == VolumeSpec(
        name="data-1", size_bytes=64 * MI, class_name="fast", pool="ssd", backend="ext4"
    )
    assert isinstance(web, WorkloadSpec)
    assert [(m.volume, m.mount_path) for m in web.volumes] == [("data-1", "/data")]
    # Volumes alone are a manifest too; a volume and a workload may share a name.
    [alone] = parse_manifests("kind: volume\nname: v\nsize: 1Gi\n", "g.yaml")
    assert alone == VolumeSpec(name="v", size_bytes=1 << 30)
    with pytest.raises(Invalid, match=r"volume .v. is already defined in g\.yaml: document 1"):
        parse_manifests("kind: volume\nname: v\nsize: 1Gi\n---\n" * 2, "g.yaml")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("kind: volume\nname: v\n", "f.yaml: document 1: size: is required (e.g. 64Mi, 1Gi)"),
        ("kind: volume\nname: v\nsize: lots\n", "f.yaml: document 1: size: 'lots' is not a"),
        ("kind: volume\nname: v\nsize: 1Ki\n", "f.yaml: document 1: size: 1024 bytes is not"),
        ("kind: volume\nname: V!\nsize: 1Gi\n", "f.yaml: document 1: name: name 'V!' must be"),
        ("kind: volume\nname: v\nsize: 1Gi\nbackend: zfs\n", "document 1: backend: 'zfs' is"),
        ("kind: volume\nname: v\nsize: 1Gi\nmount: /x\n", "unknown key 'mount' in a kind: volume"),
    ],
)
def test_bad_volume_documents(doc: str, message: str) -> None:
    with pytest.raises(Invalid) as info:
        parse_manifests(doc, "f.yaml")
    assert message in info.value.message


def volume(name: str, **kw: object) -> Volume:
    spec = VolumeSpec(name=name, size_bytes=64 * MI, class_name="fast")
    return Volume(
        spec=spec, created_at=NOW - 30, updated_at=NOW - 10, created_by="admin", etag="e1", **kw
    )  # type: ignore[arg-type]


def test_volumes_table() -> None:
    items = [
        volume(
            "data-1", state=VolumeState.ATTACHED, node="n1", backend="ext4", attached_to=["a", "b"]
        ),
        volume("data-2"),
    ]
    assert cli.table(items).splitlines() == [
        "NAME     SIZE   STATE      NODE     BACKEND   ATTACHED",
        "data-1   64Mi   ATTACHED   n1       ext4      a,b",
        "data-2   64Mi   PENDING    <none>   <none>    <none>",
    ]


def test_describe_volume_says_where_its_data_lives() -> None:
    v = volume("t-web-1", state=VolumeState.LOST, node="n2", backend="qcow2", workload="web")
    v = v.model_copy(update={"ordinal": 1, "message": "node n2 is lost"})
    text = cli.describe(v, now=NOW)
    assert "State:       LOST" in text
    assert "Template of: workload web, replica 1" in text
    assert "Message:     node n2 is lost" in text
    assert text.endswith("Data lives on node n2's disk only: if that node is lost, so is the data.")
    assert "Node:        <none> (placed when" in cli.describe(volume("d"), now=NOW)


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_volume_json_and_yaml_are_the_api_shape(fmt: str) -> None:
    v = volume("data-1", state=VolumeState.AVAILABLE, node="n1")
    text = output.dump([v], fmt)
    [doc] = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    assert doc["spec"] == {
        "name": "data-1",
        "size_bytes": 64 * MI,
        "class_name": "fast",
        "pool": "",
        "backend": "",
    }
    assert (doc["state"], doc["node"], doc["etag"]) == ("AVAILABLE", "n1", "e1")
    assert doc["create_time"] == "1970-01-12T13:46:10Z"


def test_volume_round_trips_the_wire() -> None:
    v = volume("data-1", state=VolumeState.RELEASED, node="n1", workload="web", attached_to=[])
    back = convert_volumes.volume_from_pb(convert_volumes.volume_to_pb(v))
    assert back == v
