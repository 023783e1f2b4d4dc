"""Triton kernels vs torch references, executed by the Triton interpreter on CPU."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton modules are imported (decoration time)

import contextlib  # noqa: E402
import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from ulacache_vllm.kernels import reference as ref  # noqa: E402

tk = importlib.import_module("ulacache_vllm.kernels.pblru_kernels")
tt = importlib.import_module("ulacache_vllm.kernels.translate_kernels")


QUEUE_DTYPES = [torch.int64, torch.int32]  # PB-LRU's queue is int32


@contextlib.contextmanager
def _compact_scan_min(n: int):
    """Set the size from which ``reference.compact`` runs branch-free (hypothesis runs many
    examples per test call, so no function-scoped monkeypatch)."""
    old, ref.COMPACT_SCAN_MIN = ref.COMPACT_SCAN_MIN, n
    try:
        yield
    finally:
        ref.COMPACT_SCAN_MIN = old


def test_kernels_really_interpreted():
    for fn in (tk._popcount_kernel, tk._expand_kernel, tk._queue_push_kernel, tk._queue_live_kernel,
               tk._queue_first_k_kernel, tk._hit_flags_kernel, tk._hit_push_kernel,
               tk._label_hit_touch_kernel, tt._translate_kernel):
        assert isinstance(fn, InterpretedFunction), "Triton kernels would not run on CPU"


def _words(seed, n, density):
    g = torch.Generator().manual_seed(seed)
    bits = torch.rand(n, 64, generator=g) < density
    return (bits.long() << torch.arange(64)).sum(1)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 200), density=st.sampled_from([0.0, 0.02, 0.5, 1.0]),
       k=st.integers(0, 3000))
def test_popcount_and_expand(seed, n, density, k):
    w = _words(seed, n, density)
    assert torch.equal(tk.popcount64(w), ref.popcount64(w))
    assert torch.equal(tk.popcount64(w[::3]), ref.popcount64(w[::3]))  # strided views too
    bits = ((w[:, None] >> torch.arange(64)) & 1).reshape(-1)
    assert torch.equal(ref.popcount64(w), ((w[:, None] >> torch.arange(64)) & 1).sum(1))
    expect = bits.nonzero().squeeze(1)[:k]
    assert torch.equal(ref.expand_first_k(w, k), expect)
    assert torch.equal(tk.expand_first_k(w, k), expect)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), S=st.integers(1, 500), n=st.integers(0, 300),
       start=st.integers(0, 200), dtype=st.sampled_from(QUEUE_DTYPES))
def test_queue_push(seed, S, n, start, dtype):
    """Append in order; int64 slots into an int64 or int32 (PB-LRU's) queue."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(S, generator=g)[: min(n, S)]
    Q = start + slots.numel() + 7
    qs0 = torch.randint(0, S, (Q,), generator=g).to(dtype)
    qp0 = torch.randint(-1, Q, (S,), generator=g).to(dtype)
    outs = []
    iota = torch.arange(Q, dtype=dtype)
    for mod, pos in ((ref, None), (ref, iota[start:start + slots.numel()]),
                     (ref, torch.arange(Q)[start:start + slots.numel()]), (tk, None)):
        qs, qp = qs0.clone(), qp0.clone()
        mod.queue_push(slots, qs, qp, start, pos)
        outs.append((qs, qp))
    expect_s, expect_p = qs0.clone(), qp0.clone()
    for i, s_ in enumerate(slots.tolist()):
        expect_s[start + i] = s_
        expect_p[s_] = start + i
    for qs, qp in outs:
        assert torch.equal(qs, expect_s) and torch.equal(qp, expect_p)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), S=st.integers(1, 400), n=st.integers(0, 300),
       start=st.integers(0, 200), hit_p=st.sampled_from([0.0, 0.3, 1.0]),
       dtype=st.sampled_from(QUEUE_DTYPES))
