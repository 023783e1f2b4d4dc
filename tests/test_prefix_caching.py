"""Prefix caching under `--kv-backend ulacache` on a DSA model: vLLM's own prefix cache over the
logical pool, whose cached blocks keep their rows in either tier until they leave the cache.
Greedy output with prefix caching on equals stock's with prefix caching on, token for token,
while the device pool is far smaller than the cached prefixes (rows demoted and promoted, hits
read from the host tier), and the prefix cache really hit (counters)."""
from __future__ import annotations

import pytest

from _vllm_subprocess import (IDLE_STEP, REPO_ROOT, mla_path_kwargs, run_side_by_side,
                              run_vllm_script)

BENCH_DIR = REPO_ROOT / "benchmarks"


# ~2.7k device + ~1.3k host slots per layer (fp32 tiny model): a wave of the workload below
# holds ~4.5k tokens of prompts at once, so cached prefixes age to the host and are evicted.
ULA_KV_BYTES = 13_500_000
ULA_HOST_GIB = 0.0055
REF_KV_BYTES = 512 << 20

SCRIPT = IDLE_STEP + r"""
import sys
sys.path.insert(0, ARGS["bench_dir"])
from prefix_cache import export_preempted_stats
export_preempted_stats()  # vLLM's lookups of resumed requests, exported (observation only)
from vllm import LLM, SamplingParams
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_seqs=8, seed=0, disable_log_stats=False, **ARGS["kw"])
words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon").split()
def text(seed, n):
    return " ".join(words[(seed * 7 + j * (seed + 3)) % len(words)] for j in range(n))
prefixes = [text(p, 100 + 15 * p) for p in range(3)]  # three long shared prefixes
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
res = {"waves": []}
def counters():
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries") or \
                m.name.startswith("vllm:ulacache_"):
            out[m.name] = getattr(m, "value", None)
    return out
history = []
for wave in range(3):
    if wave < 2:  # four tails per prefix, other tails each wave
        prompts = [prefixes[p] + " " + text(10 + 4 * wave + t, 12) for p in range(3)
                   for t in range(4)]
    else:  # multi-turn: the first wave's conversations go on
        prompts = [h + " " + text(40 + i, 8) for i, h in enumerate(history[:6])]
    outs = llm.generate(prompts, greedy(24))
    res["waves"].append([o.outputs[0].token_ids for o in outs])
    res.setdefault("cached_tokens", []).append([o.num_cached_tokens for o in outs])
    if wave == 0:
        history = [p + llm.get_tokenizer().decode(o.outputs[0].token_ids)
                   for p, o in zip(prompts, outs)]
res["counters"] = counters()
if ARGS["backend"] == "ulacache":
    res["usage"] = llm.collective_rpc("ulacache_usage")[0]
# Preemption under pressure: eight fresh prompts whose decodes outgrow ulacache's pools (device
# + host), so vLLM preempts; a resumed request looks its own cached blocks up again.
def snap():
    keep = ("vllm:num_preemptions", "vllm:prefix_cache_hits",
            "vllm:ulacache_prefix_hit_entries", "vllm:ulacache_prefix_hit_entries_host")
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()
            if m.name in keep or m.name.startswith("vllm:prefix_cache_preempted_")}
s0 = snap()
# (each opens with its own word pair: no block of theirs was ever cached)
fresh = [f"{words[i]} {words[i + 5]} " + text(60 + i, 80) for i in range(8)]
outs = llm.generate(fresh, greedy(320))
s1 = snap()
res["preempt_wave"] = [o.outputs[0].token_ids for o in outs]
res["preempt"] = {k: (s1[k] or 0) - (s0.get(k) or 0) for k in s1}
if ARGS["backend"] == "ulacache":
    res["reset"] = llm.reset_prefix_cache()
    # One request after the reset (its step carries the frees to the worker); it caches its
    # own full blocks again, and nothing else may hold a row.
    o = llm.generate([prefixes[0]], greedy(1))[0]
    res["after_reset_prompt_len"] = len(o.prompt_token_ids)
    idle_step()
    res["usage_after_reset"] = llm.collective_rpc("ulacache_usage")[0]
emit(res)
"""


def _run(model, backend, env):
    # The reference path's schedule (whole-prompt steps, block 16) with prefix caching on.
    kw = {"kv_backend": backend, **mla_path_kwargs("reference"), "enable_prefix_caching": True}
    if backend == "ulacache":
        kw.update(kv_cache_memory_bytes=ULA_KV_BYTES, ula_host_pool_gib=ULA_HOST_GIB)
    else:
        kw.update(kv_cache_memory_bytes=REF_KV_BYTES)
    args = {"model": str(model), "kw": kw, "backend": backend, "bench_dir": str(BENCH_DIR)}
    return run_vllm_script(SCRIPT, args=args,
                           timeout=900, env={"ULACACHE_PBLRU_SMALL_POOL_SLOTS": "0", **env})


