"""`--kv-backend ulacache` in the real engine: token-exact parity with stock vLLM under forced
memory pressure (the host tier really used: demotions and promotions > 0), aborts and
preemptions leave no slot behind, for the tiny DeepSeek-V3.2 and GLM DSA models."""
from __future__ import annotations

import pytest

from _vllm_subprocess import (ABORT_TWO_OF_FOUR, EMIT_WITH_METRICS, host_mla_path,
                              mla_path_kwargs, run_vllm_script)

pytestmark = pytest.mark.engine  # every test here boots vLLM

# Tight ulacache budget: ~2.7k device slots + ~1.3k host slots per layer (fp32 tiny model),
# well below the ~5k tokens the workload below needs at once -> spills, fetches, preemptions.
ULA_KV_BYTES = 13_500_000
ULA_HOST_GIB = 0.0055
REF_KV_BYTES = 512 << 20

SCRIPT = r"""
from vllm import LLM, SamplingParams
kw = dict(ARGS["kw"])
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_seqs=8, seed=0, disable_log_stats=False, **kw)
words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon").split()
prompts = [" ".join(words[(i * 7 + j * (i + 3)) % len(words)] for j in range(60 + 20 * i))
           for i in range(8)]
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
res = {}
res["main"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))]
res["prompt_lens"] = [len(o.prompt_token_ids) for o in llm.generate(prompts, greedy(1))]

def usage():
    if ARGS["backend"] != "ulacache":
        return None
    ranks = llm.collective_rpc("ulacache_usage")
    return ranks[0] if len(ranks) == 1 else ranks

# Abort two requests mid-decode; the survivors must still match the reference.
abort_tokens = 64
""" + ABORT_TWO_OF_FOUR + r"""res["abort_survivors"] = {k: v for k, v in done.items() if k in ("a1", "a3")}
res["aborted_finished"] = sorted(k for k in done if k in ("a0", "a2"))
res["usage_after_abort"] = usage()

# Long outputs for all prompts at once: decode growth exceeds the logical capacity.
res["long"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(200))]
res["usage_end"] = usage()
""" + EMIT_WITH_METRICS


def _run(model, backend, path, trace_path=None, env=None, lru=None):
    kw = {"kv_backend": backend, **mla_path_kwargs(path)}
    if backend == "ulacache":
        kw.update(kv_cache_memory_bytes=ULA_KV_BYTES, ula_host_pool_gib=ULA_HOST_GIB,
                  ula_trace_path=str(trace_path))
        if lru:
            kw["ula_lru"] = lru
    else:
        kw.update(kv_cache_memory_bytes=REF_KV_BYTES)
    return run_vllm_script(SCRIPT, args={"model": str(model), "kw": kw, "backend": backend},
                           timeout=900, env=env)


# DeepSeek runs both of vLLM's CPU MLA paths pinned (the same schedules on every host: the AMX
# path's chunked prefill, prefix caching in stock and a default batch ulacache must lower; the
# reference path's whole-prompt steps); GLM runs whichever path this host takes by default.
PATHS = [("deepseek_v32", "amx"), ("deepseek_v32", "reference"), ("glm_dsa", "host")]


@pytest.fixture(scope="module", params=PATHS, ids=[f"{m}-{p}" for m, p in PATHS])
def runs(request, tiny_model, tmp_path_factory):
    name, path = request.param
    model = tiny_model(name)
    trace = tmp_path_factory.mktemp("trace") / "selections.jsonl"
    # DeepSeek runs the default PB-LRU's round labels at every pool size (the ~2.7k-slot pools
    # here are below the small-pool threshold, whose timestamp scan test_model_shapes runs),
    # GLM the exact LRU (`--ula-lru exact_ts`): every victim search meets the real engine.
    env = {"ULACACHE_PBLRU_SMALL_POOL_SLOTS": "0"}
    ula = _run(model, "ulacache", path, trace, env, "exact_ts" if name == "glm_dsa" else None)
    ula["trace_path"] = str(trace)
    ula["path"] = host_mla_path() if path == "host" else path
    return name, _run(model, "vllm", path), ula


def test_prompts_exceed_index_topk(runs):
    _, ref, _ = runs
    assert min(ref["prompt_lens"]) > 200  # several hundred tokens, far above index_topk


