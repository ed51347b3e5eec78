"""The services' garbage-collector thresholds: rarer collections, cycles still freed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from orka import gctune


@pytest.fixture
def tuned() -> Iterator[None]:
    before = gc.get_threshold()
    gctune.tune()
    try:
        yield
    finally:
        gc.set_threshold(*before)


class Node:
    other: Node | None = None


def test_tune_sets_the_thresholds(tuned: None) -> None:
    assert gc.get_threshold() == (gctune.YOUNG, gctune.MIDDLE, gctune.FULL)


def test_a_cycle_is_still_freed_without_an_explicit_collect(tuned: None) -> None:
    gc.collect()  # start from empty generations
    a, b = Node(), Node()
    a.other, b.other = b, a
    freed = weakref.ref(a)
    del a, b
    assert freed() is not None  # only the collector frees a cycle
    # Enough new live objects to trigger a young collection under the tuned threshold.
    keep = [[] for _ in range(gctune.YOUNG + 1000)]
    assert freed() is None
    assert len(keep) > gctune.YOUNG
