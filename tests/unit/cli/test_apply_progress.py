"""`orka apply --wait` progress: the line per workload, piped vs terminal, ready and failed."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator

from orka.cli.apply import Progress, ProgressView, follow
from orka.cli.client import WatchedChange
from orka.models import (
    Instance,
    InstancePhase,
    RestartPolicy,
    Revision,
    Rollout,
    RolloutState,
    Workload,
    WorkloadSpec,
    WorkloadStatus,
)


def progress(name: str = "web", running: int = 0, healthy: int = 0, **spec: object) -> Progress:
    w = Workload(
        spec=WorkloadSpec(name=name, kind="PROCESS", command=["x"], replicas=2, **spec),
        status=WorkloadStatus(desired=2, placed=2, running=running, healthy=healthy),
    )
    return Progress(w)


def test_the_line_counts_desired_placed_running_healthy() -> None:
    assert progress(running=1, healthy=1).line() == (
        "workload/web: desired 2, placed 2, running 1, healthy 1"
    )
    done = progress(running=2, healthy=2)
    assert done.ready() and done.line().endswith(": ready")
    # Running but not healthy yet is not ready.
    assert not progress(running=2, healthy=1).ready()


def test_a_failed_replica_under_restart_policy_never_fails_the_wait() -> None:
    p = progress(running=1, healthy=1, restart_policy=RestartPolicy.NEVER)
    p.instances["web-1"] = Instance(
        name="web-1", workload="web", phase=InstancePhase.FAILED, exit_code=3
    )
    assert p.failure() == "instance web-1 failed with exit code 3 and restart policy is NEVER"
    assert p.line().endswith(
        "failed: instance web-1 failed with exit code 3 and restart policy is NEVER"
    )
    # Under ALWAYS it is restarted: no failure.
    q = progress(running=1, healthy=1)
    q.instances["web-1"] = p.instances["web-1"]
    assert q.failure() == ""


def test_a_rollout_must_finish_and_a_failed_or_rolled_back_one_fails_the_wait() -> None:
    def rolling(state: RolloutState, generation: int = 2, **more: object) -> Progress:
        p = progress(running=2, healthy=2)
        p.workload = p.workload.model_copy(
            update={
                "generation": generation,
                "rollout": Rollout(state=state, revision=generation, message="m", **more),
            }
        )
        return p

    # The old revision's replicas all run and are healthy: not ready while the new rolls out.
    p = rolling(RolloutState.PROGRESSING)
    assert (p.ready(), p.failure()) == (False, "")
    assert p.line().endswith("healthy 2 (rollout progressing)")
    assert rolling(RolloutState.COMPLETE).ready()
    assert not rolling(RolloutState.AWAITING_PROMOTION).ready()
    assert rolling(RolloutState.FAILED).failure() == "the rollout of revision 2 failed: m"
    back = rolling(RolloutState.PROGRESSING, generation=3, rollback_of=2)
    assert back.failure() == "revision 2 failed and is being rolled back"
    cause = "automatic rollback to revision 1: instance web-9 is unhealthy: status 404"
    back.workload.revisions = [
        Revision(revision=2, cause="update"),
        Revision(revision=3, cause=cause),
    ]
    assert back.failure() == f"revision 2 failed and is being rolled back ({cause})"
    assert rolling(RolloutState.ROLLED_BACK, generation=3, rollback_of=2).failure() == (
        "revision 2 failed and is being rolled back"
    )


def test_piped_prints_a_plain_line_per_change_only() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=False)
    a, b = progress("a"), progress("b")
    view.show([a, b])
    view.show([a, b])  # nothing changed: nothing printed
    a.workload.status.running = a.workload.status.healthy = 1
    view.show([a, b])
    assert out.getvalue().splitlines() == [
        "workload/a: desired 2, placed 2, running 0, healthy 0",
        "workload/b: desired 2, placed 2, running 0, healthy 0",
        "workload/a: desired 2, placed 2, running 1, healthy 1",
    ]
    assert "\x1b" not in out.getvalue()


def test_a_terminal_redraws_the_lines_in_place() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=True)
    a, b = progress("a"), progress("b")
    view.show([a, b])
    first = out.getvalue()
    assert first.count("\n") == 2 and "\x1b[2F" not in first
    a.workload.status.running = 1
    view.show([a, b])
    redraw = out.getvalue()[len(first) :]
    # Back up the two lines drawn, then both rewritten, each cleared first.
    assert redraw.startswith("\x1b[2F\x1b[2K")
    assert redraw.count("\x1b[2K") == 2 and redraw.count("\n") == 2
    assert "running 1" in redraw


class Script:
    """A client whose listing is one workload with no replicas running and whose one watch
    stream then brings them up a step at a time."""

    def __init__(self, steps: list[WatchedChange]) -> None:
        self.steps = steps
        self.watches: list[int] = []

    async def list_at(self, kind: str, **filters: object) -> tuple[list[object], int]:
        if kind == "workloads":
            return [(4, progress(running=0).workload)], 4
        return [], 4

    async def watch(self, since: int, workload: str = "") -> AsyncIterator[WatchedChange]:
        self.watches.append(since)
        for c in self.steps:
            yield c
        await asyncio.sleep(3600)  # a live stream: more would come


def test_follow_reads_one_stream_until_every_replica_is_ready() -> None:
    steps = [
        WatchedChange("MODIFIED", "workload", progress(running=1, healthy=1).workload, 5),
        # An older copy than held is no news (it could only be a replay).
        WatchedChange("MODIFIED", "workload", progress(running=0).workload, 3),
        WatchedChange("MODIFIED", "workload", progress(running=2, healthy=1).workload, 6),
        WatchedChange("MODIFIED", "workload", progress(running=2, healthy=2).workload, 7),
    ]
    client = Script(steps)
    out = io.StringIO()
    view = ProgressView(out, tty=False)
    code, _ = asyncio.run(asyncio.wait_for(follow(client, ["web"], view), 10))  # type: ignore[arg-type]
    assert code == 0
    assert client.watches == [4]
    assert out.getvalue().splitlines() == [
        "workload/web: desired 2, placed 2, running 0, healthy 0",
        "workload/web: desired 2, placed 2, running 1, healthy 1",
        "workload/web: desired 2, placed 2, running 2, healthy 1",
        "workload/web: desired 2, placed 2, running 2, healthy 2: ready",
    ]