def test_token_exact_parity_under_pressure(runs):
    name, ref, ula = runs
    assert ula["main"] == ref["main"], name
    assert ula["long"] == ref["long"], name
    m = ula["metrics"]
    # The new path really ran: rows spilled to the host and were fetched back.
    assert m["vllm:ulacache_demotions"] > 0 and m["vllm:ulacache_promotions"] > 0, m
    assert m["vllm:ulacache_lookups"] > m["vllm:ulacache_hits"] > 0, m
    assert m["vllm:ulacache_bytes_moved"] > 0, m
    want = "exact_ts" if name == "glm_dsa" else "rounds"  # see the ``runs`` fixture
    assert set(ula["usage_end"]["victim_paths"]) == {want}, ula["usage_end"]
    # It started in identity placement and left it when the device pool overflowed.
    assert m["vllm:ulacache_fast_path_exits"] >= 1, m
    if ula["path"] == "amx":
        # The AMX path's default step (LLM class: max_num_batched_tokens 4096, chunked
        # prefill) does not fit this device pool; ulacache started by lowering the defaulted
        # batch to what the pool holds.
        u = ula["usage_end"]
        assert u["device_capacity"] // len(u["victim_paths"]) < 4096 + 16, u  # index_topk 16
        assert u["batch_tokens_lowered"][0] == 4096, u
        assert u["batch_tokens_lowered"][1] + 16 <= u["device_capacity"] // 2, u
    else:
        assert ula["usage_end"]["batch_tokens_lowered"] is None, ula["usage_end"]
    assert ula["usage_end"]["block_size"] == {"amx": 128, "reference": 16}[ula["path"]]


def test_abort_frees_everything_and_survivors_match(runs):
    _, ref, ula = runs
    assert ula["aborted_finished"] == [] or set(ula["aborted_finished"]) <= {"a0", "a2"}
    assert ula["abort_survivors"] == ref["abort_survivors"]
    assert set(ref["abort_survivors"]) == {"a1", "a3"}
    for key in ("usage_after_abort", "usage_end"):
        u = ula[key]
        assert u["device_used"] == 0 and u["host_used"] == 0, (key, u)


def test_preemption_under_pressure_matches_reference(runs):
    _, ref, ula = runs
    assert ula["metrics"]["vllm:num_preemptions"] > 0, ula["metrics"]
    assert ula["long"] == ref["long"]


def test_recorded_trace_replays_through_the_core(runs):
    """The opt-in trace holds the engine's appends, selections and frees, and the core
    benchmark's loader/replayer drives a mapping table through it without a capacity error."""
    import torch

    from ulacache_vllm.core.mapping import TieredMapping
    from lab.trace import load_trace, replay

    _, _, ula = runs
    trace = load_trace(ula["trace_path"])
    kinds = {"append": 0, "select": 0, "free": 0}
    for st in trace.steps:
        kinds["append"] += st.append_addr.numel()
        kinds["select"] += st.select_addr.numel()
        kinds["free"] += st.free_addr.numel()
    assert all(v > 0 for v in kinds.values()), kinds
    groups = sorted({st.group for st in trace.steps})
    assert groups == [0, 1]  # one layer group per DSA layer of the tiny model
    usage = ula["usage_end"]
    dev, host = usage["device_capacity"] // 2, usage["host_capacity"] // 2
    maps = {g: TieredMapping(trace.num_logical, dev, host) for g in groups}
    replay(trace, maps)
    assert sum(m.stats.promotions for m in maps.values()) > 0
    # Everything the engine appended was freed again by the end of the run.
    assert all(m.device_used == 0 and m.host_used == 0 for m in maps.values())
    assert torch.is_tensor(trace.steps[0].append_addr)


MTP_SCRIPT = r"""
from vllm import LLM, SamplingParams
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_seqs=8, seed=0, disable_log_stats=False,
          speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **ARGS["kw"])
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
prompts = [" ".join(words[(i * 3 + j) % 10] for j in range(60 + 20 * i)) for i in range(8)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()
     if x.name.startswith("vllm:ulacache_") or x.name == "vllm:spec_decode_num_drafts"}
paths = llm.collective_rpc("ulacache_usage")[0]["victim_paths"] if ARGS["kw"]["kv_backend"] == "ulacache" else None
emit({"out": [o.outputs[0].token_ids for o in outs], "metrics": m, "victim_paths": paths})
"""