def test_hit_touch_push(seed, S, n, start, hit_p, dtype):
    """Hit detection + touch: device values (tier 0) are hits and are appended in input order;
    host (tier 1), pending (tier 2) and unmapped (-1) values are not."""
    g = torch.Generator().manual_seed(seed)
    n = min(n, S)
    slots = torch.randperm(S, generator=g)[:n]  # unique entries -> distinct device slots
    tier = torch.where(torch.rand(n, generator=g) < hit_p, 0, torch.randint(1, 4, (n,), generator=g))
    loc = torch.where(tier == 3, -1, (tier << 32) | slots)
    Q = start + n + 5
    qs0 = torch.randint(0, S, (Q,), generator=g).to(dtype)
    qp0 = torch.randint(-1, Q, (S,), generator=g).to(dtype)
    hit_e = tier == 0
    hs_e = slots[hit_e]
    expect_s, expect_p = qs0.clone(), qp0.clone()
    for i, s_ in enumerate(hs_e.tolist()):
        expect_s[start + i], expect_p[s_] = s_, start + i
    iota = torch.arange(Q, dtype=dtype)
    for mod in (ref, tk):
        qs, qp = qs0.clone(), qp0.clone()
        hit, hs = mod.hit_touch_push(loc, qs, qp, start, iota)
        assert torch.equal(hit, hit_e) and torch.equal(hs, hs_e), mod
        assert hs.dtype == torch.int64, mod  # hit slots leave as int64 (equal ignores dtype)
        assert torch.equal(qs, expect_s) and torch.equal(qp, expect_p), mod


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), S=st.integers(1, 400), m=st.integers(0, 3000),
       k=st.integers(0, 800), live_p=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
       dtype=st.sampled_from(QUEUE_DTYPES), scan_min=st.sampled_from([1, 4096]))
def test_queue_take(seed, S, m, k, live_p, dtype, scan_min):
    """Stale filter + first k: live iff qpos[slot] == position; window order; consumed count;
    the slots come back in the queue's dtype. ``scan_min=1`` runs the reference's
    branch-free compaction on every window (by default only from 4096 entries)."""
    with _compact_scan_min(scan_min):
        _check_queue_take(seed, S, m, k, live_p, dtype)


def _check_queue_take(seed, S, m, k, live_p, dtype):
    g = torch.Generator().manual_seed(seed)
    base = int(torch.randint(0, 50, (1,), generator=g))
    wslots = torch.randint(0, S, (m,), generator=g).to(dtype)
    wpos = torch.arange(base, base + m, dtype=dtype)
    qpos = torch.full((S,), -1, dtype=dtype)
    # Make a random subset of the window the slots' latest entries (one per slot at most).
    want = torch.rand(m, generator=g) < live_p
    for i in range(m):
        if want[i]:
            qpos[wslots[i]] = base + i
    live_idx = [i for i in range(m) if int(qpos[wslots[i]]) == base + i]
    first = live_idx[:k]
    expect = wslots[first] if first else torch.empty(0, dtype=dtype)
    expect_used = (first[-1] + 1 if len(live_idx) > k and k > 0 else (m if k > 0 else 0))
    for mod in (ref, tk):
        got, used, n_live = mod.queue_take(wslots, wpos, qpos, k)
        assert torch.equal(got, expect) and got.dtype == dtype, mod  # (equal ignores dtype)
        assert n_live == (len(live_idx) if k > 0 and m else 0)
        # Exact, or (CPU, small window with spare live entries) 0: a safe, lazy head advance.
        lazy = mod is ref and len(live_idx) > k and m <= ref._EXACT_USED_MIN
        assert used == expect_used or (lazy and used == 0), (mod, used, expect_used)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), m=st.integers(0, 12000),
       density=st.sampled_from([0.0, 0.03, 0.5, 0.97, 1.0]),
       dtype=st.sampled_from([torch.int32, torch.int64, torch.float32]),
       scan_min=st.sampled_from([1, 4096]))
def test_compact_is_masked_select(seed, m, density, dtype, scan_min):
    """The reference's branch-free compaction (prefix sum + scatter into a reused scratch
    buffer) returns exactly ``masked_select``, and a later call leaves earlier results intact."""
    with _compact_scan_min(scan_min):
        _check_compact(seed, m, density, dtype)


def _check_compact(seed, m, density, dtype):
    g = torch.Generator().manual_seed(seed)
    vals = (torch.randn(m, generator=g) * 1e6).to(dtype)
    mask = torch.rand(m, generator=g) < density
    got = ref.compact(vals, mask)
    keep = got.clone()
    assert got.dtype == dtype and torch.equal(got, vals.masked_select(mask))
    ref.compact(vals.flip(0), mask.logical_not())  # reuses the scratch buffer
    assert torch.equal(got, keep)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(0, 600), world=st.integers(1, 4), data=st.data())
def test_translate(seed, n, world, data):
    rank = data.draw(st.integers(0, world - 1))
    g = torch.Generator().manual_seed(seed)
    num_local = 200
    table = torch.randint(-1, 3, (num_local,), generator=g)
    table = torch.where(table < 0, -1, (table << 32) | torch.randint(0, 1 << 20, (num_local,), generator=g))
    addrs = torch.randint(-1, num_local * world, (n,), generator=g)
    assert torch.equal(tt.translate(addrs, table, rank, world, 7),
                       ref.translate(addrs, table, rank, world, 7))


