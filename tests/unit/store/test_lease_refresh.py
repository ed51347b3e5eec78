"""The lease refresher's sense of how long its lease lasts: counted from when a refresh was
sent, since etcd renews it then, however late the answer is read."""

from __future__ import annotations

from orka.errors import NotFound, Unavailable
from orka.store.election import _refresh


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowKeeper:
    """Each refresh moves the clock by `took[i]` and then answers `answers[i]`."""

    def __init__(self, clock: Clock, took: list[float], answers: list[int | Exception]) -> None:
        self.clock, self.took, self.answers = clock, took, answers
        self.calls = 0

    async def keepalive_lease(self, lease_id: int) -> int:
        self.clock.now += self.took[self.calls]
        answer = self.answers[self.calls]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_a_late_answer_does_not_stretch_the_lease() -> None:
    # The first refresh is sent at 0.0 and answered at 0.9 with a 1 s TTL: the lease runs
    # out at 1.0, not 1.9. The next one fails at 1.2: the lease is gone by then, and the
    # refresher says so instead of trying again as if it still had 0.7 s.
    clock = Clock()
    keeper = SlowKeeper(clock, [0.9, 0.3, 0.0], [1, Unavailable("etcd is slow"), 1])
    reason = await _refresh(keeper, 7, 1, "scheduler", clock=clock)  # type: ignore[arg-type]
    assert keeper.calls == 2
    assert reason == "lease not refreshed for 1s: etcd is slow"


async def test_a_failed_refresh_within_the_lease_is_tried_again() -> None:
    clock = Clock()
    keeper = SlowKeeper(clock, [0.1, 0.1, 0.1], [1, Unavailable("blip"), NotFound("gone")])
    reason = await _refresh(keeper, 7, 1, "scheduler", clock=clock)  # type: ignore[arg-type]
    assert keeper.calls == 3 and reason == "lease expired"
