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
  pressure with unchanged tokens; aborts; after `reset_prefix_cache()` only the null page is
  live.
- Qwen3-Next (GDN state in vLLM's "align" mode) in bf16: the same schedule and hit lengths on
  both sides (see ``QWEN_SCRIPT``), token-exact, equal hits at the same KV memory (a sibling
  prompt included: issue 45), cached pages moved and evicted.
"""
from __future__ import annotations

import pytest

from _vllm_subprocess import (ABORT_TWO_OF_FOUR, EMIT_WITH_METRICS, check_aborts,
                              run_side_by_side, run_vllm_script)

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
# Siblings (issue 45): a new head with one tail, then the same head with another tail. The
# second hits the first's full-attention pages only with a window tail where the head ends:
# stock at 32-token blocks keeps the window only at the first prompt's own last boundary
# (the junction is learnt from the second, for a third); the arena keeps it a few pages wider.
sib = text(46, ARGS["head"] + 20)  # (words no earlier prompt starts with)
run("sibling1", [sib + " " + tails[1]], ARGS["out"])
run("sibling2", [sib + " " + tails[2]], ARGS["out"])
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


# name: (model overrides, arena budget, words per head, filler words)
MODELS = {
    "gpt_oss": (dict(initializer_range=0.1), 6 << 20),
    "gemma3": (dict(initializer_range=0.1, tie_word_embeddings=False), 7 << 19),
}


def _run(model, backend: str, kw: dict, env: dict):
    args = {"model": str(model), "backend": backend, "dtype": "float32", "head": 50,
            "out": 12, "filler": 70, "filler_out": 150, "kw": {"kv_backend": backend, **kw}}
    return run_vllm_script(SCRIPT, args=args, timeout=900, env=env)


@pytest.fixture(scope="module", params=sorted(MODELS))
def swa_runs(request, tiny_model):
    overrides, budget = MODELS[request.param]
    model = tiny_model(request.param, **overrides)
    # Side by side, each engine core in its script's process (``run_side_by_side``).
    ula, ref = run_side_by_side(
        lambda bind: _run(model, "ulacache", dict(max_num_seqs=8, kv_cache_memory_bytes=budget,
                                                  ula_arena_force_moves=2), bind),
        lambda bind: _run(model, "vllm", dict(max_num_seqs=8, kv_cache_memory_bytes=256 << 20),
                          bind), in_process=True)
    return request.param, ref, ula


PHASES = ("prime", "resend", "variants", "variants2", "sibling1", "sibling2", "filler", "after",
          "after_reset")


def test_sliding_window_prefix_caching_parity(swa_runs):
    name, ref, ula = swa_runs
    assert ula["prefix_caching"] is True and ref["prefix_caching"] is True
    for p in PHASES:
        assert ula[p] == ref[p], p
    # Before the pressure phase the arena kept what was hit (an eviction there may drop only
    # pages no later request hits): at least stock's hits, request by request, and in vLLM's
    # counter (more where a prefix variant hits its sibling's window tail, which the arena
    # keeps a few pages wider: ``pools.SIBLING_REACH_TOKENS``).
    for p in ("prime", "resend", "variants", "variants2"):
        assert all(u >= r for u, r in zip(ula[p + "_cached"], ref[p + "_cached"])), \
            (p, ula[p + "_cached"], ref[p + "_cached"])
        assert ula[p + "_hits"] >= ref[p + "_hits"], p
    # The sibling hits its sibling's prefix under the arena, not under stock.
    assert ref["sibling2_cached"] == [0] and ula["sibling2_cached"][0] >= 3 * 32, \
        (ula["sibling2_cached"], ref["sibling2_cached"])
    assert sum(ref["resend_cached"]) > 0 and ref["resend_hits"] > 0, ref
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


# Qwen3-Next (GDN state + full attention) in bf16: vLLM's CPU GDN path is not batch-invariant,
# and stock's attention block B is inflated to hold a state page while the arena's is 32
# tokens. B depends on the host: 640 tokens on the tiny model where vLLM keeps the state in
# float32 (AVX512-BF16 hosts), 384 where it stays bf16 (AVX2 hosts). Both runs read B from
# their engine (the arena: the block it splits prefills at, its computation of stock's).
# Parity needs the same schedule and equal hit lengths: one wave at a time, prompts of token
# ids whose hits end at B on both sides (a B+20-token prompt resent: the replay boundary
# rounds down to B with either block; prefix variants sharing exactly B tokens: their
# junction is at B on both sides).
QWEN_SCRIPT = r"""
import random
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=ARGS["model"], dtype="bfloat16", enforce_eager=True, max_model_len=1024,
          max_num_batched_tokens=2048, enable_chunked_prefill=True, enable_prefix_caching=True,
          seed=0, disable_log_stats=False, max_num_seqs=4, **ARGS["kw"])
