"""`benchmarks/lab/stable_indexer.py`: the step-to-step top-k overlap read from a selection
trace (decode selections per request and layer group, prefill chunks skipped), and the
``stable:RHO[:PE]`` variant builder (only the embedding and, with PE, the indexer keys' RoPE
half change; names, shapes and dtype kept; deterministic). No engine."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lab.stable_indexer import build_variant, overlap_from_trace, parse_variant


def _trace(path, records):
    with open(path, "w") as f:
        f.write(json.dumps({"num_logical": 1 << 12}) + "\n")
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_overlap_from_trace(tmp_path):
    k = 4
    p = tmp_path / "t.jsonl"
    recs = [
        # step 0: a prefill chunk of request 0 (more than k selections): not a decode step
        {"step": 0, "group": 0, "kind": "select", "req": [0] * 8, "addr": list(range(8))},
        {"step": 0, "group": 0, "kind": "append", "req": 0, "addr": [100]},
        # steps 1-3: decode, request 0 keeps 3 of 4 then 4 of 4; request 1 keeps 0 of 4
        {"step": 1, "group": 0, "kind": "select", "req": [0] * 4 + [1] * 4,
         "addr": [1, 2, 3, 4, 20, 21, 22, 23]},
        {"step": 2, "group": 0, "kind": "select", "req": [0] * 4 + [1] * 4,
         "addr": [1, 2, 3, 5, 30, 31, 32, 33]},
        {"step": 2, "group": 1, "kind": "select", "req": [0] * 2, "addr": [7, 8]},
        {"step": 3, "group": 0, "kind": "select", "req": [0] * 4, "addr": [5, 3, 2, 1]},
        # step 5 follows no step-4 selection of request 0: no sample
        {"step": 5, "group": 0, "kind": "select", "req": [0] * 4, "addr": [5, 3, 2, 1]},
    ]
    _trace(p, recs)
    ov = overlap_from_trace(p, k)
    assert ov["samples"] == 3
    assert ov["mean"] == pytest.approx((0.75 + 0.0 + 1.0) / 3)
    assert ov["mean_by_group"] == {"0": pytest.approx((0.75 + 0.0 + 1.0) / 3)}
    _trace(p, recs[:1])
    assert overlap_from_trace(p, k)["samples"] == 0


def test_parse_variant():
    assert parse_variant(None) is None
    assert parse_variant("stable:0.5") == (0.5, 1.0)
    assert parse_variant("stable:0.9:0.01") == (0.9, 0.01)
    for bad in ("stable:1.0", "stable:0.5:0", "random:0.5", "stable:0.1:0.2:0.3"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_build_variant(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"qk_rope_head_dim": 2}))
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
         "model.layers.0.self_attn.indexer.k_norm.weight": torch.ones(4, dtype=torch.bfloat16),
         "model.layers.0.self_attn.indexer.k_norm.bias": torch.ones(4, dtype=torch.bfloat16),
         "lm_head.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16)}
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = build_variant(src, 0.9, 0.1)
    assert out.name == "src-stable0.9-pe0.1" and (out / "config.json").exists()
    v = load_file(str(out / "model.safetensors"))
    assert {k: (x.shape, x.dtype) for k, x in v.items()} == \
        {k: (x.shape, x.dtype) for k, x in t.items()}
    assert torch.equal(v["lm_head.weight"], t["lm_head.weight"])
    e0, e1 = t["model.embed_tokens.weight"].float(), v["model.embed_tokens.weight"].float()
    assert torch.allclose(e1.norm(dim=1), e0.norm(dim=1), rtol=2e-2)
    cos = lambda e: torch.nn.functional.cosine_similarity(e[:, None], e[None], dim=-1).mean()
    assert cos(e1) > 0.8 > cos(e0) + 0.5  # the rows now share most of their direction
    kn = v["model.layers.0.self_attn.indexer.k_norm.weight"].float()
    assert torch.allclose(kn, torch.tensor([0.1, 0.1, 1.0, 1.0]), atol=1e-3)
    first = (out / "model.safetensors").read_bytes()
    again = build_variant(src, 0.9, 0.1, out=tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == first
    plain = load_file(str(build_variant(src, 0.9) / "model.safetensors"))
    assert torch.equal(plain["model.layers.0.self_attn.indexer.k_norm.weight"],
                       t["model.layers.0.self_attn.indexer.k_norm.weight"])
