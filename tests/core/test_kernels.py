"""The product's Triton kernel (the round-label PB-LRU's hit + touch) vs its torch reference,
executed by the Triton interpreter on CPU; the reference's table helpers. The lab's queue /
bitmap kernels: test_queue_kernels.py."""

import contextlib
import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _triton_interpreter import interpreted
from ulacache_vllm.kernels import reference as ref

# Triton reads TRITON_INTERPRET when it is first imported (triton.language's own @jit
# helpers), when @triton.jit decorates the kernels, and while they run: set for these
# imports here and for this module's tests by the fixture, never left in the environment
# (_triton_interpreter.py).
with interpreted():
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    tk = importlib.import_module("ulacache_vllm.kernels.pblru_kernels")

pytestmark = pytest.mark.usefixtures("triton_interpreter")


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
    assert isinstance(tk._label_hit_touch_kernel, InterpretedFunction), \
        "Triton kernels would not run on CPU"


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


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), S=st.integers(0, 400), n=st.integers(0, 300),
       hit_p=st.sampled_from([0.0, 0.3, 1.0]), rnd=st.integers(0, 2**15 - 2),
       dtype=st.sampled_from([torch.int16, torch.int32]))
def test_label_hit_touch(seed, S, n, hit_p, rnd, dtype):
    """Round-label hit detection + touch: device values (a slot below S) are hits and get
    label ``rnd``; other tiers (1, 2) and unmapped (-1) values are misses and
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


def test_pblru_rounds_same_with_triton_path(monkeypatch):
    """The round-label PB-LRU on the Triton kernel picks the same victims and labels as on
    the reference path, through hits with misses among them, releases and idle rounds."""
    from _policy_drive import hit_some, on_both_paths, select_all, touch_new
    from ulacache_vllm.core import PBLRU

    S = 40
    pols = on_both_paths(monkeypatch, lambda: PBLRU(S, "cpu"), tk, ref)
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
        outs.append((m.stats.hits, m.stats.promotions,
                     torch.stack(m.locate(torch.arange(tr.num_logical)))))
    assert outs[0][0] == outs[1][0] and outs[0][1] == outs[1][1]
    assert torch.equal(outs[0][2], outs[1][2])
    assert outs[0][1] > 0, "trace too small to exercise victim selection"
