from __future__ import annotations

import hashlib

import pytest

from orka.errors import RuntimeFailure
from orka.models import Resources, WorkloadKind, WorkloadSpec
from orka.runtime import oci
from orka.runtime.base import RunSpec


@pytest.mark.parametrize(
    ("ref", "full"),
    [
        ("busybox", "docker.io/library/busybox:latest"),
        ("busybox:1.36", "docker.io/library/busybox:1.36"),
        ("me/app", "docker.io/me/app:latest"),
        ("ghcr.io/me/app:v1", "ghcr.io/me/app:v1"),
        ("localhost/app", "localhost/app:latest"),
        ("reg:5000/app", "reg:5000/app:latest"),
        ("busybox@sha256:ab", "docker.io/library/busybox@sha256:ab"),
    ],
)
def test_normalize_ref(ref: str, full: str) -> None:
    assert oci.normalize_ref(ref) == full


def test_chain_ids() -> None:
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    second = "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()
    assert oci.chain_ids([a, b]) == [a, second]


def _run(command: list[str], **resources: int) -> RunSpec:
    spec = WorkloadSpec(
        name="w",
        kind=WorkloadKind.CONTAINER,
        image="x",
        command=command,
        env={"A": "override"},
        resources=Resources(**resources),
    )
    return RunSpec(instance="w-0", workload="w", spec=spec)


IMAGE = {"config": {"Entrypoint": ["/ep"], "Cmd": ["c"], "Env": ["A=1", "B=2"], "User": "5:6"}}


@pytest.mark.parametrize(
    ("command", "image", "args"),
    [
        (["sh", "-c", "x"], IMAGE, ["sh", "-c", "x"]),
        ([], IMAGE, ["/ep", "c"]),
        ([], {"config": {"Cmd": ["c"]}}, ["c"]),
    ],
)
def test_spec_args(command: list[str], image: dict, args: list[str]) -> None:
    assert oci.build_spec(_run(command), image, "/orka/w-0")["process"]["args"] == args


def test_spec_env_user_limits() -> None:
    spec = oci.build_spec(_run([], cpu_millis=250, memory_bytes=1 << 26), IMAGE, "/orka/w-0")
    env = spec["process"]["env"]
    assert "A=override" in env and "B=2" in env and "ORKA_INSTANCE=w-0" in env
    assert spec["process"]["user"] == {"uid": 5, "gid": 6}
    assert spec["linux"]["cgroupsPath"] == "/orka/w-0"
    assert spec["linux"]["resources"]["memory"] == {"limit": 1 << 26}
    assert spec["linux"]["resources"]["cpu"] == {"quota": 25_000, "period": 100_000}
    assert spec["root"] == {"path": "rootfs"}


def test_secret_env_is_in_the_container_environment() -> None:
    run = _run([])
    run = run.model_copy(
        update={"spec": run.spec.model_copy(update={"secret_env": {"TOKEN": "s3cr3t"}})}
    )
    env = oci.build_spec(run, IMAGE, "/orka/w-0")["process"]["env"]
    assert "TOKEN=s3cr3t" in env and "A=override" in env


def test_spec_without_limits_or_args() -> None:
    spec = oci.build_spec(_run([]), {"config": {"Cmd": ["c"]}}, "/p")
    assert "memory" not in spec["linux"]["resources"] and "cpu" not in spec["linux"]["resources"]
    with pytest.raises(RuntimeFailure, match="no entrypoint or cmd"):
        oci.build_spec(_run([]), {}, "/p")


def test_select_manifest() -> None:
    amd = {"digest": "a", "platform": {"os": "linux", "architecture": oci.host_arch()}}
    other = {"digest": "b", "platform": {"os": "linux", "architecture": "s390x"}}
    assert oci.select_manifest({"manifests": [other, amd]}, "img") is amd
    assert oci.select_manifest({"manifests": [{"digest": "c"}]}, "img")["digest"] == "c"
    with pytest.raises(RuntimeFailure, match="'img' has no linux"):
        oci.select_manifest({"manifests": [other]}, "img")


def test_gc_labels() -> None:
    manifest = {"config": {"digest": "c"}, "layers": [{"digest": "l0"}, {"digest": "l1"}]}
    assert oci.gc_labels(manifest) == {
        "containerd.io/gc.ref.content.config": "c",
        "containerd.io/gc.ref.content.l.0": "l0",
        "containerd.io/gc.ref.content.l.1": "l1",
    }
    assert oci.gc_labels({"manifests": [{"digest": "m"}]}) == {
        "containerd.io/gc.ref.content.m.0": "m"
    }
