"""The lab's queue / bitmap PB-LRU kernels (``lab/queue_kernels_triton.py``) vs their torch
references (``lab/queue_kernels.py``), executed by the Triton interpreter on CPU."""

import contextlib
import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _triton_interpreter import interpreted
from lab import queue_kernels as ref
from ulacache_vllm.kernels import reference as product_ref

# Triton reads TRITON_INTERPRET when it is first imported (triton.language's own @jit
# helpers), when @triton.jit decorates the kernels, and while they run: set for these
# imports here and for this module's tests by the fixture, never left in the environment
# (_triton_interpreter.py).
with interpreted():
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    tk = importlib.import_module("lab.queue_kernels_triton")

pytestmark = pytest.mark.usefixtures("triton_interpreter")


QUEUE_DTYPES = [torch.int64, torch.int32]  # PB-LRU's queue is int32


@contextlib.contextmanager
def _compact_scan_min(n: int):
    """Set the size from which ``compact`` (the product reference's, which ``queue_take`` uses)
    runs branch-free (hypothesis runs many examples per test call, so no function-scoped
    monkeypatch)."""
    old, product_ref.COMPACT_SCAN_MIN = product_ref.COMPACT_SCAN_MIN, n
    try:
        yield
    finally:
        product_ref.COMPACT_SCAN_MIN = old


def test_queue_kernels_really_interpreted():
    for fn in (tk._popcount_kernel, tk._expand_kernel, tk._queue_push_kernel, tk._queue_live_kernel,
               tk._queue_first_k_kernel, tk._hit_flags_kernel, tk._hit_push_kernel):
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
    other tiers (1, 2) and unmapped (-1) values are not."""
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


def test_expand_first_k_one_strided_word():
    """A 1-element strided view counts as contiguous but cannot be viewed as bytes."""
    w = torch.tensor([0b1011, 5], dtype=torch.int64)[::2]
    assert ref.expand_first_k(w, 3).tolist() == [0, 1, 3]
    assert tk.expand_first_k(w, 3).tolist() == [0, 1, 3]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hier_bitmap_first_k_and_derived_pool_view(seed):
    """Summary-level first-k over rows in a given order == brute force."""
    from lab.pblru_bitmap import HierBitmap

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
    assert bm.count() == expect.numel() and bm.count(order[0]) == members[2].numel()


def test_queue_pblru_ring_same_with_triton_path(monkeypatch):
    """The queue PB-LRU on the Triton kernels picks the same victims as on the torch path
    through ring wraps, windows crossing the ring's end, stashes and compactions."""
    from _policy_drive import hit_some, on_both_paths, select_all, touch_new
    from lab.pblru_queue import QueuePBLRU

    S = 24
    pols = on_both_paths(monkeypatch, lambda: QueuePBLRU(S, "cpu", queue_capacity=2 * S + 5),
                         tk, ref)
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
