"""TP shard mode with speculative decoding (MTP, two draft tokens) and prefix caching on: the
paper's headline setup.
Rejected drafts' rows are rewritten in place at the next step; every rank drops a written
address from its remote-row buffer before that step reads (`store._prepare_writes`), so no
rank serves a stale copy. Greedy output equals stock TP=2 with the same speculative settings,
token for token, under pressure (rows demoted and promoted, remote rows fetched), and the
drafts were really proposed and judged: some accepted (their rows kept), some rejected (their
rows rewritten), the same ones as stock's."""
from __future__ import annotations

import pytest

from _vllm_subprocess import (AGREEING_MTP, IN_PROCESS, REPEATED_WORD_PROMPTS, SPEC_ACCEPTED,
                              SPEC_DECODE_METRICS, SPEC_DRAFTS, check_drafts_judged_both_ways,
                              mla_path_kwargs, run_at_once, run_vllm_script, tp_omp_bind)

pytestmark = pytest.mark.engine  # every test here boots vLLM

# Drafts of an MTP layer built to agree, on prompts of one repeated word (``AGREEING_MTP``):
# ~20 % of the draft tokens accepted, the rest rejected.
SCRIPT = r"""
from vllm import LLM, SamplingParams
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_seqs=8, seed=0, tensor_parallel_size=2, disable_log_stats=False,
          speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **ARGS["kw"])
words_per_prompt = [140 + 30 * i for i in range(8)]  # ~2.2k tokens
""" + REPEATED_WORD_PROMPTS + r"""
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
# Prefix caching is on (both sides): the first prompts again, with new endings, hit the
# cached blocks of the first wave, wherever their rows now sit (tier, owner rank).
again = llm.generate([p + " five six" for p in prompts[:4]],
                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
""" + SPEC_DECODE_METRICS + r"""
m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()
     if x.name.startswith("vllm:ulacache_") or x.name == "vllm:prefix_cache_hits"}
res = {"out": [o.outputs[0].token_ids for o in outs], "metrics": {**m, **spec_metrics},
       "again": [o.outputs[0].token_ids for o in again]}
if ARGS["kw"]["kv_backend"] == "ulacache":
    res["usage"] = llm.collective_rpc("ulacache_usage")
emit(res)
"""
REF_KV_BYTES = 512 << 20
# Per rank ~1.05k device + ~0.6k host slots per layer group (three: the target's two sparse-MLA
# layers and the MTP layer), just above what one 2048-token step needs on each rank (its half +
# index_topk; the engine refuses less): ~2.1k device rows a group over both ranks, below the
# ~2.5k tokens the eight requests hold at their peak.
ULA_KV_BYTES = 8_300_000
ULA_HOST_GIB = 0.004


@pytest.fixture(scope="module")
def runs(tiny_model):
    model = str(tiny_model("deepseek_v32", **AGREEING_MTP))
    # (tp_omp_bind fails, naming the CPUs, where this process may use fewer than 2; the engine
    # core in the script's process, the two ranks' workers in their own)
    env = {**tp_omp_bind(2), **IN_PROCESS}
    base = {**mla_path_kwargs("reference"), "enable_prefix_caching": True}
    ref, ula = run_at_once(  # (both at once: their start-ups overlap)
        lambda: run_vllm_script(SCRIPT, args={"model": model, "kw": {
            "kv_backend": "vllm", "kv_cache_memory_bytes": REF_KV_BYTES, **base}},
            timeout=900, env=env),
        lambda: run_vllm_script(SCRIPT, args={"model": model, "kw": {
            "kv_backend": "ulacache", "kv_cache_memory_bytes": ULA_KV_BYTES,
            "ula_host_pool_gib": ULA_HOST_GIB, "ula_tp_lockstep_check": True, **base}},
            timeout=900, env={"ULACACHE_PBLRU_SMALL_POOL_SLOTS": "0", **env}))
    return ula, ref


def test_shard_mode_mtp_equals_stock_tp2_under_pressure(runs):
    ula, ref = runs
    m = ula["metrics"]
    print(f"\nTP=2 shard + MTP: {m[SPEC_DRAFTS]} draft tokens, {m[SPEC_ACCEPTED]} accepted, per "
          f"position {m['vllm:spec_decode_num_accepted_tokens_per_pos']}; demotions "
          f"{m['vllm:ulacache_demotions']}, promotions {m['vllm:ulacache_promotions']}, remote "
          f"rows {m['vllm:ulacache_remote_rows_fetched']}, prefix hits "
          f"{m['vllm:prefix_cache_hits']}")
    assert ula["out"] == ref["out"]
    assert ula["again"] == ref["again"]
    check_drafts_judged_both_ways(m, ref["metrics"])
    # Under pressure, sharded: rows moved between tiers and crossed ranks.
    assert m["vllm:ulacache_demotions"] > 0 and m["vllm:ulacache_promotions"] > 0, m
    assert m["vllm:ulacache_remote_rows_fetched"] > 0, m
    assert all(u["tp_mode"] == "shard" and u["tp_world"] == 2 for u in ula["usage"])
    # Prefix caching under shard mode: the second wave hit the first wave's cached blocks.
    assert m["vllm:prefix_cache_hits"] > 0 and ref["metrics"]["vllm:prefix_cache_hits"] > 0, m
    assert m["vllm:ulacache_prefix_hit_entries"] > 0, m
