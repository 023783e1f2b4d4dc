"""Triton kernels vs torch references, executed by the Triton interpreter on CPU."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton modules are imported (decoration time)

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


def test_kernels_really_interpreted():
    for fn in (tk._popcount_kernel, tk._expand_kernel, tk._hit_touch_kernel, tk._move_bits_kernel,
               tt._translate_kernel):
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
    bits = ((w[:, None] >> torch.arange(64)) & 1).reshape(-1)
    assert torch.equal(ref.popcount64(w), ((w[:, None] >> torch.arange(64)) & 1).sum(1))
    expect = bits.nonzero().squeeze(1)[:k]
    assert torch.equal(ref.expand_first_k(w, k), expect)
    assert torch.equal(tk.expand_first_k(w, k), expect)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), S=st.integers(1, 700), n=st.integers(0, 300), stamp=st.integers(0, 2**40))
def test_hit_touch(seed, S, n, stamp):
    g = torch.Generator().manual_seed(seed)
    # Unique entries: device hits on distinct slots, host entries, unmapped.
    kind = torch.randint(0, 3, (n,), generator=g)
    slots = torch.randperm(S, generator=g)[: n] if n <= S else torch.randint(0, S, (n,), generator=g)
    if n > S:
        kind = torch.where(torch.arange(n) < S, kind, torch.full_like(kind, 1))
        slots[:S] = torch.randperm(S, generator=g)
    loc = torch.where(kind == 0, slots, torch.where(kind == 1, (1 << 32) | slots, -1))
    st0 = torch.randint(0, 1000, (S,), generator=g)
    a1, a2 = st0.clone(), st0.clone()
    h1, s1, hs1 = ref.hit_touch(loc, a1, stamp)
    h2, s2, hs2 = tk.hit_touch(loc, a2, stamp)
    assert torch.equal(h1, h2) and torch.equal(s1, s2) and torch.equal(hs1, hs2) and torch.equal(a1, a2)
    assert torch.equal(h1, kind == 0) and torch.equal(s1, torch.where(kind == 0, slots, -1))
    expect = st0.clone()
    expect[slots[kind == 0]] = stamp
    assert torch.equal(a1, expect)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), S=st.integers(1, 700), B=st.integers(1, 6), n=st.integers(0, 300))
def test_move_bits(seed, S, B, n):
    g = torch.Generator().manual_seed(seed)
    W = -(-S // 64)
    label = torch.randint(0, B, (S,), generator=g)  # every slot in exactly one row
    words = torch.zeros(B, W, dtype=torch.int64)
    for b in range(B):
        sl = (label == b).nonzero().squeeze(1)
        if sl.numel():
            words[b] |= ref.slots_to_words(sl, W)
    counts = torch.bincount(label, minlength=B)
    slots = torch.randperm(S, generator=g)[: min(n, S)]
    new = torch.randint(0, B, (slots.numel(),), generator=g)
    old = label[slots]
    w1, c1, w2, c2 = words.clone(), counts.clone(), words.clone(), counts.clone()
    ref.move_bits(w1, c1, slots, old, new)
    tk.move_bits(w2, c2, slots, old, new)
    assert torch.equal(w1, w2) and torch.equal(c1, c2)
    label[slots] = new
    expect = torch.zeros(B, W, dtype=torch.int64)
    for b in range(B):
        sl = (label == b).nonzero().squeeze(1)
        if sl.numel():
            expect[b] |= ref.slots_to_words(sl, W)
    assert torch.equal(w1, expect) and torch.equal(c1, torch.bincount(label, minlength=B))


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


def test_mapping_same_with_triton_path(monkeypatch):
    """A whole replay gives identical results on the Triton and torch paths."""
    from ulacache_vllm.core import TieredMapping
    from ulacache_vllm.core.trace import generate_dsa_trace, replay

    tr = generate_dsa_trace(num_steps=12, batch=2, topk=32, prompt_len=(64, 128),
                            decode_len=(4, 8), seed=3)
    pool = max(tr.working_set // 3, int(1.25 * tr.peak_demand))
    outs = []
    for force in ("0", "1"):
        monkeypatch.setenv("ULACACHE_FORCE_TRITON", force)
        m = TieredMapping(tr.num_logical, pool, tr.num_logical, lru="pblru", ring_size=3)
        replay(tr, {0: m})
        outs.append((m.stats.hits, m.stats.promotions, m.resolve(torch.arange(tr.num_logical))))
    assert outs[0][0] == outs[1][0] and outs[0][1] == outs[1][1]
    assert torch.equal(outs[0][2], outs[1][2])
    assert outs[0][1] > 0, "trace too small to exercise victim selection"