def test_mtp_speculative_decoding_parity_under_pressure(tiny_model):
    """DeepSeek-V3.2 with one MTP layer (its own sparse-MLA layer group): greedy speculative
    decoding gives the same tokens with ulacache under pressure as stock vLLM (the draft layer's
    writes are the contract's one in-forward assignment), with the round-label PB-LRU's own
    search."""
    model = str(tiny_model("deepseek_v32", num_nextn_predict_layers=1))
    ref = run_vllm_script(MTP_SCRIPT, args={"model": model, "kw": {
        "kv_backend": "vllm", "kv_cache_memory_bytes": REF_KV_BYTES}}, timeout=900)
    ula = run_vllm_script(MTP_SCRIPT, args={"model": model, "kw": {
        "kv_backend": "ulacache", "kv_cache_memory_bytes": 18_000_000,
        "ula_host_pool_gib": 0.008}}, timeout=900,
        env={"ULACACHE_PBLRU_SMALL_POOL_SLOTS": "0"})
    assert ula["out"] == ref["out"]
    assert set(ula["victim_paths"]) == {"rounds"}, ula["victim_paths"]
    m = ula["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0, m
    assert m["vllm:ulacache_promotions"] > 0 and m["vllm:ulacache_demotions"] > 0, m


TP_SCRIPT = r"""
from vllm import LLM, SamplingParams
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_seqs=8, seed=0, tensor_parallel_size=2, disable_log_stats=False, **ARGS["kw"])
words = "one two three four five six seven eight nine ten eleven twelve".split()
# Two short requests first: they fit one rank's device pool (TP shard mode keeps replicas).
small = llm.generate([" ".join(words[(j * 7 + i) % 12] for j in range(30)) for i in range(2)],
                     SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
small_usage = llm.collective_rpc("ulacache_usage") if ARGS["kw"]["kv_backend"] == "ulacache" else None
# ~3.3k prompt tokens + 8 x 128 decoded: more than the ~2.7k-slot device pool holds.
prompts = [" ".join(words[(i * 5 + j * (i + 2)) % len(words)] for j in range(120 + 40 * i))
           for i in range(8)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()
     if x.name.startswith("vllm:ulacache_")}
usage = llm.collective_rpc("ulacache_usage") if ARGS["kw"]["kv_backend"] == "ulacache" else None
emit({"out": [o.outputs[0].token_ids for o in outs], "metrics": m, "usage": usage,
      "small": [o.outputs[0].token_ids for o in small], "small_usage": small_usage})
"""


TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# Per-rank KV budget of the shard runs: ~1.2k local device slots per rank (2.4k over both),
# well below the ~4.3k tokens the run holds at its peak.
ULA_SHARD_KV_BYTES = 6_500_000


@pytest.fixture(scope="module")
def stock_tp2(tiny_model):
    """Stock vLLM at TP=2 per model (the reference of both TP modes), run once."""
    cache = {}

    def get(name):
        if name not in cache:
            model = str(tiny_model(name))
            cache[name] = (model, run_vllm_script(TP_SCRIPT, args={"model": model, "kw": {
                "kv_backend": "vllm", "kv_cache_memory_bytes": REF_KV_BYTES}}, timeout=900,
                env=TP_ENV))
        return cache[name]
    return get


def test_tensor_parallel_2_replicate_parity_under_pressure(stock_tp2):
    """``--ula-tp-mode replicate``: each TP rank keeps its own store of the (replicated, as in
    stock vLLM) MLA rows and makes the same placement decisions; greedy output matches stock
    TP=2 with the host tier in use, and every rank ends with its pools empty."""
    model, ref = stock_tp2("deepseek_v32")
    ula = run_vllm_script(TP_SCRIPT, args={"model": model, "kw": {
        "kv_backend": "ulacache", "kv_cache_memory_bytes": ULA_KV_BYTES,
        "ula_host_pool_gib": ULA_HOST_GIB, "ula_tp_mode": "replicate"}}, timeout=900,
        env=TP_ENV)
    assert ula["out"] == ref["out"]
    m = ula["metrics"]
    assert m["vllm:ulacache_demotions"] > 0 and m["vllm:ulacache_promotions"] > 0, m
    assert len(ula["usage"]) == 2, ula["usage"]  # one store per TP rank
    for u in ula["usage"]:
        assert u["device_used"] == 0 and u["host_used"] == 0, u
        assert u["tp_mode"] == "replicate" and u["totals"]["remote_rows_fetched"] == 0, u
    # Replicas: both ranks made the same moves; /metrics sums every rank's.
    t0, t1 = (u["totals"] for u in ula["usage"])
    assert t0 == t1
    assert m["vllm:ulacache_promotions"] == 2 * t0["promotions"], (m, t0)
    assert m["vllm:ulacache_demotions"] == 2 * t0["demotions"], (m, t0)


# GLM DSA takes the same sharded path (its TP=1 runs are in ``runs``); one model keeps the
# suite's TP=2 boots down.
@pytest.mark.parametrize("name", ["deepseek_v32"])
def test_tensor_parallel_2_shard_parity_under_pressure(stock_tp2, name):
    """``--ula-tp-mode shard`` (the default): token t's MLA row and indexer key live on rank
    t mod 2 only. Greedy output equals stock TP=2 under pressure; on every rank rows were
    demoted, promoted, fetched from the other rank and served from the remote-row buffer;
    the ranks hold different rows (shards); everything is empty at the end."""
    model, ref = stock_tp2(name)
    ula = run_vllm_script(TP_SCRIPT, args={"model": model, "kw": {
        "kv_backend": "ulacache", "kv_cache_memory_bytes": ULA_SHARD_KV_BYTES,
        "ula_host_pool_gib": ULA_HOST_GIB, "ula_tp_lockstep_check": True}}, timeout=900,
        env=TP_ENV)
    assert ula["out"] == ref["out"] and ula["small"] == ref["small"]
    # The short requests ran on replicas (no exchange), the pressure run on shards.
    for u in ula["small_usage"]:
        assert u["totals"]["remote_rows_fetched"] == 0 and u["totals"]["replica_exits"] == 0, u
    assert len(ula["usage"]) == 2, ula["usage"]
    for u in ula["usage"]:
        assert u["tp_mode"] == "shard" and u["totals"]["replica_exits"] >= 1, u
        t = u["totals"]
        assert t["demotions"] > 0 and t["promotions"] > 0, t
        assert t["remote_rows_fetched"] > 0 and t["remote_hits"] > 0, t
        assert u["device_used"] == 0 and u["host_used"] == 0 and u["remote_used"] == 0, u
    assert ula["usage"][0]["totals"] != ula["usage"][1]["totals"]  # shards, not replicas
    m = ula["metrics"]
    # /metrics: every rank's counters summed (reported when pools change, and at least
    # every 32 steps, so the last few steps may not have arrived yet).
    assert 0 < m["vllm:ulacache_remote_rows_fetched"] <= sum(
        u["totals"]["remote_rows_fetched"] for u in ula["usage"]), m
    assert m["vllm:ulacache_promotions"] == sum(u["totals"]["promotions"] for u in ula["usage"])


def test_tensor_parallel_2_shard_aborts_and_preemption(stock_tp2, tiny_model):
    """TP=2 shard mode through the abort and preemption script: aborted requests free their
    rows on both ranks, survivors and preempted-then-resumed requests equal stock TP=2, and
    every pool and remote buffer is empty at the end."""
    model = str(tiny_model("deepseek_v32"))
    tp = {"tensor_parallel_size": 2}
    ref = run_vllm_script(SCRIPT, args={"model": model, "backend": "vllm", "kw": {
        "kv_backend": "vllm", "kv_cache_memory_bytes": REF_KV_BYTES, **tp}}, timeout=900,
        env=TP_ENV)
    # ~1.4k device + ~0.6k host slots per rank: ~4k logical tokens, fewer than the long run.
    ula = run_vllm_script(SCRIPT, args={"model": model, "backend": "ulacache", "kw": {
        "kv_backend": "ulacache", "kv_cache_memory_bytes": 7_600_000,
        "ula_host_pool_gib": 0.0025, **tp}}, timeout=900, env=TP_ENV)
    assert ula["main"] == ref["main"]
    assert ula["abort_survivors"] == ref["abort_survivors"]
    assert set(ref["abort_survivors"]) == {"a1", "a3"}
    assert ula["metrics"]["vllm:num_preemptions"] > 0, ula["metrics"]
    assert ula["long"] == ref["long"]
    for key in ("usage_after_abort", "usage_end"):
        assert len(ula[key]) == 2, ula[key]
        for u in ula[key]:
            assert u["tp_mode"] == "shard", u
            assert u["device_used"] == 0 and u["host_used"] == 0 and u["remote_used"] == 0, (key, u)
    for u in ula["usage_end"]:
        t = u["totals"]
        assert t["demotions"] > 0 and t["promotions"] > 0 and t["remote_rows_fetched"] > 0, t
