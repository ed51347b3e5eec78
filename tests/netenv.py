"""Cleaning up after the instance network tests: what a failed or killed run leaves behind."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from orka.runtime.network import default_bridge, host_unavailable, netns_name

# Root, the CNI plugins, ip and iptables: what the instance network needs (`.ci/run` installs
# them); the reason names what is missing.
needs_network = pytest.mark.skipif(host_unavailable() is not None, reason=str(host_unavailable()))


def scrub(bridge: str, records: Path | None = None) -> None:
    """The bridge's namespaces (from the attachment records under `records`), its NAT and filter
    rules and their chains (portmap's, masquerade, the localhost guard), and the bridge."""
    if records is not None:
        for record in records.rglob("attachments/*.json"):
            name = netns_name(bridge, record.stem)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
    for table in ("nat", "filter"):
        rules = subprocess.run(
            ["iptables-save", "-t", table], capture_output=True, text=True, check=False
        ).stdout
        for line in rules.splitlines():
            if line.startswith("-A ") and f"orka-{bridge}" in line:
                args = shlex.split(line)
                subprocess.run(["iptables", "-t", table, "-D", *args[1:]], check=False)
                chain = args[-1]
                if chain.startswith("CNI-"):
                    for op in ("-F", "-X"):
                        subprocess.run(["iptables", "-t", table, op, chain], check=False)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)


def scrub_agent(node: str, data_dir: Path) -> None:
    """What an agent's network left (its bridge named from its node name and data dir)."""
    network = (data_dir / "network").resolve()
    scrub(default_bridge(f"{node}@{network}"), data_dir)