def test_translate_int32_and_2d_addresses():
    """vLLM's top-k indices are int32: remote / local packing must not depend on the width
    (an int32 remote address used to pack as device slot 0 of rank 0 on the torch path, and
    the kernel overflowed); a 2-D batch keeps its shape on both paths."""
    table = torch.tensor([7, 8, 9], dtype=torch.int64)
    a64 = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)
    expect = ref.translate(a64, table, 0, 2)
    assert expect.shape == (2, 2) and int(expect[0, 1]) >> 48 == 3  # REMOTE tier
    for fn in (ref.translate, tt.translate):
        assert torch.equal(fn(a64.to(torch.int32), table, 0, 2), expect)
        assert torch.equal(fn(a64, table, 0, 2), expect)


def test_expand_first_k_one_strided_word():
    """A 1-element strided view counts as contiguous but cannot be viewed as bytes."""
    w = torch.tensor([0b1011, 5], dtype=torch.int64)[::2]
    assert ref.expand_first_k(w, 3).tolist() == [0, 1, 3]
    assert tk.expand_first_k(w, 3).tolist() == [0, 1, 3]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), S=st.integers(0, 400), n=st.integers(0, 300),
       hit_p=st.sampled_from([0.0, 0.3, 1.0]), rnd=st.integers(0, 2**15 - 2),
       dtype=st.sampled_from([torch.int16, torch.int32]))
def test_label_hit_touch(seed, S, n, hit_p, rnd, dtype):
    """Round-label hit detection + touch: device values (a slot below S) are hits and get
    label ``rnd``; host (tier 1), pending (tier 2) and unmapped (-1) values are misses and
    touch only the dummy label S. Triton == reference == brute force."""
    g = torch.Generator().manual_seed(seed)
    n = min(n, S)
    slots = torch.randperm(S, generator=g)[:n]  # unique entries -> distinct device slots
    tier = torch.where(torch.rand(n, generator=g) < hit_p, 0, torch.randint(1, 4, (n,), generator=g))
    loc = torch.where(tier == 3, -1, (tier << 32) | slots)
    lab0 = torch.randint(0, 2**15 - 1, (S + 1,), generator=g, dtype=torch.int64).to(dtype)
    expect = lab0.clone()
    expect[slots[tier == 0]] = rnd
    src = torch.full((n,), rnd, dtype=dtype)
    for mod in (ref, tk):
        lab = lab0.clone()
        hit = mod.label_hit_touch(loc, lab, S, rnd, src)
        assert hit.dtype == torch.bool and torch.equal(hit, tier == 0), mod
        assert torch.equal(lab[:S], expect[:S]), mod
    h, idx = ref.hit_index(loc, S)
    assert torch.equal(idx, torch.where(tier == 0, loc, S)) and idx.dtype == torch.int64


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), S=st.integers(0, 500), rounds=st.integers(1, 5),
       m=st.integers(0, 200))
def test_label_members_and_live(seed, S, rounds, m):
    g = torch.Generator().manual_seed(seed)
    lab = torch.randint(0, rounds, (S,), generator=g, dtype=torch.int32)
    r = int(torch.randint(0, rounds, (1,), generator=g))
    mem = ref.label_members(lab, r)
    assert mem.dtype == torch.int64 and mem.tolist() == [i for i in range(S) if lab[i] == r]
    sl = torch.randint(0, max(S, 1), (min(m, S),), generator=g) if S else torch.zeros(0, dtype=torch.int64)
    live = ref.label_live(sl, lab, r)
    assert live.tolist() == [s for s in sl.tolist() if lab[s] == r]


def _on_both_paths(monkeypatch, make):
    """The same policy built twice: on the Triton kernels (interpreted) and on the reference."""
    pols = []
    for force in ("1", "0"):
        monkeypatch.setenv("ULACACHE_FORCE_TRITON", force)
        pols.append(make())
    assert pols[0]._k is tk and pols[1]._k is ref
    return pols


