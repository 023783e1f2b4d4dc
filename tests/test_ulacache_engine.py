"""`--kv-backend ulacache` in the real engine: token-exact parity with stock vLLM under forced
memory pressure (the host tier really used: demotions and promotions > 0), aborts and
preemptions leave no slot behind, for the tiny DeepSeek-V3.2 and GLM DSA models."""
from __future__ import annotations

import pytest

from _vllm_subprocess import (ABORT_TWO_OF_FOUR, AGREEING_MTP, EMIT_WITH_METRICS, IDLE_STEP,
                              IN_PROCESS, REPEATED_WORD_PROMPTS, SPEC_ACCEPTED, SPEC_DECODE_METRICS,
                              SPEC_DRAFTS, check_aborts, check_drafts_judged_both_ways,
                              host_mla_path, mla_path_kwargs, run_side_by_side, run_vllm_script,
                              tp_omp_bind)

pytestmark = pytest.mark.engine  # every test here boots vLLM

# Tight ulacache budget: ~2.7k device slots + ~1.3k host slots per layer (fp32 tiny model),
# well below the ~5k tokens the workload below needs at once -> spills, fetches, preemptions.
ULA_KV_BYTES = 13_500_000
ULA_HOST_GIB = 0.0055
REF_KV_BYTES = 512 << 20

SCRIPT_LLM = r"""
from vllm import LLM, SamplingParams
kw = dict(ARGS["kw"])
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_seqs=8, seed=0, disable_log_stats=False, **kw)
"""
# The workload (``llm`` in scope; ``ARGS["backend"]``): a 24-token run, two of four requests
# aborted mid-decode, then 200-token outputs for all prompts; leaves ``res`` (with the prefix
# caching setting the engine was built with). The TP=2 tests run it after their own workload
# in the same engine (``TP_SCRIPT``).
SCRIPT_WORKLOAD = IDLE_STEP + r"""words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon").split()
prompts = [" ".join(words[(i * 7 + j * (i + 3)) % len(words)] for j in range(60 + 20 * i))
           for i in range(8)]
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
res = {"prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching}
res["main"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))]
res["prompt_lens"] = [len(o.prompt_token_ids) for o in llm.generate(prompts, greedy(1))]

def usage():
    if ARGS["backend"] != "ulacache":
        return None
    ranks = llm.collective_rpc("ulacache_usage")
    return ranks[0] if len(ranks) == 1 else ranks

def settle():
    # With prefix caching on, the full blocks of finished and aborted requests stay cached,
    # their rows live, until they leave the cache: empty it (both backends: the same schedule
    # after), and let one request too short to fill a block carry the frees to the workers.
    if res["prefix_caching"]:
        res.setdefault("prefix_cache_resets", []).append(llm.reset_prefix_cache())
        llm.generate(["alpha"], greedy(1))
    idle_step()

# Abort two requests mid-decode; the survivors must still match the reference.
abort_tokens = 64
""" + ABORT_TWO_OF_FOUR + r"""settle()
res["usage_after_abort"] = usage()

# Long outputs for all prompts at once: decode growth exceeds the logical capacity.
res["long"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(200))]
settle()
res["usage_end"] = usage()
"""
SCRIPT = SCRIPT_LLM + SCRIPT_WORKLOAD + EMIT_WITH_METRICS


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
    lru = "exact_ts" if name == "glm_dsa" else None
    ula, ref = run_side_by_side(
        lambda bind: _run(model, "ulacache", path, trace, {**env, **bind}, lru),
        lambda bind: _run(model, "vllm", path, env=bind), in_process=True)
    ula["trace_path"] = str(trace)
    ula["path"] = host_mla_path() if path == "host" else path
    return name, ref, ula


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
    # Steps that settled last step's host reads and assigned new rows in one move plan.
    assert ula["usage_end"]["totals"]["merged_plans"] > 0, ula["usage_end"]["totals"]
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
    """Two of four requests aborted mid-decode end short of their length in the client and
    in the engine core (``check_aborts``); the survivors equal stock; every pool is empty
    right after (the aborted requests, far from their length, would still hold rows had the
    core kept them) and at the end (with prefix caching on, once the cache is emptied:
    ``settle`` in the workload)."""
    _, ref, ula = runs
    check_aborts(ref)
    check_aborts(ula, ref)
    assert ula.get("prefix_cache_resets", []) == [True, True] * ula["prefix_caching"], ula
    for key in ("usage_after_abort", "usage_end"):
        u = ula[key]
        assert u["device_used"] == 0 and u["host_used"] == 0, (key, u)


