"""The indexer's scores give a key the same bits however many keys are scored beside it.

TP shard mode's promise (stock TP=P and ulacache TP=P select the same rows) rests on it. A
BLAS product does not keep it (kernels and blocking chosen by shape and CPU), so
`indexer_scores` computes exactly on the indexer's fp8-grid inputs and in a fixed order on any
other input; both are checked here over random shapes, keys 1 to a few thousand, heads 1-64.
The whole indexer's faster route (`certified_logits`: float32 products, the keys near the k-th
score rescored exactly) must select exactly what the exact scores select: checked on random and
tie-heavy inputs, and against an injected error as large as its bound allows.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ulacache_vllm.engine.dsa.cpu_indexer import quant_fp8_ue8m0, select_topk
from ulacache_vllm.engine.dsa import indexer_scores
from ulacache_vllm.engine.dsa.indexer_scores import (
    Fp8Keys,
    certified_logits,
    error_bound_factor,
    exact_scores,
    fixed_order_scores,
    indexer_logits,
    on_fp8_grid,
    scores,
)
from ulacache_vllm.engine.dsa.topk import local_candidates, merge_candidates

D = 128


def _fp8_inputs(g, n, H, L, spread):
    """Queries as the indexer feeds them (fp8 values), keys fp8 times a per-key power of two
    (quantized like `write_keys`), key magnitudes spread over 2**spread."""
    q = (torch.randn(n, H, D, generator=g) * 8).to(torch.float8_e4m3fn).float()
    raw = torch.randn(L, D, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, (L, 1),
                                                                    generator=g).float())
    v, s = quant_fp8_ue8m0(raw)
    return q, v.float() * s.float().repeat_interleave(D // s.shape[-1], -1)


def _bits(x):
    return x.contiguous().view(torch.int32)


def _check_subsets(q, keys, g):
    """Each key's score alone, among a random subset, among a strided share: the same bits."""
    whole = scores(q, keys)
    L = keys.shape[0]
    for idx in (torch.arange(L)[torch.randperm(L, generator=g)[: max(1, L // 3)]].sort().values,
                torch.arange(L % 3, L, 3), torch.tensor([L - 1])):
        if idx.numel():
            part = scores(q, keys[idx])
            assert torch.equal(_bits(part), _bits(whole[:, :, idx])), idx.tolist()[:8]
    return whole


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 6), H=st.integers(1, 64), L=st.integers(1, 3000),
       spread=st.integers(0, 12), seed=st.integers(0, 2**31 - 1))
def test_fp8_grid_scores_are_exact_and_bitwise_whatever_the_keys_beside(n, H, L, spread, seed):
    g = torch.Generator().manual_seed(seed)
    q, keys = _fp8_inputs(g, n, H, L, spread)
    assert on_fp8_grid(q) and on_fp8_grid(keys)
    whole = _check_subsets(q, keys, g)
    # Exact: the float64 product rounded once; the float64 sum of 36-bit products is exact.
    i = torch.randint(0, L, (4,), generator=g)
    ref = (q.double().unsqueeze(2) * keys[i].double()).sum(-1).float()
    assert torch.equal(_bits(whole[:, :, i]), _bits(ref))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 4), H=st.integers(1, 64), L=st.integers(1, 1200),
       seed=st.integers(0, 2**31 - 1))
def test_other_float_inputs_take_the_fixed_order_and_are_bitwise_too(n, H, L, seed):
    g = torch.Generator().manual_seed(seed)
    q, keys = torch.randn(n, H, D, generator=g), torch.randn(L, D, generator=g)
    assert not on_fp8_grid(keys)
    whole = _check_subsets(q, keys, g)
    assert torch.equal(_bits(whole), _bits(fixed_order_scores(q, keys)))
    torch.testing.assert_close(whole, torch.einsum("nhd,ld->nhl", q.double(), keys.double()).float(),
                               rtol=1e-5, atol=1e-4)


