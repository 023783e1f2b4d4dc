"""The arena (hybrid models) with speculative decoding, token-exact against stock vLLM with the
same speculative settings.

- GPT-OSS and Gemma 3 (sliding window + full attention) with n-gram drafts (3 tokens), float32:
  a same-schedule phase (every request admitted at once on both sides) whose draft and
  acceptance counters must equal stock's, then a pressure phase (an arena too small for the
  batch: preemption and recompute with drafts in flight) and an abort phase, tokens equal to
  an ample stock engine's. Compactions and relayouts are forced (``ula_arena_force_moves``).
- Qwen3-Next with its own MTP layer (2 drafts): GDN state holds 1+k slots per request (pages
  sized for the widened conv state), the MTP layer's full-attention KV joins the target's
  full-attention kind; bf16 (vLLM's CPU GDN kernels), so both sides run the same schedule
  (the engine core in the script's process, every request queued before the first step, no
  preemption), with forced moves and an abort; every counter must equal stock's.
- GPT-OSS at TP=2 with n-gram drafts: one plan on both ranks, token-exact against stock TP=2.
- Methods the arena does not run are refused in the running front end, naming the fix.
Drafts were proposed and some rejected in every run (acceptance strictly between 0 and 1), so
the rollback path (counter rollback, rejected rows rewritten in place, GDN slot choice) ran.
"""
from __future__ import annotations

import pytest

from ulacache_vllm.engine.arena.sizing import ARENA_BLOCK_SIZE

from _vllm_subprocess import (ABORT_TWO_OF_FOUR, IN_PROCESS, check_aborts, run_at_once,
                              run_side_by_side, run_vllm_script, tp_omp_bind)

pytestmark = pytest.mark.engine  # every test here boots vLLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 2}

SCRIPT = r"""
from vllm import LLM, SamplingParams
kw = dict(ARGS["kw"])
llm = LLM(model=ARGS["model"], dtype=ARGS["dtype"], enforce_eager=True, max_model_len=1024,
          max_num_batched_tokens=1024, seed=0, disable_log_stats=False,
          enable_prefix_caching=False, speculative_config=ARGS["spec"], **kw)
# Prompts of tokens spread over the vocabulary, past the sliding window (128): a sampled
# token often occurs in its context, so n-gram drafts are proposed (mostly rejected; accepted
# where the random model's greedy output repeats itself).
from vllm.inputs import TokensPrompt
import random
rng = random.Random(0)
prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 1024)
                                          for _ in range(ARGS["base"] + 20 * i)])
           for i in range(8)]
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
ula = kw["kv_backend"] == "ulacache"

def spec_counters():
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_") or m.name.startswith("vllm:ulacache_arena_") \
                or m.name == "vllm:num_preemptions":
            v = getattr(m, "value", None)
            out[m.name] = v if v is not None else list(getattr(m, "values", []))
    return out

def diff(a, b):
    return {k: (v - a.get(k, 0) if isinstance(v, (int, float)) else v) for k, v in b.items()}

res = {}
# 1. Same schedule on both sides (the first `same` requests fit the arena at once).
c0 = spec_counters()
n_same = ARGS["same"]
res["same"] = [list(o.outputs[0].token_ids) for o in
               llm.generate(prompts[:n_same], [greedy(40 + 9 * i) for i in range(n_same)])]
c1 = spec_counters()
res["same_counters"] = diff(c0, c1)
# 2. Pressure: every prompt at once, outputs of different lengths.
if ARGS["pressure"]:
    res["main"] = [list(o.outputs[0].token_ids) for o in
                   llm.generate(prompts, [greedy(ARGS["out"] + 13 * (i % 5)) for i in range(8)])]
res["main_counters"] = diff(c1, spec_counters())
res["usage_main"] = llm.collective_rpc("ulacache_usage") if ula else None
# 3. Abort two requests mid-decode; the survivors must still match.
abort_tokens = 48
""" + ABORT_TWO_OF_FOUR + r"""
llm.generate(prompts[:1], greedy(1))
llm.llm_engine.step()  # the in-process core's empty step that frees the last pages
res["usage_end"] = llm.collective_rpc("ulacache_usage") if ula else None
res["counters"] = spec_counters()
emit(res)
"""


def _run(model, backend, dtype, spec, kw, *, same, pressure, base=150, out=60, env=None):
    return run_vllm_script(SCRIPT, args={
        "model": str(model), "dtype": dtype, "spec": spec, "same": same,
        "pressure": pressure, "base": base, "out": out,
        "kw": {"kv_backend": backend, **kw}}, timeout=900, env={**IN_PROCESS, **(env or {})})


