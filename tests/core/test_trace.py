"""Trace generator, file formats and replay: what the PB-LRU benchmark relies on."""

import json

import numpy as np
import pytest
import torch

from ulacache_vllm.core import TieredMapping
from ulacache_vllm.core.trace import generate_dsa_trace, load_trace, replay, save_trace


@pytest.fixture(scope="module")
def trace():
    return generate_dsa_trace(num_steps=40, batch=4, topk=64, prompt_len=(200, 400),
                              decode_len=(8, 20), overlap=(0.7, 0.9), seed=7)


def _requests_sets(tr):
    """Per request, its selection sets in step order."""
    out = {}
    for st in tr.steps:
        for r in st.select_req.unique().tolist():
            out.setdefault(r, []).append(set(st.select_addr[st.select_req == r].tolist()))
    return out


def test_generator_controls_overlap_and_shares_one_pool(trace):
    per_req = _requests_sets(trace)
    assert len(per_req) > 4, "requests should finish and be replaced"
    ratios = [len(a & b) / len(b) for sets in per_req.values() for a, b in zip(sets, sets[1:])]
    assert ratios and 0.65 <= min(ratios) and max(ratios) <= 0.95 + 1 / 64
    for st in trace.steps:  # one top-k per decoding request, no address selected twice by it
        for r in st.select_req.unique().tolist():
            sel = st.select_addr[st.select_req == r]
            assert sel.numel() == 64 and sel.unique().numel() == 64
    assert 0 < trace.peak_demand <= trace.working_set


@pytest.mark.parametrize("suffix", [".npz", ".jsonl"])
def test_save_load_roundtrip_replays_identically(trace, tmp_path, suffix):
    path = tmp_path / f"t{suffix}"
    save_trace(trace, str(path))
    back = load_trace(str(path))
    assert back.num_logical == trace.num_logical
    assert (back.working_set, back.peak_demand) == (trace.working_set, trace.peak_demand)
    assert len(back.steps) == len(trace.steps)
    for a, b in zip(trace.steps, back.steps):
        assert a.step == b.step and a.group == b.group
        for f in ("free_addr", "append_addr", "select_addr", "select_req"):
            assert torch.equal(getattr(a, f).sort().values, getattr(b, f).sort().values), f
    stats = []
    for tr in (trace, back):
        pool = trace.peak_demand * 3 // 2
        m = TieredMapping(tr.num_logical, pool, tr.num_logical, lru="pblru")
        replay(tr, {0: m})
        assert m.stats.demotions > 0 and m.stats.promotions > 0, "pool too large to exercise eviction"
        stats.append((m.stats.hits, m.stats.lookups, m.stats.demotions))
    assert stats[0] == stats[1]


def test_loader_rejects_foreign_files(tmp_path):
    bad = tmp_path / "x.npz"
    np.savez(bad, foo=np.arange(3))
    with pytest.raises(ValueError, match="missing arrays"):
        load_trace(str(bad))
    j = tmp_path / "x.jsonl"
    j.write_text(json.dumps({"step": 0, "kind": "evict", "addr": [1]}) + "\n")
    with pytest.raises(ValueError, match="kind"):
        load_trace(str(j))
    j.write_text(json.dumps({"num_logical": 4}) + "\n"
                 + json.dumps({"step": 0, "kind": "append", "addr": [9]}) + "\n")
    with pytest.raises(ValueError, match="outside num_logical"):
        load_trace(str(j))
