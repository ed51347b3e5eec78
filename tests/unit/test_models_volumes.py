"""Volumes in the models: mounts, templates, sizes, the variable a process finds them in."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from orka.models import (
    MAX_PATH_CHARS,
    MAX_VOLUME_BYTES,
    MIN_VOLUME_BYTES,
    VolumeMount,
    VolumeSpec,
    VolumeTemplate,
    WorkloadKind,
    WorkloadSpec,
    backend_for,
    volume_env_key,
)

MI = 1 << 20


def spec(kind: WorkloadKind = WorkloadKind.PROCESS, **fields: object) -> WorkloadSpec:
    extra: dict[str, object] = {
        WorkloadKind.PROCESS: {"command": ["sleep", "1"]},
        WorkloadKind.CONTAINER: {"image": "busybox"},
        WorkloadKind.VM: {"image": "/var/lib/orka/disk.img"},
    }[kind]  # type: ignore[assignment]
    return WorkloadSpec(name="web", kind=kind, **extra, **fields)  # type: ignore[arg-type]


def error(**fields: object) -> str:
    kind = fields.pop("kind", WorkloadKind.PROCESS)
    with pytest.raises(ValidationError) as info:
        spec(kind, **fields)  # type: ignore[arg-type]
    (err,) = info.value.errors()
    return str(err["msg"]).removeprefix("Value error, ")


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("data", "ORKA_VOLUME_DATA"),
        ("data-1", "ORKA_VOLUME_DATA_1"),
        ("a.b-c", "ORKA_VOLUME_A_B_C"),
    ],
)
def test_volume_env_key(name: str, key: str) -> None:
    assert volume_env_key(name) == key


def test_backend_for_each_kind() -> None:
    assert [backend_for(k) for k in WorkloadKind] == ["ext4", "ext4", "qcow2"]


@pytest.mark.parametrize("path", ["", "/data", "/a/b", "/" + "x" * (MAX_PATH_CHARS - 1)])
def test_mount_paths_that_are_taken(path: str) -> None:
    assert VolumeMount(volume="v", mount_path=path).mount_path == path
    t = VolumeTemplate(name="t", size_bytes=MI, mount_path=path)
    assert t.mount_path == path


@pytest.mark.parametrize(
    "path", ["data", "/", "/a/../b", "/a//b", "/a/", "/a/./b", "/a\0b", "/" + "x" * MAX_PATH_CHARS]
)
def test_mount_paths_that_are_refused(path: str) -> None:
    for make in (
        lambda: VolumeMount(volume="v", mount_path=path),
        lambda: VolumeTemplate(name="t", size_bytes=MI, mount_path=path),
    ):
        with pytest.raises(ValidationError) as info:
            make()
        (err,) = info.value.errors()
        assert err["loc"] == ("mount_path",)
        assert str(err["msg"]).endswith(
            "must be an absolute, normalised path other than / (no '..', '.' or '//')"
        )


@pytest.mark.parametrize("size", [MIN_VOLUME_BYTES, MAX_VOLUME_BYTES])
def test_sizes_at_the_bounds_are_taken(size: int) -> None:
    assert VolumeSpec(name="v", size_bytes=size).size_bytes == size
    assert VolumeTemplate(name="t", size_bytes=size).size_bytes == size


@pytest.mark.parametrize("size", [0, MIN_VOLUME_BYTES - 1, MAX_VOLUME_BYTES + 1])
def test_sizes_past_the_bounds_are_refused(size: int) -> None:
    with pytest.raises(ValidationError) as info:
        VolumeSpec(name="v", size_bytes=size)
    (err,) = info.value.errors()
    assert err["msg"] == f"Value error, {size} bytes is not between 1Mi and 1Pi"


def test_template_volume_name() -> None:
    t = VolumeTemplate(name="data", size_bytes=MI)
    assert [t.volume_name("db", i) for i in (0, 12)] == ["data-db-0", "data-db-12"]


def test_volume_names_are_checked() -> None:
    with pytest.raises(ValidationError):
        VolumeMount(volume="Bad_Name")
    with pytest.raises(ValidationError):
        VolumeSpec(name="v", size_bytes=MI, backend="zfs")


def test_volumes_a_workload_may_have() -> None:
    mounts = [VolumeMount(volume="a"), VolumeMount(volume="b")]
    # A process needs no mount path (it finds the host path in its environment), so two
    # volumes without one are fine; two at different paths too.
    assert spec(volumes=mounts).volumes == mounts
    at = [VolumeMount(volume="a", mount_path="/a"), VolumeMount(volume="b", mount_path="/b")]
    c = spec(
        WorkloadKind.CONTAINER,
        volumes=at,
        volume_template=VolumeTemplate(name="t", size_bytes=MI, mount_path="/t"),
    )
    assert [m.mount_path for m in c.volumes] == ["/a", "/b"]
    assert spec(WorkloadKind.VM, volumes=mounts).volumes == mounts


def test_a_volume_given_twice_is_refused() -> None:
    twice = [VolumeMount(volume="a"), VolumeMount(volume="a", mount_path="/x")]
    assert error(volumes=twice) == "volumes[1].volume: 'a' is given twice"
    template = VolumeTemplate(name="a", size_bytes=MI)
    assert (
        error(volumes=[VolumeMount(volume="a")], volume_template=template)
        == "volume_template.volume: 'a' is given twice"
    )


def test_a_container_needs_each_mount_path() -> None:
    assert (
        error(kind=WorkloadKind.CONTAINER, volumes=[VolumeMount(volume="a")])
        == "volumes[0].mount_path: is required for a CONTAINER (where it sees the volume)"
    )
    template = VolumeTemplate(name="t", size_bytes=MI)
    assert (
        error(kind=WorkloadKind.CONTAINER, volume_template=template)
        == "volume_template.mount_path: is required for a CONTAINER (where it sees the volume)"
    )


def test_two_volumes_at_one_path_are_refused() -> None:
    at = [VolumeMount(volume="a", mount_path="/d"), VolumeMount(volume="b", mount_path="/d")]
    assert error(volumes=at) == "volumes[1].mount_path: '/d' is used by two volumes"
    template = VolumeTemplate(name="t", size_bytes=MI, mount_path="/d")
    assert (
        error(volumes=at[:1], volume_template=template)
        == "volume_template.mount_path: '/d' is used by two volumes"
    )