def test_prefix_caching_in_the_running_engine_is_stocks(runs):
    """A DSA model keeps the prefix caching stock gives it (vLLM's own, over the logical pool):
    on the AMX path (asked for) the engine was built with it and its scheduler looked prompts
    up in the prefix cache, on the reference path neither, for ulacache as for stock. So the
    AMX-path runs above (parity, aborts, preemption under pressure) ran with it on."""
    _, ref, ula = runs
    on = ula["path"] == "amx"
    for side, run in (("ulacache", ula), ("stock", ref)):
        assert run["prefix_caching"] is on, (side, run["prefix_caching"])
        assert (run["metrics"]["vllm:prefix_cache_queries"] > 0) is on, (side, run["metrics"])


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


# The MTP and TP=2 runs take the reference MLA path's schedule on every host (block 16, no
# chunked prefill or prefix caching, 2048-token steps), the one their KV budgets and pressure
# assertions were set on: with AMX tiles vLLM would give them block 128, prefix caching and
# chunked prefill with a 4096-token default step that ulacache lowers to its pool.
REFERENCE_PATH = mla_path_kwargs("reference")

MTP_SCRIPT = IDLE_STEP + r"""
from vllm import LLM, SamplingParams
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_seqs=8, seed=0, disable_log_stats=False,
          speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **ARGS["kw"])
words_per_prompt = ARGS["words_per_prompt"]
""" + REPEATED_WORD_PROMPTS + r"""
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
""" + SPEC_DECODE_METRICS + r"""
m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()
     if x.name.startswith("vllm:ulacache_")}
paths = llm.collective_rpc("ulacache_usage")[0]["victim_paths"] if ARGS["kw"]["kv_backend"] == "ulacache" else None
emit({"out": [o.outputs[0].token_ids for o in outs], "metrics": {**m, **spec_metrics},
      "victim_paths": paths, "prompt_lens": [len(o.prompt_token_ids) for o in outs]})
"""
# ~3k prompt tokens, more than the device pool of each of the three layer groups (the target's
# two sparse-MLA layers and the MTP layer) holds: measured ~2.7k demotions, ~530 promotions, and
# 48 of 139 draft tokens accepted.
MTP_WORDS_PER_PROMPT = [200 + 40 * i for i in range(8)]


def test_mtp_speculative_decoding_parity_under_pressure(tiny_model):
    """DeepSeek-V3.2 with one MTP layer (its own sparse-MLA layer group): greedy speculative
    decoding gives the same tokens with ulacache under pressure as stock vLLM (the draft layer's
    writes are the contract's one in-forward assignment), with the round-label PB-LRU's own
    search; the drafts of an MTP layer built to agree (``AGREEING_MTP``) were accepted and
    rejected, the same ones as stock's."""
    model = str(tiny_model("deepseek_v32", **AGREEING_MTP))
    args = {"model": model, "words_per_prompt": MTP_WORDS_PER_PROMPT}
    ref, ula = run_side_by_side(
        lambda bind: run_vllm_script(MTP_SCRIPT, args={**args, "kw": {
            "kv_backend": "vllm", "kv_cache_memory_bytes": REF_KV_BYTES, **REFERENCE_PATH}},
            timeout=900, env=bind),
        lambda bind: run_vllm_script(MTP_SCRIPT, args={**args, "kw": {
            "kv_backend": "ulacache", "kv_cache_memory_bytes": 18_000_000, **REFERENCE_PATH,
            "ula_host_pool_gib": 0.008}}, timeout=900,
            env={"ULACACHE_PBLRU_SMALL_POOL_SLOTS": "0", **bind}), in_process=True)
    m = ula["metrics"]
    print(f"\nMTP: prompts {ula['prompt_lens']}; {m[SPEC_DRAFTS]} draft tokens, "
          f"{m[SPEC_ACCEPTED]} accepted; demotions {m['vllm:ulacache_demotions']}, promotions "
          f"{m['vllm:ulacache_promotions']}")
    assert ula["out"] == ref["out"]
    assert set(ula["victim_paths"]) == {"rounds"}, ula["victim_paths"]
    check_drafts_judged_both_ways(m, ref["metrics"])
    assert m["vllm:ulacache_promotions"] > 0 and m["vllm:ulacache_demotions"] > 0, m


