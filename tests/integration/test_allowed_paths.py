"""An agent opens VM images, kernels and OCI archives only under its --allowed-paths: a spec
naming a file elsewhere is refused at admission, with the rule named in the reason."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from tests.integration.cluster import Cluster, eventually


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    images = tmp_path / "images"
    images.mkdir()
    (images / "disk.img").write_bytes(b"\0" * 512)
    (images / "escape.img").symlink_to("/etc/passwd")
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start(agents=1, runtimes=["fake"], allowed_paths=[images])
        yield c
    finally:
        await c.stop()


def vm(name: str, image: str = "", kernel: str = "") -> pb.WorkloadSpec:
    spec = pb.WorkloadSpec(name=name, kind=pb.WorkloadSpec.VM, image=image, replicas=1)
    if kernel:
        spec.vm.kernel = kernel
    return spec


async def unplaced_reason(cluster: Cluster, name: str) -> str:
    async def reason() -> str | None:
        [inst] = await cluster.instances(name)
        return inst.message if inst.phase == pb.Instance.PENDING and inst.message else None

    return await eventually(reason)


async def test_files_outside_the_allowed_paths_are_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    assert cluster.api is not None
    images = tmp_path / "images"
    specs = {
        "etc": vm("etc", image="/etc/passwd"),
        "link": vm("link", image=str(images / "escape.img")),
        "kernel": vm("kernel", kernel="/boot/vmlinuz"),
        "sibling": vm("sibling", image=f"{images}-other/disk.img"),
        "archive": pb.WorkloadSpec(
            name="archive",
            kind=pb.WorkloadSpec.CONTAINER,
            image="oci-archive:/root/image.tar",
            replicas=1,
        ),
    }
    for spec in specs.values():
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
    rule = f"is outside the paths this node allows ({images}; agent flag --allowed-paths)"
    expected = {
        "etc": f"spec.image: '/etc/passwd' {rule}",
        "link": f"spec.image: '{images}/escape.img' {rule}",
        "kernel": f"spec.vm.kernel: '/boot/vmlinuz' {rule}",
        "sibling": f"spec.image: '{images}-other/disk.img' {rule}",
        "archive": f"spec.image: '/root/image.tar' {rule}",
    }
    for name, needle in expected.items():
        assert needle in await unplaced_reason(cluster, name)
    # A file under the allowed directory runs.
    await cluster.api.CreateWorkload(
        pb.CreateWorkloadRequest(spec=vm("ok", image=str(images / "disk.img")))
    )
    [inst] = await eventually(lambda: cluster.running("ok"))
    assert inst.node == "node-1"
