"""`kernels.shard_cpu` (TP shard mode's compiled CPU kernels): the read plan against an
independent numpy formulation of the same plan (whole-array ops: the code it replaced) and
the properties every rank relies on; the candidate merge against a brute-force sort.
(`tests/test_tp_shard.py` checks the merge through the indexer's candidates too.)"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ulacache_vllm.kernels.shard_cpu import merge_topk, shard_read_plan, warm_up


def oracle(lg, table, dev, rank, P, base):
    n = table.size - 1
    valid = lg >= 0
    bslot = table[np.where(valid & (lg < n), lg, n)]
    own = valid & (lg % P == rank)
    held = bslot >= 0
    remote_hit = held & ~own
    dev_out = np.where(remote_hit, bslot + base, dev)
    miss = valid & ~held
    nhit = np.unique(lg[remote_hit]).size
    u, inv = np.unique(lg[miss], return_inverse=True)
    ids = np.full(lg.shape, -1, dtype=np.int64)
    width, index, mine, nmiss = 0, u, u, 0
    if u.size:
        owner = u % P
        counts = np.bincount(owner, minlength=P)
        width = int(counts.max())
        order = np.argsort(owner, kind="stable")
        rank_in = np.empty_like(owner)
        rank_in[order] = np.arange(u.size) - (np.cumsum(counts) - counts)[owner[order]]
        index = owner * width + rank_in
        ids[miss] = index[inv.reshape(-1)]
        ids[own] = -1
        mine = u[owner == rank] // P
        nmiss = u.size - int(np.count_nonzero(owner == rank))
    return (dev_out, ids, u, index, mine, int(valid.sum()), int(held.sum()), nhit, nmiss,
            width)


@st.composite
def cases(draw):
    P = draw(st.integers(1, 4))
    N = draw(st.integers(1, 96))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(0, 80))
    # Addresses: padding, inside the directory, and past its end (read as not held).
    lg = rng.integers(-1, N + 8, size=n).astype(np.int64)
    # int32 as `RemoteRowBuffer` keeps it (what the store passes), or int64.
    table = np.full(N + 1, -1, dtype=draw(st.sampled_from([np.int32, np.int64])))
    k = draw(st.integers(0, N))
    table[rng.choice(N, size=k, replace=False)] = rng.integers(0, 64, size=k)
    dev = rng.integers(-1, 1000, size=n).astype(np.int64)
    return lg, table, dev, draw(st.integers(0, P - 1)), P, draw(st.integers(0, 500))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_kernel_plan_equals_the_array_formulation(case):
    lg, table, dev, rank, P, base = case
    got = shard_read_plan(lg, table, dev, rank, P, base)
    want = oracle(lg, table, dev, rank, P, base)
    names = ("dev", "ids", "u", "index", "mine", "valid", "held", "nhit", "nmiss", "width")
    for name, g, w in zip(names, got, want):
        assert np.array_equal(np.asarray(g), np.asarray(w)), name


@settings(max_examples=100, deadline=None)
@given(cases())
def test_every_rank_plans_the_same_payload_and_sends_its_own_misses(case):
    lg, table, dev, _, P, base = case
    plans = [shard_read_plan(lg, table, dev, r, P, base) for r in range(P)]
    u, index, width = plans[0][2], plans[0][3], plans[0][9]
    for p in plans[1:]:
        assert np.array_equal(p[2], u) and np.array_equal(p[3], index) and p[9] == width
    # Every gathered row has one sender: owner o sends its misses in address order into
    # rows o * width .. o * width + count - 1.
    for r, p in enumerate(plans):
        mine = p[4]
        assert np.array_equal(mine * P + r, u[u % P == r])
        rows = index[u % P == r]
        assert np.array_equal(rows, r * width + np.arange(mine.size))
        # Each remote entry not in the directory reads the row its owner sends for its
        # address; every other entry reads no gathered row.
        n = table.size - 1
        held = np.where((lg >= 0) & (lg < n), table[np.clip(lg, 0, n)], -1) >= 0
        remote_miss = (lg >= 0) & (lg % P != r) & ~held
        ids = p[1]
        assert np.array_equal(ids >= 0, remote_miss)
        for i in np.flatnonzero(remote_miss):
            assert u[index == ids[i]].tolist() == [lg[i]]


def test_warm_up_compiles_and_empty_selection():
    warm_up()
    z = np.zeros(0, dtype=np.int64)
    out = shard_read_plan(z, np.full(5, -1, dtype=np.int64), z, 0, 2, 7)
    assert [np.asarray(x).size for x in out[:5]] == [0] * 5
    assert out[5:] == (0, 0, 0, 0, 0)


def brute_merge(scores, positions, k):
    P, n, kp = scores.shape
    out = np.full((n, k), -1, dtype=np.int32)
    for t in range(n):
        c = sorted((-float(scores[r, t, j]), int(positions[r, t, j]))
                   for r in range(P) for j in range(kp)
                   if positions[r, t, j] >= 0 and scores[r, t, j] > -np.inf)
        sel = sorted(p for _, p in c[:k])
        out[t, :len(sel)] = sel
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(0, 5), st.integers(0, 12), st.integers(1, 20),
       st.integers(0, 2**32 - 1))
def test_merge_takes_the_best_by_score_then_position(P, n, kp, k, seed):
    rng = np.random.default_rng(seed)
    # Few distinct scores (ties at the k-th place), -inf and NaN scores at real positions
    # (never candidates), -1 padding; positions distinct across ranks, some past 2**24.
    scores = rng.integers(-2, 3, size=(P, n, kp)).astype(np.float32)
    scores[rng.random((P, n, kp)) < 0.2] = -np.inf
    scores[rng.random((P, n, kp)) < 0.05] = np.nan
    pos = np.zeros((P, n, kp), dtype=np.int64)
    for t in range(n):
        pos[:, t] = rng.permutation(200)[: P * kp].reshape(P, kp)
    pos = (pos + (1 << 24) * (seed % 2)).astype(np.int32)
    pos[rng.random((P, n, kp)) < 0.15] = -1
    got = merge_topk(scores, pos, k)
    assert got.dtype == np.int32 and got.shape == (n, k)
    assert np.array_equal(got, brute_merge(scores, pos, k))