# The TP=2 engines' script. Its own workload first: two short requests (they fit one rank's
# device pool: TP shard mode keeps replicas), then ~3.3k prompt tokens + 8 x 64 decoded, more
# than the pools hold; its results go to ``res["tp"]`` (its own metrics and usage included).
# With ``ARGS["script"]`` the same engine then runs ``SCRIPT_WORKLOAD`` (aborts, preemptions;
# every pool is empty again in between, so shard mode starts over from replicas).
TP_SCRIPT = IDLE_STEP + r"""
from vllm import LLM, SamplingParams
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_seqs=8, seed=0, tensor_parallel_size=2, disable_log_stats=False, **ARGS["kw"])
tp_usage = lambda: llm.collective_rpc("ulacache_usage") if ARGS["kw"]["kv_backend"] == "ulacache" else None
tp_metrics = lambda: {x.name: getattr(x, "value", None) for x in llm.get_metrics()
                      if x.name.startswith("vllm:ulacache_") or x.name == "vllm:num_preemptions"}
words = "one two three four five six seven eight nine ten eleven twelve".split()
small = llm.generate([" ".join(words[(j * 7 + i) % 12] for j in range(30)) for i in range(2)],
                     SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
small_usage = tp_usage()
# ~3.3k prompt tokens + 8 x 64 decoded: more than the ~2.7k-slot device pool holds (measured
# with 64: each rank ~950 demotions, ~90 promotions, ~11k remote rows fetched, ~180 buffer
# fills skipped; the replicas ~2.5k demotions, ~220 promotions).
prompts = [" ".join(words[(i * 5 + j * (i + 2)) % len(words)] for j in range(120 + 40 * i))
           for i in range(8)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
idle_step()
tp = {"out": [o.outputs[0].token_ids for o in outs], "metrics": tp_metrics(), "usage": tp_usage(),
      "small": [o.outputs[0].token_ids for o in small], "small_usage": small_usage}
if not ARGS["script"]:
    emit({"tp": tp})
    return
""" + SCRIPT_WORKLOAD + r"""res["tp"] = tp
""" + EMIT_WITH_METRICS


# Per-rank KV budget of the shard run: ~1.4k local device + ~0.6k host slots per rank (~4k
# logical tokens over both), below the ~4.3k tokens the TP workload holds at its peak and
# below SCRIPT_WORKLOAD's long run: demotions, promotions, remote fetches and preemptions.
ULA_SHARD_KV_BYTES = 7_600_000
ULA_SHARD_HOST_GIB = 0.0025


@pytest.fixture(scope="module")
def tp2(tiny_model):
    """The TP=2 engine runs of DeepSeek-V3.2, each booted once and only when a test asks:
    ``"stock"`` (stock vLLM, the reference of both TP modes; both workloads), ``"shard"``
    (``--ula-tp-mode shard``, the default, under pressure; both workloads) and
    ``"replicate"`` (``--ula-tp-mode replicate`` under pressure; the TP workload)."""
    model = str(tiny_model("deepseek_v32"))
    # (tp_omp_bind fails, naming the CPUs, where this process may use fewer than 2)
    env = {**tp_omp_bind(2), **IN_PROCESS}
    kws = {
        "stock": ("vllm", True, {"kv_cache_memory_bytes": REF_KV_BYTES}),
        "shard": ("ulacache", True, {"kv_cache_memory_bytes": ULA_SHARD_KV_BYTES,
                                     "ula_host_pool_gib": ULA_SHARD_HOST_GIB,
                                     "ula_tp_lockstep_check": True}),
        "replicate": ("ulacache", False, {"kv_cache_memory_bytes": ULA_KV_BYTES,
                                          "ula_host_pool_gib": ULA_HOST_GIB,
                                          "ula_tp_mode": "replicate"}),
    }
    cache = {}

    def get(which):
        if which not in cache:
            backend, script, kw = kws[which]
            cache[which] = run_vllm_script(TP_SCRIPT, args={
                "model": model, "backend": backend, "script": script,
                "kw": {"kv_backend": backend, **REFERENCE_PATH, **kw}}, timeout=900, env=env)
        return cache[which]
    return get


