"""Build a tiny OCI image archive from a static busybox, for tests and examples.

No registry is reachable in CI, so the containerd tests need an image they can make on the
spot: one uncompressed layer holding `bin/busybox` and a few applet symlinks, an image config,
a manifest, `index.json` and `oci-layout`, written as an OCI image layout inside a tar (what
`ctr images import` and the driver's `oci-archive:` images read).

    python -m orka.runtime.oci_archive OUT.tar [--busybox /bin/busybox] [--name busybox:orka]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

BUSYBOX = Path("/bin/busybox")
DEFAULT_NAME = "docker.io/library/busybox:orka"
APPLETS = ("sh", "echo", "sleep", "cat", "ls", "env", "true", "false", "pwd", "yes", "head")

MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
# containerd names an imported image after this annotation of the index's manifest entry.
REF_NAME = "io.containerd.image.name"
OCI_REF_NAME = "org.opencontainers.image.ref.name"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    # A fixed mtime keeps the archive (and so every digest) reproducible.
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def _layer(busybox: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "tmp", "etc"):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        _add(tar, "bin/busybox", busybox, 0o755)
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            info.mode = 0o777
            tar.addfile(info)
        _add(tar, "etc/passwd", b"root:x:0:0:root:/:/bin/sh\n")
    return buf.getvalue()


def build(out: Path, busybox: Path = BUSYBOX, name: str = DEFAULT_NAME) -> str:
    """Write the archive to `out`; returns the manifest digest."""
    layer = _layer(busybox.read_bytes())
    layer_digest = _digest(layer)
    config: dict[str, Any] = {
        "architecture": "amd64",
        "os": "linux",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(0)),
        "config": {
            "Env": ["PATH=/bin"],
            "Cmd": ["sh"],
            "WorkingDir": "/",
        },
        # The layer is uncompressed, so its diff id is its own digest.
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {
            "mediaType": MEDIA_CONFIG,
            "digest": _digest(config_bytes),
            "size": len(config_bytes),
        },
        "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": len(layer)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest = _digest(manifest_bytes)
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {REF_NAME: name, OCI_REF_NAME: name.rpartition(":")[2]},
            }
        ],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        for blob in (layer, config_bytes, manifest_bytes):
            _add(tar, "blobs/sha256/" + _digest(blob).removeprefix("sha256:"), blob)
        _add(tar, "index.json", json.dumps(index, sort_keys=True).encode())
    return manifest_digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="archive to write")
    parser.add_argument("--busybox", type=Path, default=BUSYBOX, help="a static busybox binary")
    parser.add_argument("--name", default=DEFAULT_NAME, help="image name inside the archive")
    args = parser.parse_args(argv)
    if not args.busybox.is_file():
        print(f"{args.busybox} not found (Debian: apt-get install busybox-static)", file=sys.stderr)
        return 1
    digest = build(args.out, args.busybox, args.name)
    print(f"wrote {args.out} ({digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
