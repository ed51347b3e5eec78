"""The controller's scheduler feed: messages that pile up while the controller is busy are
handed over together, in order, and a broken feed still raises after what came before it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from orka.api import agent_pb2 as apb
from orka.controller.link import _merged


def batch(*names: str) -> apb.ClusterUpdates:
    return apb.ClusterUpdates(
        updates=[
            apb.ClusterUpdate(
                instance=apb.InstanceUpdate(node="n1", status=apb.InstanceStatus(name=n))
            )
            for n in names
        ]
    )


async def feed(
    batches: list[apb.ClusterUpdates], gate: asyncio.Event, fail: Exception | None = None
) -> AsyncIterator[apb.ClusterUpdates]:
    yield batches[0]
    await gate.wait()  # the rest arrive while the consumer handles the first
    for b in batches[1:]:
        yield b
    if fail is not None:
        raise fail


def names(updates: list[apb.ClusterUpdate]) -> list[str]:
    return [u.instance.status.name for u in updates]


async def test_messages_that_pile_up_are_merged_in_order() -> None:
    gate = asyncio.Event()
    got: list[list[str]] = []
    async for updates in _merged(feed([batch("a"), batch("b", "c"), batch("d")], gate)):
        got.append(names(updates))
        if len(got) == 1:
            gate.set()
            for _ in range(5):
                await asyncio.sleep(0)  # busy while the reader takes in the rest
    assert got == [["a"], ["b", "c", "d"]]


async def test_an_error_comes_after_the_updates_before_it() -> None:
    gate = asyncio.Event()
    gate.set()
    got: list[list[str]] = []
    with pytest.raises(RuntimeError, match="feed broke"):
        broken = feed([batch("a"), batch("b")], gate, RuntimeError("feed broke"))
        async for updates in _merged(broken):
            got.append(names(updates))
    assert [n for g in got for n in g] == ["a", "b"]