def test_tensor_parallel_2_replicate_parity_under_pressure(tp2):
    """``--ula-tp-mode replicate``: each TP rank keeps its own store of the (replicated, as in
    stock vLLM) MLA rows and makes the same placement decisions; greedy output matches stock
    TP=2 with the host tier in use, and every rank ends with its pools empty."""
    ref, ula = tp2("stock")["tp"], tp2("replicate")["tp"]
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
def test_tensor_parallel_2_shard_parity_under_pressure(tp2):
    """``--ula-tp-mode shard`` (the default): token t's MLA row and indexer key live on rank
    t mod 2 only. Greedy output equals stock TP=2 under pressure; on every rank rows were
    demoted, promoted, fetched from the other rank and served from the remote-row buffer;
    the ranks hold different rows (shards); everything is empty at the end."""
    ref, ula = tp2("stock")["tp"], tp2("shard")["tp"]
    assert ula["out"] == ref["out"] and ula["small"] == ref["small"]
    # The short requests ran on replicas (no exchange), the pressure run on shards.
    for u in ula["small_usage"]:
        assert u["totals"]["remote_rows_fetched"] == 0 and u["totals"]["replica_exits"] == 0, u
    assert len(ula["usage"]) == 2, ula["usage"]
    for u in ula["usage"]:
        assert u["tp_mode"] == "shard" and u["totals"]["replica_exits"] >= 1, u
        t = u["totals"]
        assert t["demotions"] > 0 and t["promotions"] > 0, t
        assert t["merged_plans"] > 0, t  # settles and writes moved as one plan
        assert t["remote_rows_fetched"] > 0 and t["remote_hits"] > 0, t
        # The tiny model's top-k seldom repeats (~3 % of remote reads hit the buffer), so the
        # fill control skipped most of the buffer's settles, and the output did not change.
        assert t["remote_fill_skips"] > 0, t
        assert u["device_used"] == 0 and u["host_used"] == 0 and u["remote_used"] == 0, u
    assert ula["usage"][0]["totals"] != ula["usage"][1]["totals"]  # shards, not replicas
    m = ula["metrics"]
    # /metrics: every rank's counters summed (reported when pools change, and at least
    # every 32 steps, so the last few steps may not have arrived yet).
    assert 0 < m["vllm:ulacache_remote_rows_fetched"] <= sum(
        u["totals"]["remote_rows_fetched"] for u in ula["usage"]), m
    assert m["vllm:ulacache_promotions"] == sum(u["totals"]["promotions"] for u in ula["usage"])


def test_tensor_parallel_2_shard_aborts_and_preemption(tp2):
    """TP=2 shard mode through the abort and preemption workload (in the same engine, after
    the parity workload above): aborted requests free their rows on both ranks, survivors and
    preempted-then-resumed requests equal stock TP=2, and every pool and remote buffer is
    empty at the end. Counters are taken as increases over the parity workload's, so this
    workload alone demoted, promoted, fetched remote rows and preempted."""
    ref, ula = tp2("stock"), tp2("shard")
    assert ula["main"] == ref["main"]
    check_aborts(ref)
    check_aborts(ula, ref)
    preempted = ula["metrics"]["vllm:num_preemptions"] - \
        ula["tp"]["metrics"]["vllm:num_preemptions"]
    assert preempted > 0, (ula["metrics"], ula["tp"]["metrics"])
    assert ula["long"] == ref["long"]
    for key in ("usage_after_abort", "usage_end"):
        assert len(ula[key]) == 2, ula[key]
        for u in ula[key]:
            assert u["tp_mode"] == "shard", u
            assert u["device_used"] == 0 and u["host_used"] == 0 and u["remote_used"] == 0, (key, u)
    for before, u in zip(ula["tp"]["usage"], ula["usage_end"]):
        t = {k: u["totals"][k] - before["totals"][k] for k in u["totals"]}
        assert t["demotions"] > 0 and t["promotions"] > 0 and t["remote_rows_fetched"] > 0, t
