"""The agent's state file holds every instance's spec, env values included: the agent's only."""

from __future__ import annotations

import stat
from pathlib import Path

from orka.agent.state import AgentState, StateFile


async def test_state_file_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    import os

    old = os.umask(0o000)  # the most open umask an agent could be started with
    try:
        sf = StateFile(tmp_path / "agent-state.json")
        for node in ("n1", "n2"):  # the first write and a replacement
            sf.save(AgentState(node=node))
            await sf.flush()
            assert stat.S_IMODE(sf.path.stat().st_mode) == 0o600
    finally:
        os.umask(old)


async def test_agent_data_dir_is_traversable_only(tmp_path: Path, certs_dir: Path) -> None:
    from orka.agent.service import Agent, AgentConfig
    from orka.security.tls import TlsFiles

    data = tmp_path / "agent"
    data.mkdir(mode=0o755)  # as an older agent (or an operator's mkdir) left it
    agent = Agent(
        AgentConfig(
            name="node-1",
            schedulers=["127.0.0.1:1"],  # never reached: only the start-up matters here
            data_dir=data,
            runtimes=["fake"],
        ),
        TlsFiles.for_service(certs_dir, "agent", "node-1"),
    )
    await agent.start()
    try:
        # Workloads reach their own work dir through it; nobody else lists or reads it.
        assert stat.S_IMODE(data.stat().st_mode) == 0o711
        assert stat.S_IMODE((data / "runtime").stat().st_mode) == 0o711
    finally:
        await agent.stop()
    assert stat.S_IMODE((data / "agent-state.json").stat().st_mode) == 0o600
