"""ByIdentity: one computation per key object, within a count and a weight budget."""

from __future__ import annotations

from orka.memo import ByIdentity


class Key:
    def __init__(self, n: int) -> None:
        self.n = n


def test_values_are_remembered_per_object() -> None:
    calls: list[int] = []
    memo: ByIdentity[Key, int] = ByIdentity(lambda k: calls.append(k.n) or k.n * 2)
    a, b = Key(1), Key(1)
    assert (memo(a), memo(a), memo(b)) == (2, 2, 2)
    assert calls == [1, 1]  # b is another object


def test_the_table_is_dropped_past_its_weight() -> None:
    memo: ByIdentity[Key, str] = ByIdentity(lambda k: "x" * k.n, weigh=len, max_weight=250)
    keys = [Key(100) for _ in range(3)]
    memo(keys[0])
    memo(keys[1])
    assert (len(memo._table), memo.weight) == (2, 200)
    memo(keys[2])  # 300 > 250: starts over with this one alone
    assert (len(memo._table), memo.weight) == (1, 100)
    assert keys[0] not in [k for k, _ in memo._table.values()]
