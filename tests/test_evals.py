"""lm-eval's `vllm` model works on this build with `kv_backend=ulacache`, and scores and
greedy generations match the stock backend (few-shot prompts of several hundred tokens under
a small ulacache budget, so rows spill to the host pool)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))


def test_lm_eval_consistency_ulacache_vs_stock(tiny_model):
    from consistency import compare

    model = tiny_model("deepseek_v32")
    rep = compare(str(model), limit=4, task="ulacache_arith", num_fewshot=4,
                  ula_args="ula_host_pool_gib=0.006,kv_cache_memory_bytes=11000000",
                  ref_args="kv_cache_memory_bytes=268435456")
    assert rep["num_docs"] == 4
    assert rep["stock"]["sample_len"] == rep["ulacache"]["sample_len"] == 4
    assert rep["scores_equal"], rep
    assert rep["generations_identical"], rep