def test_the_grid_check_rejects_what_it_cannot_prove_exact():
    x = torch.tensor([[1.0, 2.0, 448.0]])
    assert on_fp8_grid(x) and on_fp8_grid(x * 2.0 ** -20) and on_fp8_grid(torch.zeros(2, 3))
    assert not on_fp8_grid(torch.tensor([[1.0, 1.0 + 2 ** -10]]))  # 11-bit mantissa
    assert not on_fp8_grid(torch.tensor([[1.0, float("nan")]]))
    assert not on_fp8_grid(x * 3.0 ** 0.5)
    # Rows scaled by different powers of two are each on the grid.
    assert on_fp8_grid(torch.cat([x, x * 2.0 ** 9, x * 2.0 ** -7]))
    q = (torch.randn(2, 3, D) * 4).to(torch.float8_e4m3fn).float()
    k = (torch.randn(5, D)).to(torch.float8_e4m3fn).float()
    assert torch.equal(_bits(scores(q, k)), _bits(exact_scores(q, k)))


def assert_shards_merge_to_the_whole(q, w, keys, qpos, k, P):
    """Every rank's candidates (keys t mod P) merge into the whole indexer's top-k; returns
    the ranks' candidates."""
    L = keys.shape[0]
    whole = select_topk(q, w, keys, qpos, k)
    parts = [select_topk(q, w, keys[r::P], qpos, k, key_positions=torch.arange(r, L, P),
                         candidates=True) for r in range(P)]
    merged = merge_candidates(torch.stack([x[0] for x in parts]),
                              torch.stack([x[1] for x in parts]), k)
    assert torch.equal(merged, whole)
    return parts


@settings(max_examples=15, deadline=None)
@given(P=st.integers(2, 8), H=st.integers(1, 64), L=st.integers(8, 2000),
       seed=st.integers(0, 2**31 - 1))
def test_token_shards_merge_to_the_whole_indexers_selection(P, H, L, seed):
    """The engine's inputs: every rank's candidates (keys t mod P) merge into exactly the whole
    indexer's top-k, scores bit for bit."""
    g = torch.Generator().manual_seed(seed)
    n = min(8, L)
    q, keys = _fp8_inputs(g, n, H, L, 4)
    w = torch.randn(n, H, generator=g)
    qpos = torch.arange(L - n, L)
    k = min(64, L)
    parts = assert_shards_merge_to_the_whole(q, w, keys, qpos, k, P)
    # Every key's logit: a shard's carry the whole scoring's bits, and so do the candidates
    # of every query the shards scored (those past the top-k).
    full = indexer_logits(q, w, keys, qpos, torch.arange(L), exact=True)
    for r, (s, p) in enumerate(parts):
        kp = torch.arange(r, L, P)
        assert torch.equal(_bits(indexer_logits(q, w, keys[r::P], qpos, kp, exact=True)),
                           _bits(full[:, kp]))
        ok = (p >= 0) & (qpos + 1 > k).unsqueeze(1)
        assert torch.equal(_bits(s[ok]), _bits(full.gather(1, p.long().clamp(min=0))[ok]))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 40), H=st.integers(1, 16), L=st.integers(1, 300),
       topk=st.integers(1, 320), seed=st.integers(0, 2**31 - 1))
def test_a_query_whose_prefix_fits_the_topk_selects_it_all_unscored(n, H, L, topk, seed):
    """Queries at positions p with p + 1 <= topk are not scored: their selection (every causal
    key) and candidates are what scoring them gives."""
    g = torch.Generator().manual_seed(seed)
    n = min(n, L)
    q, keys = _fp8_inputs(g, n, H, L, 2)
    w = torch.randn(n, H, generator=g)
    qpos = torch.arange(L - n, L)
    vals, out = select_topk(q.to(torch.float8_e4m3fn), w, keys, qpos, topk, candidates=True)
    ref_vals, ref_out = local_candidates(
        indexer_logits(q, w, keys, qpos, torch.arange(L), exact=True), torch.arange(L), topk)
    assert torch.equal(out, ref_out)
    scored = qpos + 1 > topk
    assert torch.equal(_bits(vals[scored]), _bits(ref_vals[scored]))
    short = out[~scored]
    assert torch.equal(short, torch.where(torch.arange(topk) <= qpos[~scored].unsqueeze(1),
                                          torch.arange(topk), -1).int())


