"""Running one CNI plugin the way the CNI specification says (the "runtime" side of it).

A plugin is an executable found in one of the CNI_PATH directories; the operation and the
container come in the CNI_* environment, the network's configuration as JSON on stdin, and
the result (ADD) or a CNI error object comes back on stdout. Plugins run as subprocesses off
the event loop with a deadline; a failure becomes a `RuntimeFailure` naming the plugin and the
error message the plugin gave.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from orka.errors import RuntimeFailure

CNI_VERSION = "1.0.0"
# A plugin's answer is a few KiB; anything far bigger is not a CNI result.
_MAX_OUTPUT = 1 << 20


def find_plugin(name: str, bin_dirs: list[Path]) -> Path | None:
    for d in bin_dirs:
        path = d / name
        if os.access(path, os.X_OK):
            return path
    return None


def plugin_env(
    command: str, container_id: str, netns: str, ifname: str, bin_dirs: list[Path]
) -> dict[str, str]:
    """The CNI_* environment of one call, over a PATH that finds iptables and ip."""
    return {
        "PATH": os.environ.get("PATH") or "/usr/sbin:/usr/bin:/sbin:/bin",
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": netns,
        "CNI_IFNAME": ifname,
        "CNI_PATH": os.pathsep.join(str(d) for d in bin_dirs),
    }


def error_message(stdout: bytes, stderr: bytes, returncode: int) -> str:
    """The plugin's own words: the CNI error object's msg (and details), else its stderr."""
    try:
        err = json.loads(stdout)
    except ValueError:
        err = None
    if isinstance(err, dict) and err.get("msg"):
        details = str(err.get("details") or "")
        return f"{err['msg']}: {details}" if details else str(err["msg"])
    text = stderr.decode(errors="replace").strip() or stdout.decode(errors="replace").strip()
    return text.splitlines()[-1][:500] if text else f"exited with code {returncode}"


async def invoke(
    plugin: str,
    command: str,
    *,
    container_id: str,
    netns: str,
    ifname: str,
    config: dict[str, Any],
    bin_dirs: list[Path],
    timeout: float,
) -> dict[str, Any] | None:
    """Run `plugin` for `command` (ADD, DEL, CHECK); ADD returns the plugin's result."""
    path = find_plugin(plugin, bin_dirs)
    if path is None:
        where = ", ".join(str(d) for d in bin_dirs)
        raise RuntimeFailure(f"network: CNI plugin {plugin!r} not found in {where}")
    proc = await asyncio.create_subprocess_exec(
        str(path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=plugin_env(command, container_id, netns, ifname, bin_dirs),
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate(json.dumps(config).encode())
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeFailure(
            f"network: CNI plugin {plugin!r} {command} for {container_id!r} took over {timeout:g}s"
        ) from None
    if proc.returncode != 0:
        raise RuntimeFailure(
            f"network: CNI plugin {plugin!r} {command} for {container_id!r} failed:"
            f" {error_message(out, err, proc.returncode or 0)}"
        )
    if command != "ADD":
        return None
    if len(out) > _MAX_OUTPUT:
        raise RuntimeFailure(f"network: CNI plugin {plugin!r} answered {len(out)} bytes")
    try:
        result = json.loads(out)
    except ValueError:
        raise RuntimeFailure(
            f"network: CNI plugin {plugin!r} ADD for {container_id!r} gave no JSON result"
        ) from None
    if not isinstance(result, dict):
        raise RuntimeFailure(f"network: CNI plugin {plugin!r} gave a result that is no object")
    return result


def plugin_config(
    conflist: dict[str, Any], plugin: dict[str, Any], prev_result: dict[str, Any] | None
) -> dict[str, Any]:
    """What one plugin of a list gets on stdin: its own section plus the list's name and
    version, and the previous plugin's result (ADD) or the cached result (DEL)."""
    conf = {"cniVersion": conflist["cniVersion"], "name": conflist["name"], **plugin}
    if prev_result is not None:
        conf["prevResult"] = prev_result
    return conf
