"""What provisioning a volume costs on each of an agent's backends, on this host's real tools.

For each backend the node can use (ext4: a sparse file, mkfs.ext4 and a loop mount; qcow2:
qemu-img) and each size, the median of `--repeat` provisions and deletes, as the agent's volume
manager pays them before an instance's first start; then the re-adoption of every volume after
an agent restart (ext4 volumes unmounted first, as after a reboot). The in-run baseline is the
floor any backend pays: making the volume's directory and a sparse file of the size.

    .venv/bin/python bench/bench_volumes.py [--repeat 10] [--smoke]

On a disk, not tmpfs (under /var/tmp): a volume lives on its node's disk. Needs root for ext4
(loop devices); a backend this host cannot use is reported as skipped, with why.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, table
from orka.runtime.volume_ext4 import Ext4Backend
from orka.runtime.volume_qcow2 import Qcow2Backend
from orka.runtime.volumes import VolumeBackend

MI = 1 << 20
SIZES = {"64Mi": 64 * MI, "1Gi": 1024 * MI, "10Gi": 10240 * MI}


def ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


def baseline(root: Path, size: int, repeat: int) -> list[float]:
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        d = root / f"floor-{i}"
        d.mkdir()
        with open(d / "disk.img", "wb") as f:
            f.truncate(size)
        times.append(time.perf_counter() - t0)
        shutil.rmtree(d)
    return times


async def one_backend(backend: VolumeBackend, repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, size in SIZES.items():
        made, gone = [], []
        for i in range(repeat):
            name = f"bench-{label.lower()}-{i}"
            t0 = time.perf_counter()
            await backend.provision(name, size)
            made.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await backend.delete(name)
            gone.append(time.perf_counter() - t0)
        out[f"provision_{label}_ms"] = ms(made)
        out[f"delete_{label}_ms"] = ms(gone)
    names = [f"adopt-{i}" for i in range(repeat)]
    for name in names:
        await backend.provision(name, 64 * MI)
    if isinstance(backend, Ext4Backend):
        await backend.unmount_all()  # as after a reboot: adopt mounts them again
    t0 = time.perf_counter()
    adopted = await backend.adopt()
    out[f"adopt_{repeat}_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    out["adopted"] = len(adopted)
    for name in names:
        await backend.delete(name)
    return out


async def measure(root: Path, repeat: int) -> dict[str, Any]:
    floor = ms(baseline(root, SIZES["1Gi"], repeat))
    result: dict[str, Any] = {"repeat": repeat, "baseline_sparse_file_1Gi_ms": floor}
    for backend in (Ext4Backend(root / "ext4"), Qcow2Backend(root / "qcow2")):
        why = backend.unavailable()
        if why is not None:
            result[backend.name] = {"skipped": why}
            continue
        figures = await one_backend(backend, repeat)
        figures["provision_1Gi_over_baseline"] = round(
            figures["provision_1Gi_ms"] / max(floor, 0.001), 1
        )
        result[backend.name] = figures
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="2 runs of each")
    args = parser.parse_args()
    if args.smoke:
        args.repeat = 2
    root = Path(tempfile.mkdtemp(prefix="orka-bench-volumes-", dir="/var/tmp"))
    try:
        result = asyncio.run(measure(root, args.repeat))
    finally:
        # Whatever a failed run left mounted goes before its files.
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(f"{root}/")]
        for path in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", path], check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    for name in ("ext4", "qcow2"):
        figures = result[name]
        rows = [(k, v) for k, v in figures.items()]
        table(f"{name} volumes, median of {result['repeat']}", rows)
    table("baseline", [("mkdir + sparse 1Gi file ms", result["baseline_sparse_file_1Gi_ms"])])
    emit({"bench": "volumes", **result})


if __name__ == "__main__":
    main()