def _selection(logits, L, k):
    return local_candidates(logits, torch.arange(L), k)[1]


def _tie_heavy(g, n, H, L, spread, kind):
    """kind 0: random; 1: queries <= 0 (most logits exactly 0: ties at the k-th); 2: every key
    repeated (exact ties between distinct positions)."""
    q, keys = _fp8_inputs(g, n, H, L, spread)
    if kind == 1:
        q = -q.abs()
        q[:, :, :4] = q[:, :, :4].abs()  # a few positive scores still
    elif kind == 2:
        keys = keys[torch.arange(L) // 2 * 2]
    return q, keys


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 24), H=st.integers(1, 64), L=st.integers(2, 3000),
       topk=st.integers(1, 600), spread=st.integers(0, 10), kind=st.integers(0, 2),
       fp8_keys=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_certified_logits_select_exactly_the_exact_top_k(n, H, L, topk, spread, kind, fp8_keys,
                                                         seed):
    g = torch.Generator().manual_seed(seed)
    q, keys = _tie_heavy(g, n, H, L, spread, kind)
    w = torch.randn(n, H, generator=g)
    qpos = torch.randint(0, L, (n,), generator=g).sort().values
    kp = torch.arange(L)
    if fp8_keys:  # as the cache holds them: codes and one power-of-two scale per key
        codes, scales = quant_fp8_ue8m0(keys, group=D)
        keys = Fp8Keys(codes.contiguous().view(torch.uint8), scales.float().reshape(L))
    exact = indexer_logits(q, w, keys, qpos, kp, exact=True)
    cert = certified_logits(q, w, keys, qpos, kp, topk)
    assert cert is not None
    assert torch.equal(_selection(cert, L, topk), _selection(exact, L, topk))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 12), H=st.integers(1, 64), L=st.integers(64, 2000),
       topk=st.integers(8, 400), kind=st.integers(0, 2), seed=st.integers(0, 2**31 - 1))
def test_certification_holds_against_an_error_as_large_as_its_bound(n, H, L, topk, kind, seed):
    """The float32 pass replaced by the exact logits plus noise of up to 0.99 of the bound
    (the worst a BLAS may do): the selection is still the exact one, and keys were rescored."""
    g = torch.Generator().manual_seed(seed)
    q, keys = _tie_heavy(g, n, H, L, 3, kind)
    w = torch.randn(n, H, generator=g)
    qpos = torch.arange(L - n, L)
    kp = torch.arange(L)
    exact = indexer_logits(q, w, keys, qpos, kp, exact=True)
    knorm = float(torch.linalg.vector_norm(keys.double(), dim=1).max())
    wq = (w.double().abs() * torch.linalg.vector_norm(q.double(), dim=-1)).sum(1)
    bound = error_bound_factor(D, H) * knorm * wq
    noise = ((torch.rand(n, L, generator=g, dtype=torch.float64) * 2 - 1) * 0.99
             * bound.unsqueeze(1))
    noisy = torch.where(exact > float("-inf"), (exact.double() + noise).float(), exact)
    # float32 rounding of exact + noise may add half an ulp: keep the noise inside the bound
    noisy = torch.where((noisy.double() - exact.double()).abs() <= bound.unsqueeze(1),
                        noisy, exact)
    rescored = []
    real_exact_keys = indexer_scores._exact_keys

    def fake_tiled(q_, w_, keys_, pos_, kp_, mode):
        assert mode == "fast"
        return noisy.clone(), knorm

    def counting_exact_keys(keys_, cols):
        rescored.append(cols.numel())
        return real_exact_keys(keys_, cols)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(indexer_scores, "_tiled_logits", fake_tiled)
        mp.setattr(indexer_scores, "_exact_keys", counting_exact_keys)
        cert = certified_logits(q, w, keys, qpos, kp, topk)
    assert torch.equal(_selection(cert, L, topk), _selection(exact, L, topk))
    assert sum(rescored) > 0  # the straddling keys were scored again