ula = ARGS["kw"]["kv_backend"] == "ulacache"
rng = random.Random(0)
vocab = llm.get_tokenizer().vocab_size
ids = lambda n: [rng.randrange(10, vocab - 10) for _ in range(n)]
res = {"block_size": llm.llm_engine.vllm_config.cache_config.block_size,
       "mamba_cache_mode": llm.llm_engine.vllm_config.cache_config.mamba_cache_mode}
if ula:  # the block the arena splits prefills at: stock's, as the arena computes it
    core = llm.llm_engine.engine_core.engine_core  # (in-process)
    res["split_block"] = core.scheduler.kv_cache_manager.prefill_split_block()
B = res["split_block"] if ula else res["block_size"]  # stock's block
assert B % 32 == 0 and 3 * (B + 32) <= 2048 and B + 60 + 40 + 24 <= 1024, B
shared = ids(B)

def metric(name):
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)

def usage():
    return llm.collective_rpc("ulacache_usage")[0] if ula else None

def wave(name, prompts):
    sps = [SamplingParams(temperature=0, max_tokens=24 + 16 * i, ignore_eos=True)
           for i in range(len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps,
                        use_tqdm=False)
    res.setdefault("out", {})[name] = [list(o.outputs[0].token_ids) for o in outs]
    res.setdefault("cached", {})[name] = [o.num_cached_tokens for o in outs]

# Every prompt but the siblings' is B+1..B+32 tokens: its last cacheable boundary (where align
# mode splits the prefill and checkpoints the state) is B with either block size; a wave's
# prompts fit one step, so both sides run the same batches.
first = [shared + ids(20), ids(B + 10), ids(B + 30)]
wave("first", first)
wave("resend", first)  # identical prompts: hits at B
wave("variants", [shared + ids(14 + 5 * i) for i in range(3)])  # B shared tokens
wave("resend2", first[::-1])
# Siblings (issue 45): a new B+60-token prefix with one tail, then with another. The GDN state
# exists only where a prefill chunk ended: stock's B-token blocks end the first prompt's
# prefill at B (its last whole block), where the second hits; the arena's 32-token pages
# would end it at B+96 only, past the B+60 shared tokens, unless it also stops at stock's block.
sib = ids(B + 60)
wave("sibling1", [sib + ids(40)])
wave("sibling2", [sib + ids(30)])
res["hits"] = metric("vllm:prefix_cache_hits")
res["usage_main"] = usage()
# Pressure: new prompts only (no hit on either side), more than the arena's free bytes: cold
# cached pages are evicted, the rest move into the holes.
# Three waves of them: the cached pages outgrow the arena whichever B (and state size) the
# host gives.
for k in range(3):
    wave(f"pressure{k}", [ids(B + 5 + 7 * i) for i in range(4)])
res["usage_pressure"] = usage()
res["reset_ok"] = llm.reset_prefix_cache()
wave("after_reset", first[:1])
llm.reset_prefix_cache()
llm.llm_engine.step()
res["usage_end"] = usage()
""" + EMIT_WITH_METRICS


@pytest.fixture(scope="module")
def qwen_runs(tiny_model):
    model = str(tiny_model("qwen3_next"))
    run = lambda kw: lambda bind: run_vllm_script(
        QWEN_SCRIPT, args={"model": model, "kw": kw}, timeout=900, env=bind)
    # Side by side, each engine core in its script's process; the arena with the same KV
    # memory: ~5 max-length requests, with compactions / relayouts forced every 2 steps. Each
    # builds its prompts from stock's block B: stock from its own, the arena from the block it
    # splits prefills at (its computation of stock's; checked equal).
    ref, ula = run_side_by_side(
        run(dict(kv_backend="vllm", kv_cache_memory_bytes=12 << 20)),
        run(dict(kv_backend="ulacache", kv_cache_memory_bytes=12 << 20,
                 ula_arena_force_moves=2)), in_process=True)
    return ref, ula


def test_qwen3_next_align_mode_prefix_caching_parity(qwen_runs):
    """GDN state through vLLM's "align" mode on both sides (state checkpoints at page
    boundaries; the arena's are 32-token pages of the state's natural size, stock's B-token
    padded blocks, the arena's prefills split at stock's block): bf16 greedy tokens equal
    stock's in every wave, siblings included, the same hit lengths request by request (B
    for resends, prefix variants and a sibling prompt) and the same
    `vllm:prefix_cache_hits`, at the same KV memory; cached pages moved and cold ones evicted
    under pressure; a decoding request's state stays in its page past the prompt."""
    ref, ula = qwen_runs
    assert ula["mamba_cache_mode"] == "align" == ref["mamba_cache_mode"]
    # The arena splits prefills at stock's real block (the prompts of both runs are built
    # from it).
    assert ula["split_block"] == ref["block_size"], (ula["split_block"], ref["block_size"])
    assert ula["block_size"] == 32 and ref["block_size"] > 32, (ula["block_size"],
                                                                 ref["block_size"])
    for name, toks in ref["out"].items():
        assert all(len(set(t[:24])) >= 6 for t in toks), (name, toks)
        # (Token-exact, siblings too: the arena splits a GDN prompt's prefill where stock's
        # B-token blocks do, and bf16 GDN is not invariant to where its chunks end.)
        assert ula["out"][name] == toks, name
    B = ref["block_size"]
    assert ula["cached"] == ref["cached"]
    assert ref["cached"]["resend"] == [B] * 3 and ref["cached"]["variants"] == [B] * 3
    # A sibling prompt hits where stock's coarse state checkpoint lets it (issue 45: the
    # arena checkpoints a prompt's state at stock's block too; it missed before).
    assert ref["cached"]["sibling2"] == [B] == ula["cached"]["sibling2"], ref["cached"]
    assert ula["hits"] == ref["hits"] > 0
    m = ula["metrics"]
    assert m["vllm:num_preemptions"] == 0 == ref["metrics"]["vllm:num_preemptions"]
    assert m["vllm:ulacache_arena_cached_pages_moved"] > 0, m
    assert m["vllm:ulacache_arena_cache_evictions"] > 0, m
    assert set(ula["usage_main"]["kinds"]) == {"state", "full"}
    # Decode past the prompt keeps the running GDN state in its page (relocated to the new
    # 32-token column, no new page or copy; stock's B-token block never moves it there):
    # the outputs above are token-exact with it, under forced compactions and relayouts.
    assert ula["usage_main"]["arena_state_moves_saved"] > 0, ula["usage_main"]
    assert ula["reset_ok"] and ula["cached"]["after_reset"] == [0]
    u = ula["usage_end"]
    assert u["arena_used_bytes"] == 0 and u["arena_live_pages"] == 0, u
    assert u["arena_cached_free_pages"] == 0 and u["arena_withheld_bytes"] == 0, u