def _check_clean(u: dict) -> None:
    assert u["arena_used_bytes"] == 0 and u["arena_live_pages"] == 0, u
    assert u["arena_withheld_bytes"] == 0, u
    assert u["arena_fences_opened"] - u["arena_fences_passed"] <= 1, u


DRAFTS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def _check_drafts(c: dict) -> None:
    """Drafts proposed, some accepted and some rejected: 0 < acceptance < 1."""
    assert c["vllm:spec_decode_num_drafts"] > 0, c
    assert c[DRAFTS] > c[ACCEPTED] > 0, c


def _check_same_acceptance(ula: dict, ref: dict) -> None:
    for k in ("vllm:spec_decode_num_drafts", DRAFTS, ACCEPTED,
              "vllm:spec_decode_num_accepted_tokens_per_pos"):
        assert ula[k] == ref[k], (k, ula, ref)


# Random weights at a small initializer range: the greedy output leans on the last tokens and
# falls into cycles now and then, where drafts (n-gram, or the MTP layer's guess from the next
# token's embedding) are accepted; elsewhere they are rejected.
SMALL_INIT = 0.004
# (model overrides, arena budget under pressure); stock runs with 256 MiB. Both arenas are too
# small for the 8 requests at once: running requests outgrow them and are preempted.
SWA_MODELS = {
    "gpt_oss": (dict(initializer_range=SMALL_INIT), 6 << 20),
    "gemma3": (dict(initializer_range=SMALL_INIT, tie_word_embeddings=False), 4 << 20),
}


def _report(name: str, side: str, c: dict) -> None:
    print(f"{name} {side}: {c['vllm:spec_decode_num_drafts']} drafts, {c[DRAFTS]} draft tokens, "
          f"{c[ACCEPTED]} accepted (rate {c[ACCEPTED] / max(1, c[DRAFTS]):.3f}), per position "
          f"{c['vllm:spec_decode_num_accepted_tokens_per_pos']}, preemptions "
          f"{c['vllm:num_preemptions']}")


@pytest.fixture(scope="module", params=sorted(SWA_MODELS))
def swa_ngram(request, tiny_model):
    overrides, budget = SWA_MODELS[request.param]
    model = tiny_model(request.param, **overrides)
    ula, ref = run_side_by_side(
        lambda bind: _run(model, "ulacache", "float32", NGRAM,
                          dict(max_num_seqs=8, kv_cache_memory_bytes=budget,
                               ula_arena_force_moves=3), same=2, pressure=True, env=bind),
        lambda bind: _run(model, "vllm", "float32", NGRAM,
                          dict(max_num_seqs=8, kv_cache_memory_bytes=256 << 20), same=2,
                          pressure=True, env=bind), in_process=True)
    return request.param, ref, ula


def test_sliding_window_ngram_parity_under_pressure(swa_ngram):
    name, ref, ula = swa_ngram
    _report(name, "stock", ref["counters"])
    _report(name, "ulacache", ula["counters"])
    assert ula["same"] == ref["same"], name
    assert ula["main"] == ref["main"], name
    check_aborts(ref)
    check_aborts(ula, ref)
    # Same schedule: the same drafts proposed and accepted, position by position.
    assert ref["same_counters"]["vllm:spec_decode_num_drafts"] > 0, ref["same_counters"]
    _check_same_acceptance(ula["same_counters"], ref["same_counters"])
    # Over the whole run (pressure: preempted with drafts in flight, pages moved): drafts
    # proposed, some accepted, some rejected, on both sides.
    m = ula["counters"]
    _check_drafts(ref["counters"])
    _check_drafts(m)
    assert m["vllm:num_preemptions"] > 0, m
    assert ref["counters"]["vllm:num_preemptions"] == 0, ref["counters"]
    assert m["vllm:ulacache_arena_compactions"] > 0 and m["vllm:ulacache_arena_relayouts"] > 0, m
    assert m["vllm:ulacache_arena_pages_moved"] > 0, m
    assert set(ula["usage_main"][0]["kinds"]) == {"sliding", "full"}, ula["usage_main"]
    _check_clean(ula["usage_end"][0])


@pytest.fixture(scope="module")
def qwen3_next_mtp(tiny_model):
    model = tiny_model("qwen3_next", num_nextn_predict_layers=1, initializer_range=SMALL_INIT)
    same = dict(max_num_seqs=4)
    ula, ref = run_side_by_side(
        lambda bind: _run(model, "ulacache", "bfloat16", MTP,
                          dict(same, kv_cache_memory_bytes=24 << 20, ula_arena_force_moves=2),
                          same=4, pressure=False, env=bind),
        lambda bind: _run(model, "vllm", "bfloat16", MTP,
                          dict(same, kv_cache_memory_bytes=256 << 20), same=4, pressure=False,
                          env=bind), in_process=True)
    return ref, ula


