"""``core.memo.remember``: the one bounded memo behind the caches of repeated client input."""

from __future__ import annotations

from gpu_energy_exporter.core.bounded_memo import remember


def test_a_memo_never_holds_more_than_its_limit_and_keeps_the_newest_entry() -> None:
    memo: dict[int, str] = {}
    for i in range(1000):
        assert remember(memo, i, str(i), 64) == str(i)
        assert len(memo) <= 64
        assert memo[i] == str(i)
    # emptied when full, then refilled: the last 1000 % 64 = 40 entries are what is left
    assert sorted(memo) == list(range(960, 1000))