@pytest.fixture(scope="module")
def runs(tiny_model):
    model = tiny_model("deepseek_v32")
    ula, ref = run_side_by_side(lambda bind: _run(model, "ulacache", bind),
                                lambda bind: _run(model, "vllm", bind), in_process=True)
    return ula, ref


@pytest.mark.engine
def test_prefix_cached_output_equals_stock_under_pressure(runs):
    ula, ref = runs
    for w, (a, b) in enumerate(zip(ula["waves"], ref["waves"])):
        assert a == b, f"wave {w}"
    c = ula["counters"]
    # The prefix cache hit, on both sides, and the tiers moved rows while it did.
    assert c["vllm:prefix_cache_hits"] > 0, c
    assert ref["counters"]["vllm:prefix_cache_hits"] > 0, ref["counters"]
    assert c["vllm:ulacache_demotions"] > 0 and c["vllm:ulacache_promotions"] > 0, c
    assert any(n > 0 for n in ula["cached_tokens"][1]), ula["cached_tokens"]
    # Some hits took over rows that sat in the host tier (the device pool holds less than the
    # cached prefixes), read from there by attention.
    t = ula["usage"]["totals"]
    assert t["prefix_hit_entries"] > t["prefix_hit_entries_host"] > 0, t
    assert c["vllm:ulacache_prefix_hit_entries_host"] == t["prefix_hit_entries_host"], (c, t)
    # vLLM's hit metrics keep working under ulacache: the same queries as stock, and the hit
    # tokens on /metrics are the requests' own num_cached_tokens, on both sides.
    assert c["vllm:prefix_cache_queries"] == ref["counters"]["vllm:prefix_cache_queries"]
    for side in (ula, ref):
        hits = side["counters"]["vllm:prefix_cache_hits"]
        assert hits == sum(map(sum, side["cached_tokens"])), (hits, side["cached_tokens"])


@pytest.mark.engine
def test_preempted_requests_resume_through_their_cached_blocks(runs):
    ula, ref = runs
    assert ula["preempt_wave"] == ref["preempt_wave"]
    p = ula["preempt"]
    # vLLM preempted under pressure (stock, with room to spare, did not) ...
    assert p["vllm:num_preemptions"] > 0, p
    assert ref["preempt"]["vllm:num_preemptions"] == 0, ref["preempt"]
    # ... the prompts are fresh (no first-admission hits), and the resumed requests' lookups
    # hit their own cached blocks, which the worker took over with their rows in either tier.
    assert p["vllm:prefix_cache_hits"] == 0, p
    assert p["vllm:prefix_cache_preempted_requests"] > 0, p
    assert 0 < p["vllm:prefix_cache_preempted_hits"] < p["vllm:prefix_cache_preempted_queries"], p
    assert p["vllm:ulacache_prefix_hit_entries"] > 0, p


@pytest.mark.engine
def test_reset_prefix_cache_frees_every_cached_row(runs):
    ula, _ = runs
    assert ula["reset"] is True
    u = ula["usage_after_reset"]
    # Every row cached before the reset is gone; only the last request's full blocks (cached
    # again) hold rows, in each layer group.
    groups = len(u["victim_paths"])
    assert u["block_size"] == 16
    kept = ula["after_reset_prompt_len"] // 16 * 16
    assert u["device_used"] + u["host_used"] == groups * kept, (u, kept)



OFFLOAD = r"""
import ulacache_vllm.patches.apply as patches
patches.apply_all()
from vllm.engine.arg_utils import EngineArgs
from vllm.usage.usage_lib import UsageContext
out = {}
for backend in ("vllm", "ulacache"):
    ea = EngineArgs(model=ARGS["model"], max_model_len=1024, enforce_eager=True,
                    kv_backend=backend, kv_offloading_size=0.5)
    try:
        c = ea.create_engine_config(UsageContext.LLM_CLASS)
        out[backend] = "ok: " + str(c.kv_transfer_config.kv_connector)
    except Exception as e:
        out[backend] = f"{type(e).__name__}: {e}"
emit(out)
"""


def test_kv_offloading_size_is_refused_naming_the_host_pool(tiny_model):
    # Resolved at config time, no engine boot: stock takes the flag (vLLM's offloading
    # connector), ulacache refuses it before vLLM swaps its connector out.
    res = run_vllm_script(OFFLOAD, args={"model": str(tiny_model("deepseek_v32"))},
                          timeout=300, boots_engine=False)
    assert res["vllm"] == "ok: OffloadingConnector", res
    msg = res["ulacache"]
    assert msg.startswith("KVBackendError: --kv-backend ulacache cannot be combined with "
                          "--kv-offloading-size 0.5"), msg
    assert "host tier" in msg and "--ula-host-pool-gib instead" in msg, msg