def test_pblru_rounds_same_with_triton_path(monkeypatch):
    """The round-label PB-LRU on the Triton kernel picks the same victims and labels as on
    the reference path, through hits with misses among them, releases and idle rounds."""
    from _policy_drive import hit_some, select_all, touch_new
    from ulacache_vllm.core import PBLRU

    S = 40
    pols = _on_both_paths(monkeypatch, lambda: PBLRU(S, "cpu"))
    g = torch.Generator().manual_seed(7)
    tracked = torch.zeros(S, dtype=torch.bool)
    selected = 0
    for it in range(300):
        op = int(torch.randint(0, 6, (1,), generator=g))
        if op == 0:
            touch_new(pols, tracked, g)
        elif op == 1:
            hit_some(pols, tracked, g)
        elif op in (2, 3):
            for p in pols:
                for _ in range(1 + 3 * (op == 3)):
                    p.advance_round()
        elif op == 4 and it % 3 == 0:
            live = tracked.nonzero().squeeze(1)
            rel = live[torch.randperm(live.numel(), generator=g)[:3]]
            for p in pols:
                p.release(rel)
            tracked[rel] = False
        else:
            vic = select_all(pols, int(torch.randint(1, 8, (1,), generator=g)))
            if vic is not None:
                tracked[vic] = False
                selected += vic.numel()
        assert torch.equal(pols[0].labels[:S], pols[1].labels[:S])  # (not the dummy)
    assert selected > 50 and pols[0].harvests == pols[1].harvests > 10


@pytest.mark.parametrize("lru", ["pblru", "pblru_queue"])
def test_mapping_same_with_triton_path(monkeypatch, lru):
    """A whole replay gives identical results on the Triton and torch paths."""
    from ulacache_vllm.core import TieredMapping
    from lab.policies import factory
    from lab.trace import generate_dsa_trace, replay

    tr = generate_dsa_trace(num_steps=12, batch=2, topk=32, prompt_len=(64, 128),
                            decode_len=(4, 8), seed=3)
    pool = max(tr.working_set // 3, int(1.25 * tr.peak_demand))
    outs = []
    for force in ("0", "1"):
        monkeypatch.setenv("ULACACHE_FORCE_TRITON", force)
        m = TieredMapping(tr.num_logical, pool, tr.num_logical, lru=factory(lru), ring_size=3)
        replay(tr, {0: m})
        outs.append((m.stats.hits, m.stats.promotions, m.resolve(torch.arange(tr.num_logical))))
    assert outs[0][0] == outs[1][0] and outs[0][1] == outs[1][1]
    assert torch.equal(outs[0][2], outs[1][2])
    assert outs[0][1] > 0, "trace too small to exercise victim selection"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hier_bitmap_first_k_and_derived_pool_view(seed):
    """Summary-level first-k over rows in a given order == brute force; a pool's derived
    free bitmap matches its owner map."""
    from ulacache_vllm.core.bitmaps import HierBitmap
    from ulacache_vllm.core.pools import SlotPool

    g = torch.Generator().manual_seed(seed)
    S, rows = 70_000, 3  # three levels of summaries
    bm = HierBitmap(rows, S, "cpu")
    members = []
    for r in range(rows):
        sl = torch.randperm(S, generator=g)[: int(torch.randint(0, 300, (1,), generator=g))]
        sl = sl[(sl % rows) == r]  # rows disjoint
        bm.add(r, sl)
        members.append(sl.sort().values)
    order = torch.tensor([2, 0, 1])
    expect = torch.cat([members[r] for r in order.tolist()])
    for k in (1, 17, expect.numel(), expect.numel() + 5):
        assert torch.equal(bm.first_k(order, k), expect[:k])
    pool = SlotPool(5000, "cpu")
    used = pool.alloc(torch.arange(1234))
    pool.release(used[::3].clone())
    free = (pool.owner < 0)
    assert pool.free_bits.count() == pool.num_free == int(free.sum())


def test_queue_pblru_ring_same_with_triton_path(monkeypatch):
    """The queue PB-LRU on the Triton kernels picks the same victims as on the torch path
    through ring wraps, windows crossing the ring's end, stashes and compactions."""
    from _policy_drive import hit_some, select_all, touch_new
    from lab.pblru_queue import QueuePBLRU

    S = 24
    pols = _on_both_paths(monkeypatch, lambda: QueuePBLRU(S, "cpu", queue_capacity=2 * S + 5))
    g = torch.Generator().manual_seed(5)
    tracked = torch.zeros(S, dtype=torch.bool)
    for it in range(240):
        op = int(torch.randint(0, 6 if (it // 60) % 2 else 4, (1,), generator=g))
        if op == 0:
            touch_new(pols, tracked, g)
        elif op == 1:
            hit_some(pols, tracked, g)
        elif op in (2, 3):
            for p in pols:
                p.advance_round()
        else:
            vic = select_all(pols, int(torch.randint(1, 8, (1,), generator=g)))
            if vic is not None:
                tracked[vic] = False
        assert torch.equal(pols[0].bucket_of(), pols[1].bucket_of())
    assert pols[0].wraps > 0 and pols[0].compactions > 0 and pols[0].wraps == pols[1].wraps
