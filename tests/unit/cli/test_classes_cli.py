"""`kind: class` manifests, `class:`/`pool:` on workloads, and the class and pool tables."""

from __future__ import annotations

import json

import pytest
import yaml

from orka.cli import classes, output
from orka.cli.manifest import parse_manifests
from orka.errors import Invalid
from orka.models import Class, ClassCount, Pool, Resources, WorkloadKind, WorkloadSpec
from orka.rpc.convert_classes import class_model_from_pb, class_to_pb, pool_from_pb, pool_to_pb

MI, GI = 1 << 20, 1 << 30
NOW = 1_000_000.0

DOCS = """
kind: class
name: small
cpu: 500m
memory: 512Mi
kinds: [process, container]
---
kind: class
name: fast
type: volume
minSize: 64Mi
max_size: 10Gi
backends: [ext4]
immediate: true
---
name: web
kind: process
command: sleep 100
class: small
pool: big
"""


def test_a_manifest_holds_classes_and_workloads_that_name_them() -> None:
    small, fast, web = parse_manifests(DOCS, "f.yaml")
    assert isinstance(small, Class) and small.compute is not None
    assert small.compute.resources == Resources(cpu_millis=500, memory_bytes=512 * MI)
    assert small.compute.kinds == [WorkloadKind.PROCESS, WorkloadKind.CONTAINER]
    assert isinstance(fast, Class) and fast.volume is not None
    assert (fast.volume.min_size_bytes, fast.volume.max_size_bytes) == (64 * MI, 10 * GI)
    assert (fast.volume.backends, fast.volume.immediate) == (["ext4"], True)
    assert isinstance(web, WorkloadSpec)
    assert (web.class_name, web.pool, web.resources) == ("small", "big", Resources())


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("kind: class\nname: x\n", r"document 1: compute.resources: a class needs cpu or memory"),
        ("kind: class\ncpu: 1\n", r"document 1: name: is required"),
        ("kind: class\nname: x\ncpu: lots\n", r"cpu: 'lots' is not a CPU quantity"),
        ("kind: class\nname: x\ncpu: 1\nkinds: [gpu]\n", r"kinds: 'gpu' is not one of"),
        ("kind: class\nname: x\ncpu: 1\nmax_size: 1Gi\n", r"unknown key 'max_size'"),
        ("kind: class\nname: x\ntype: disk\n", r"type: 'disk' is not one of compute, volume"),
        ("kind: class\nname: x\ntype: volume\nbackends: [zfs]\n", r"'zfs' is not a backend"),
        (
            "kind: class\nname: x\ntype: volume\nmin_size: 2Gi\nmax_size: 1Gi\n",
            r"min_size_bytes: is above max_size_bytes",
        ),
        ("kind: class\nname: x\ncpu: 1\n---\nkind: class\nname: x\ncpu: 2\n", r"class 'x' is"),
        ("name: w\nkind: process\ncommand: [x]\nclass: Big\n", r"class_name"),
    ],
)
def test_bad_class_documents_name_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(Invalid, match=match):
        parse_manifests(text, "f.yaml")


def test_a_class_and_a_workload_may_share_a_name() -> None:
    docs = parse_manifests(
        "kind: class\nname: web\ncpu: 1\n---\nname: web\nkind: process\ncommand: [x]\n"
    )
    assert [type(d) for d in docs] == [Class, WorkloadSpec]


def _classes() -> list[Class]:
    return [
        Class.model_validate(
            {
                "name": "small",
                "compute": {"resources": {"cpu_millis": 500, "memory_bytes": 512 * MI}},
                "created_at": NOW - 90,
                "updated_at": NOW - 10,
            }
        ),
        Class.model_validate(
            {
                "name": "vmish",
                "compute": {"resources": {"cpu_millis": 2000}, "kinds": ["VM"]},
                "created_at": NOW - 90,
                "updated_at": NOW - 10,
            }
        ),
        Class.model_validate(
            {
                "name": "fast",
                "volume": {"max_size_bytes": 10 * GI, "backends": ["ext4"], "immediate": True},
                "created_at": NOW - 90,
                "updated_at": NOW - 10,
            }
        ),
    ]


def test_classes_table() -> None:
    assert classes.classes_table(_classes(), now=NOW).splitlines() == [
        "NAME    TYPE                 CPU    MEMORY   KINDS   SIZE     BACKENDS   AGE",
        "small   compute              500m   512Mi    any     -        -          90s",
        "vmish   compute              2      <none>   vm      -        -          90s",
        "fast    volume (immediate)   -      -        -       0-10Gi   ext4       90s",
    ]


def _pools() -> list[Pool]:
    return [
        Pool(
            name="big",
            node_count=2,
            ready_node_count=1,
            allocatable=Resources(cpu_millis=8000, memory_bytes=16 * GI),
            allocated=Resources(cpu_millis=1500, memory_bytes=1536 * MI),
            available_classes=[
                ClassCount(class_name="large", count=1),
                ClassCount(class_name="small", count=6),
            ],
        ),
        Pool(name="default", node_count=1, allocatable=Resources(cpu_millis=500)),
    ]


def test_pools_table_counts_each_class() -> None:
    assert classes.pools_table(_pools()).splitlines() == [
        "POOL      NODES   READY   CPU       MEMORY       CLASSES",
        "big       2       1       1500m/8   1.5Gi/16Gi   large=1 small=6",
        "default   1       0       0/500m    0/0          <none>",
    ]


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_classes_and_pools_as_json_and_yaml(fmt: str) -> None:
    load = json.loads if fmt == "json" else yaml.safe_load
    [small, _, fast] = load(output.dump(_classes(), fmt))
    assert small["compute"]["resources"] == {"cpu_millis": 500, "memory_bytes": 512 * MI}
    assert small["create_time"] == "1970-01-12T13:45:10Z"
    assert fast["volume"]["backends"] == ["ext4"] and fast["compute"] is None
    big = load(output.dump(_pools()[0], fmt))
    assert big["available_classes"] == [
        {"class_name": "large", "count": 1},
        {"class_name": "small", "count": 6},
    ]
    assert big["allocated"] == {"cpu_millis": 1500, "memory_bytes": 1536 * MI}


def test_classes_and_pools_survive_the_wire() -> None:
    for c in _classes():
        assert class_model_from_pb(class_to_pb(c)) == c
    for p in _pools():
        assert pool_from_pb(pool_to_pb(p)) == p
