"""The agent's writer thread: jobs run off the loop, one at a time and in order, and each
waiter gets its own job's outcome."""

from __future__ import annotations

import asyncio
import threading

import pytest

from orka.agent import offload


async def test_jobs_run_off_the_loop_in_the_order_given() -> None:
    seen: list[tuple[int, str]] = []

    def job(n: int) -> None:
        seen.append((n, threading.current_thread().name))

    await asyncio.gather(*(offload.run(lambda n=n: job(n)) for n in range(50)))
    assert [n for n, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"orka-offload"}


async def test_a_failing_job_raises_in_its_waiter_only() -> None:
    def boom() -> None:
        raise OSError("disk full")

    ok = offload.run(lambda: None)
    bad = offload.run(boom)
    after = offload.run(lambda: None)
    with pytest.raises(OSError, match="disk full"):
        await bad
    assert await ok is None and await after is None


async def test_a_cancelled_waiter_does_not_stop_its_job() -> None:
    gate = threading.Event()
    done: list[str] = []

    def slow() -> None:
        gate.wait(5)
        done.append("first")

    first = offload.run(slow)
    second = offload.run(lambda: done.append("second"))
    first.cancel()
    gate.set()
    await second
    assert done == ["first", "second"]
