"""The bucket-bitmap PB-LRU against a brute-force model of its rules.

Model: each tracked slot remembers the round of its last touch. At round ``r`` the ring holds
rounds ``r - R + 1 .. r`` and everything older is cold; victims are cold slots first, then the
recent rounds oldest to newest, slot order inside a bucket, never the current round.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.pblru_bitmap import BitmapPBLRU
from ulacache_vllm.core import CapacityError

S = 300


def _expected(last: dict, rnd: int, R: int, k: int):
    def rank(s):
        r = last[s]
        return (0 if r <= rnd - R else 1 + r - (rnd - R), s)
    eligible = sorted((s for s, r in last.items() if r != rnd), key=rank)
    return eligible[:k]


op = st.one_of(
    st.tuples(st.just("touch"), st.lists(st.integers(0, S - 1), max_size=60, unique=True)),
    st.tuples(st.just("select"), st.integers(0, 80)),
    st.tuples(st.just("advance")),
    st.tuples(st.just("release"), st.integers(0, 2**31)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=50), R=st.integers(1, 5))
def test_bitmap_pblru_matches_model(ops, R):
    p = BitmapPBLRU(S, "cpu", ring_size=R)
    last: dict[int, int] = {}
    rnd = 0
    for o in ops:
        if o[0] == "touch":
            p.touch(torch.tensor(o[1], dtype=torch.int64))
            last.update((s, rnd) for s in o[1])
        elif o[0] == "select":
            k = o[1]
            exp = _expected(last, rnd, R, k)
            if len(exp) < k:
                with pytest.raises(CapacityError):
                    p.select_victims(k)
                continue  # a failed search leaves the buckets as they were
            got = p.select_victims(k).tolist()
            assert got == exp
            for s in got:
                del last[s]
        elif o[0] == "advance":
            p.advance_round()
            rnd += 1
        else:
            g = torch.Generator().manual_seed(o[1])
            tracked = sorted(last)
            if tracked:
                pick = torch.randperm(len(tracked), generator=g)[: len(tracked) // 2].tolist()
                rel = [tracked[i] for i in pick]
                p.release(torch.tensor(rel, dtype=torch.int64))
                for s in rel:
                    del last[s]
        b = p.bucket_of()
        assert set((b >= 0).nonzero().squeeze(1).tolist()) == set(last)
        assert set((b == 1).nonzero().squeeze(1).tolist()) == {s for s, r in last.items() if r == rnd}


def test_cold_fold_and_order():
    p = BitmapPBLRU(1000, "cpu", ring_size=2)
    t = lambda *s: torch.tensor(s, dtype=torch.int64)  # noqa: E731
    p.touch(t(900, 5))        # round 0
    p.advance_round()
    p.touch(t(7, 3))          # round 1
    p.advance_round()         # round 0's bucket is reused: 5, 900 fold into cold
    p.touch(t(1, 2))          # round 2 (current)
    assert p.select_victims(3).tolist() == [5, 900, 3]  # cold (slot order), then round 1
    assert p.select_victims(1).tolist() == [7]
    with pytest.raises(CapacityError):
        p.select_victims(1)  # only current-round slots are left
    assert sorted((p.bucket_of() == 1).nonzero().squeeze(1).tolist()) == [1, 2]