def test_qwen3_next_mtp_same_schedule_parity_with_forced_moves(qwen3_next_mtp):
    ref, ula = qwen3_next_mtp
    _report("qwen3_next mtp", "stock", ref["counters"])
    _report("qwen3_next mtp", "ulacache", ula["counters"])
    assert ula["same"] == ref["same"]
    check_aborts(ref)
    check_aborts(ula, ref)
    _check_drafts(ref["counters"])
    _check_same_acceptance(ula["counters"], ref["counters"])
    m = ula["counters"]
    assert m["vllm:num_preemptions"] == 0 == ref["counters"]["vllm:num_preemptions"]
    assert m["vllm:ulacache_arena_compactions"] > 0 and m["vllm:ulacache_arena_relayouts"] > 0, m
    assert m["vllm:ulacache_arena_pages_moved"] > 0, m
    u = ula["usage_main"][0]
    # The MTP layer's KV is one more full-attention layer of the target's kind; the state
    # kind's page holds the conv state widened by the 2 drafts.
    assert set(u["kinds"]) == {"state", "full"}, u
    assert u["kinds"]["full"]["layers"] == 2, u
    # The arena's attention page stays its default with the MTP drafter loaded (the drafter's
    # config copy once reset it to the CPU build's 128: sizing.prepare).
    assert u["kinds"]["full"]["block_size"] == ARENA_BLOCK_SIZE, u
    assert u["kinds"]["state"]["pages_per_request"] == 1 + MTP["num_speculative_tokens"], u
    _check_clean(ula["usage_end"][0])


TP_SCRIPT = r"""
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
import random
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_batched_tokens=1024, enable_prefix_caching=False, seed=0, max_num_seqs=6,
          tensor_parallel_size=2, disable_log_stats=False, speculative_config=ARGS["spec"],
          **ARGS["kw"])
rng = random.Random(1)
prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 1024) for _ in range(150 + 30 * i)])
           for i in range(6)]
outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=60 + 11 * i,
                                             ignore_eos=True) for i in range(6)])
res = {"main": [list(o.outputs[0].token_ids) for o in outs]}
ula = ARGS["kw"]["kv_backend"] == "ulacache"
res["usage_main"] = llm.collective_rpc("ulacache_usage") if ula else None
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))
llm.llm_engine.step()
res["usage_end"] = llm.collective_rpc("ulacache_usage") if ula else None
res["counters"] = {m.name: getattr(m, "value", None) if getattr(m, "value", None) is not None
                   else list(getattr(m, "values", [])) for m in llm.get_metrics()
                   if m.name.startswith(("vllm:spec_decode_", "vllm:ulacache_arena_"))
                   or m.name == "vllm:num_preemptions"}
emit(res)
"""


def test_tensor_parallel_2_arena_ngram_parity_with_forced_moves(tiny_model):
    """Gemma 3 at TP=2 with n-gram drafts: one step plan (vids, granules, copies) on both
    ranks' arenas, token-exact against stock TP=2 with the same drafts accepted."""
    overrides, _ = SWA_MODELS["gemma3"]
    model = str(tiny_model("gemma3", **overrides))
    env = {**tp_omp_bind(2), **IN_PROCESS}
    ula, ref = run_at_once(  # (both at once: their start-ups overlap)
        lambda: run_vllm_script(TP_SCRIPT, args={"model": model, "spec": NGRAM, "kw": {
            "kv_backend": "ulacache", "kv_cache_memory_bytes": 16 << 20,
            "ula_arena_force_moves": 2}}, timeout=900, env=env),
        lambda: run_vllm_script(TP_SCRIPT, args={"model": model, "spec": NGRAM, "kw": {
            "kv_backend": "vllm", "kv_cache_memory_bytes": 128 << 20}}, timeout=900, env=env))
    _report("gemma3 tp2", "stock", ref["counters"])
    _report("gemma3 tp2", "ulacache", ula["counters"])
    assert ula["main"] == ref["main"]
    _check_drafts(ref["counters"])
    _check_same_acceptance(ula["counters"], ref["counters"])
    assert ula["counters"]["vllm:num_preemptions"] == 0 == ref["counters"]["vllm:num_preemptions"]
    ranks = ula["usage_main"]
    assert len(ranks) == 2, ranks
    for u in ranks:
        assert u["worker"]["bytes_copied"] == u["arena_bytes_copied"] > 0, u
        assert u["arena_compactions"] > 0 and u["arena_relayouts"] > 0, u
        assert set(u["kinds"]) == {"sliding", "full"}, u
    assert ranks[0]["worker"] == ranks[1]["worker"]
    for u in ula["usage_end"]:
        _check_clean(u)
