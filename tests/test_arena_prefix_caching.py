"""Prefix caching under the arena (hybrid models), against stock vLLM with prefix caching on.

Both sides run the same prompts with prefix caching on, 32-token attention pages (stock
`block_size=32`, the arena's page) and vLLM's default retention, so their managers make the
same hashing and hit decisions: phases of distinct prompts, identical resends (replay hits)
and prefix variants, then a pressure phase (the arena too small: preemptions and cache
evictions), aborts, and `reset_prefix_cache()`.

- GPT-OSS and Gemma 3 (sliding window + full attention) in float32: token-exact output in
  every phase; per-request `num_cached_tokens` and `vllm:prefix_cache_hits` equal to stock's
  (> 0) before the pressure phase; cached pages moved by the forced compactions/relayouts
  (`vllm:ulacache_arena_cached_pages_moved` > 0); cache evictions and preemptions > 0 under
  pressure with unchanged tokens; after `reset_prefix_cache()` only the null page is live.
"""
from __future__ import annotations

import pytest

from _vllm_subprocess import ABORT_TWO_OF_FOUR, EMIT_WITH_METRICS, check_aborts, run_vllm_script

pytestmark = pytest.mark.engine  # every test here boots vLLM

SCRIPT = r"""
from vllm import LLM, SamplingParams
kw = dict(ARGS["kw"])
llm = LLM(model=ARGS["model"], dtype=ARGS["dtype"], enforce_eager=True, max_model_len=1024,
          max_num_batched_tokens=1024, enable_chunked_prefill=True, enable_prefix_caching=True,
          block_size=32, seed=0, disable_log_stats=False, **kw)
words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon").split()
text = lambda s, n: " ".join(words[(s * 7 + j * (s + 3)) % len(words)] for j in range(n))
heads = [text(i, ARGS["head"] + 9 * i) for i in range(3)]
tails = [text(10 + j, 5 + 4 * j) for j in range(4)]
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
ula = ARGS["backend"] == "ulacache"
res = {"prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching}

def metric(name):
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)

def usage():
    return llm.collective_rpc("ulacache_usage")[0] if ula else None

def run(name, prompts, out):
    sps = [greedy(out + 7 * (i % 3)) for i in range(len(prompts))]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    res[name] = [list(o.outputs[0].token_ids) for o in outs]
    res[name + "_cached"] = [o.num_cached_tokens for o in outs]
    res[name + "_hits"] = metric("vllm:prefix_cache_hits")

prime = [h + " " + tails[0] for h in heads]
run("prime", prime, ARGS["out"])
run("resend", prime, ARGS["out"])  # identical prompts: replay-boundary hits
variants = [h + " " + t for h in heads for t in tails[1:]]
run("variants", variants, ARGS["out"])
run("variants2", variants[::-1], ARGS["out"])
res["usage_hits"] = usage()
# Pressure: long distinct prompts and outputs (the arena is too small for them at once).
filler = [text(20 + i, ARGS["filler"] + 11 * i) for i in range(8)]
tok = llm.get_tokenizer()
res["lens"] = {k: [len(tok.encode(p)) for p in v]
               for k, v in (("prime", prime), ("variants", variants), ("filler", filler))}
run("filler", filler, ARGS["filler_out"])
run("after", prime + variants[:3], ARGS["out"])
res["usage_pressure"] = usage()
prompts = filler
abort_tokens = 24
""" + ABORT_TWO_OF_FOUR + r"""
res["reset_ok"] = llm.reset_prefix_cache()
run("after_reset", prime[:1], 4)  # nothing to hit
res["reset_ok2"] = llm.reset_prefix_cache()
llm.llm_engine.step()  # (in-process core) the empty step that ships the freed figures
res["usage_end"] = usage()
res["hits_total"] = metric("vllm:prefix_cache_hits")
""" + EMIT_WITH_METRICS

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# name: (model overrides, arena budget, words per head, filler words)
MODELS = {
    "gpt_oss": (dict(initializer_range=0.1), 6 << 20),
    "gemma3": (dict(initializer_range=0.1, tie_word_embeddings=False), 4 << 20),
}


def _run(model, backend: str, kw: dict):
    args = {"model": str(model), "backend": backend, "dtype": "float32", "head": 50,
            "out": 12, "filler": 70, "filler_out": 150, "kw": {"kv_backend": backend, **kw}}
    return run_vllm_script(SCRIPT, args=args, timeout=900, env=IN_PROCESS)


@pytest.fixture(scope="module", params=sorted(MODELS))
def swa_runs(request, tiny_model):
    overrides, budget = MODELS[request.param]
    model = tiny_model(request.param, **overrides)
    ula = _run(model, "ulacache", dict(max_num_seqs=8, kv_cache_memory_bytes=budget,
                                       ula_arena_force_moves=2))
    ref = _run(model, "vllm", dict(max_num_seqs=8, kv_cache_memory_bytes=256 << 20))
    return request.param, ref, ula


PHASES = ("prime", "resend", "variants", "variants2", "filler", "after", "after_reset")


def test_sliding_window_prefix_caching_parity(swa_runs):
    name, ref, ula = swa_runs
    assert ula["prefix_caching"] is True and ref["prefix_caching"] is True
    for p in PHASES:
        assert ula[p] == ref[p], p
    # Before the pressure phase nothing was evicted on either side: the same hits, request
    # by request, and in vLLM's counter.
    for p in ("prime", "resend", "variants", "variants2"):
        assert ula[p + "_cached"] == ref[p + "_cached"], p
        assert ula[p + "_hits"] == ref[p + "_hits"], p
    assert sum(ref["resend_cached"]) > 0 and ref["resend_hits"] > 0, ref
    assert ula["usage_hits"]["arena_cache_evictions"] == 0, ula["usage_hits"]
    m = ula["metrics"]
    # Cached pages moved by the forced compactions / relayouts, their copies in the plans.
    assert m["vllm:ulacache_arena_cached_pages_moved"] > 0, m
    assert m["vllm:ulacache_arena_bytes_copied"] > 0, m
    # Pressure: the arena evicted cold cached pages to make room, and preempted.
    assert m["vllm:ulacache_arena_cache_evictions"] > 0, m
    assert m["vllm:num_preemptions"] > 0, m
    check_aborts(ref)
    check_aborts(ula, ref)
    assert ula["after_reset_cached"] == [0] == ref["after_reset_cached"]
    assert ula["reset_ok"] and ula["reset_ok2"] and ref["reset_ok"]
    u = ula["usage_end"]
    assert u["arena_used_bytes"] == 0 and u["arena_live_pages"] == 0, u
    assert u["arena_cached_free_pages"] == 0 and u["arena_withheld_bytes"] == 0, u
    assert u["arena_free_bytes"] + u["kinds_null_bytes"] == u["arena_total_bytes"], u
