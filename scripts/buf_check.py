"""`buf lint` and `buf breaking` over proto/, offline: the one way scripts/test.sh runs buf.

    python scripts/buf_check.py [--buf node_modules/.bin/buf] [--against REF]

buf resolves imports only from modules in its workspace, and the Buf Schema Registry is out of
reach here, so the Google protos ours import (google/rpc/status.proto, ...) come from the
googleapis-common-protos package (grpcio-status needs it anyway), which ships the .proto files
beside its generated code. This script lays out a workspace under build/buf/: proto/ as it is,
those files as a second module (neither linted nor checked for breaking: they are Google's),
and buf.yaml with that module added. `buf breaking` compares it with the same layout of the
protos and buf.yaml at REF (default HEAD~1), taken from git.

Exit 0 when lint passes and breaking passes or is skipped (with the reason printed); else 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "buf"
DEPS = "google-protos"  # the second module's directory, inside each generated workspace


def google_protos() -> Path | None:
    """The site-packages directory that holds google/rpc/*.proto, if that package is here."""
    spec = importlib.util.find_spec("google.rpc")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        rpc = Path(location)
        if (rpc / "status.proto").exists():
            return rpc.parent.parent
    return None


def layout(dest: Path, config: str, protos: Path | None, deps: Path | None) -> None:
    """A buf workspace at `dest`: buf.yaml (`config` plus the deps module), proto/ copied from
    `protos` (when given; the caller may fill it), and the Google protos as module DEPS."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    data = yaml.safe_load(config)
    if deps is not None:
        # Only google/rpc: the well-known types (google/protobuf/*) are built into buf.
        shutil.copytree(
            deps / "google" / "rpc", dest / DEPS / "google" / "rpc", ignore=_only_protos
        )
        data.setdefault("modules", []).append({"path": DEPS})
        for section in ("lint", "breaking"):
            data.setdefault(section, {}).setdefault("ignore", []).append(DEPS)
    (dest / "buf.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    if protos is not None:
        shutil.copytree(protos, dest / "proto")


def _only_protos(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(".proto") and not (Path(directory) / n).is_dir()]


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def previous(ref: str, dest: Path, deps: Path | None) -> str | None:
    """Lay out the protos of `ref` at `dest`; the reason to skip `buf breaking`, or None."""
    if not (ROOT / ".git").exists():
        return "no .git here (an exported tree)"
    if git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode != 0:
        return f"{ref} is not in this clone (a shallow clone, or the first commit)"
    config = git("show", f"{ref}:buf.yaml")
    if config.returncode != 0:
        # v1 of the API is being reshaped to the Google API guide in the same change that
        # brought buf.yaml in; a commit before that has nothing to hold the protos to.
        return f"{ref} has no buf.yaml (before buf checked the protos)"
    layout(dest, config.stdout, None, deps)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "proto"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--buf", default=str(ROOT / "node_modules" / ".bin" / "buf"))
    parser.add_argument("--against", default="HEAD~1", help="git ref for buf breaking")
    args = parser.parse_args()
    if not Path(args.buf).exists() and shutil.which(args.buf) is None:
        print(f"buf not found at {args.buf}; run `npm ci` in {ROOT}", file=sys.stderr)
        return 1
    deps = google_protos()
    if deps is None:
        print("googleapis-common-protos not installed: no google/rpc protos for imports")
    current, before = WORK / "current", WORK / "previous"
    layout(current, (ROOT / "buf.yaml").read_text(), ROOT / "proto", deps)

    print("buf lint", flush=True)
    if subprocess.run([args.buf, "lint"], cwd=current, check=False).returncode != 0:
        return 1
    skip = previous(args.against, before, deps)
    if skip is not None:
        print(f"buf breaking skipped: {skip}")
        return 0
    print(f"buf breaking --against {args.against}", flush=True)
    cmd = [args.buf, "breaking", "--against", str(before)]
    return 1 if subprocess.run(cmd, cwd=current, check=False).returncode else 0


if __name__ == "__main__":
    sys.exit(main())
