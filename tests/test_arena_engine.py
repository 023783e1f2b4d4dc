"""`--kv-backend ulacache` on hybrid models: the arena in the real engine.

Token-exact greedy parity against stock vLLM with the arena's moves forced (compactions,
relayouts, bytes copied > 0) and under memory pressure (preemptions > 0), aborts, and the arena
back to its null page with an empty ledger afterwards.

- Qwen3-Next (GDN state + full attention) runs in bf16 (vLLM's CPU GDN kernels need it), whose
  stock output is not batch-invariant: both backends run the *same schedule* (max_num_seqs 4,
  every request admitted at once, no preemption on either side), so any difference is the KV
  bytes' fault.
- GPT-OSS (sliding window + full attention, sinks) and Gemma 3 (5 sliding : 1 full) run in
  float32 against an ample stock engine, with an arena too small for the workload: preemption
  and recompute must not change a token.
- Qwen3-Next at TP=2: one plan runs on both ranks' arenas.
- Faults in the worker's page moves: stalls change no token; a failed copy ends only the
  requests whose pages it lost, with an error.
The tiny models' greedy output depends on the context (distinct tokens; GPT-OSS and Gemma 3
are built with `initializer_range` 0.1, Gemma 3 with untied embeddings, at which their random
logits are no longer flat).
"""
from __future__ import annotations

import pytest

from _vllm_subprocess import (ABORT_TWO_OF_FOUR, EMIT_WITH_METRICS, IDLE_STEP, IN_PROCESS,
                              check_aborts, run_at_once, run_side_by_side, run_vllm_script,
                              tp_omp_bind)

from ulacache_vllm.engine.faults import ENV as FAULTS_ENV

pytestmark = pytest.mark.engine  # every test here boots vLLM

SCRIPT = IDLE_STEP + r"""
from vllm import LLM, SamplingParams
kw = dict(ARGS["kw"])
# Pinned on every host: the step budget, and prefix caching off on both sides (stock hybrids
# may default to it, whose mamba "align" mode changes the schedule).
llm = LLM(model=ARGS["model"], dtype=ARGS["dtype"], enforce_eager=True, max_model_len=1024,
          max_num_batched_tokens=1024, seed=0, disable_log_stats=False,
          **{"enable_prefix_caching": False, **kw})
words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon").split()
prompts = [" ".join(words[(i * 7 + j * (i + 3)) % len(words)] for j in range(ARGS["base"] + 12 * i))
           for i in range(8)]
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
res = {"prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching}
import os
if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":  # the engine core is here
    res["hashes_blocks"] = llm.llm_engine.engine_core.engine_core.request_block_hasher is not None
    # (a transfer group, which the attention layers' per-layer hooks see only for stock's
    # connectors: `patches/kv_layer_hooks`)
    import vllm.model_executor.layers.attention.kv_transfer_utils as ktu
    from vllm.distributed.kv_transfer import has_kv_transfer_group
    res["layer_hooks"] = [has_kv_transfer_group(), ktu.has_kv_transfer_group()]

def usage():
    if ARGS["backend"] != "ulacache":
        return None
    return llm.collective_rpc("ulacache_usage")[0]

# Outputs of different lengths: requests finish at different steps and leave holes.
sps = [greedy(ARGS["out"] + 13 * (i % 5)) for i in range(8)]
res["main"] = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
res["prompt_lens"] = [len(o.prompt_token_ids) for o in llm.generate(prompts[:2], greedy(1))]
res["usage_main"] = usage()

import json, os, time
faults = os.environ.get("ULACACHE_TEST_MOVE_FAULTS")  # the workers' move-fault control file

def arm(**spec):
    with open(faults, "w") as f:
        f.write(json.dumps({**spec, "nonce": time.time()}) if spec else "")

if faults:  # the abort phase's page copies stall (must change no token)
    arm(fault="stall", moves=["arena"], count=3, seconds=0.2)
# Abort two requests mid-decode; the survivors must still match the reference.
abort_tokens = 48
""" + ABORT_TWO_OF_FOUR + r"""if faults and ARGS.get("raise_phase"):
    # Two page-copy steps fail: their requests end with an error; the others run on.
    res["usage_before_faults"] = usage()
    arm(fault="raise", moves=["arena"], skip=1, count=2)
    outs = llm.generate(prompts, greedy(48))
    arm()
    res["faulted"] = [[list(o.outputs[0].token_ids), o.outputs[0].finish_reason] for o in outs]
    res["usage_faults"] = usage()
    failed = [i for i, (_, why) in enumerate(res["faulted"]) if why == "error"]
    again = llm.generate([prompts[i] for i in failed], greedy(48)) if failed else []
    res["again"] = {i: list(o.outputs[0].token_ids) for i, o in zip(failed, again)}
llm.generate(prompts[:1], greedy(1))  # one more request: its step ships fresh figures
idle_step()  # the empty step that carries the freed pages (a core process takes it itself)
res["usage_end"] = usage()
""" + EMIT_WITH_METRICS


def _run(model, backend: str, dtype: str, kw: dict, base: int, out: int, env=None,
         raise_phase=False):
    # Prefix caching pinned off on both sides (SCRIPT): the same schedule; the arena's prefix
    # caching is tested in tests/test_arena_prefix_caching.py.
    kw = {"kv_backend": backend, **kw}
    return run_vllm_script(SCRIPT, args={"model": str(model), "kw": kw, "backend": backend,
                                         "dtype": dtype, "base": base, "out": out,
                                         "raise_phase": raise_phase}, timeout=900, env=env)


# IN_PROCESS, the engine core in the script's process: `eng.step()` is one engine step, so the
# abort lands at the same step in both runs (a separate core process may run ahead of the
# client, and in bf16 another batch at another step is another result).


def _check_prefix_caching_off(ula: dict) -> None:
    """Prefix caching pinned off (``SCRIPT``): the running engine had it off, its config says
    so, and its scheduler looked up no prompt token in a prefix cache."""
    assert ula["prefix_caching"] is False, ula["prefix_caching"]
    assert ula["metrics"]["vllm:prefix_cache_queries"] == 0, ula["metrics"]
    # ...and hashed no block (vLLM hashes whenever a KV connector is configured; ulacache's
    # connector reads no hash: `patches/block_hasher`).
    assert ula.get("hashes_blocks", False) is False, ula.get("hashes_blocks")


def _check_clean(u: dict) -> None:
    """The arena holds only its null page, the ledger withholds nothing, every step's fence
    (but the current one's) passed."""
    assert u["arena_used_bytes"] == 0 and u["arena_live_pages"] == 0, u
    assert u["arena_withheld_bytes"] == 0, u
    assert u["arena_free_bytes"] + u["kinds_null_bytes"] == u["arena_total_bytes"], u
    assert u["arena_fences_opened"] > 0, u
    assert u["arena_fences_opened"] - u["arena_fences_passed"] <= 1, u


def _check_distinct(tokens: list[list[int]]) -> None:
    # Parity on near-constant output would prove nothing about the KV bytes: each output
    # starts with many distinct tokens (greedy random models may fall into a loop later), and
    # the prompts' continuations differ from one another.
    assert all(len(set(t[:32])) >= 8 for t in tokens), tokens
    assert len({tuple(t[:8]) for t in tokens}) >= len(tokens) - 2, tokens


@pytest.fixture(scope="module")
def qwen3_next(tiny_model):
    model = tiny_model("qwen3_next")
    same = dict(max_num_seqs=4)
    # The arena: room for the 4 requests at once (no preemption either side: same schedule),
    # with a compaction or relayout forced every 2 steps.
    ula, ref = run_side_by_side(
        lambda bind: _run(model, "ulacache", "bfloat16",
                          dict(same, kv_cache_memory_bytes=24 << 20, ula_arena_force_moves=2),
                          15, 40, bind),
        lambda bind: _run(model, "vllm", "bfloat16",
                          dict(same, kv_cache_memory_bytes=256 << 20), 15, 40, bind),
        in_process=True)
    return ref, ula


# Sliding window + full attention in float32, arena budgets too small for the 8 requests at
# once (GPT-OSS: ~11 MiB of pages at the peak against ~6: running requests outgrow it and are
# preempted; Gemma 3, 5 sliding layers a page and one full: ~6 MiB against ~4, taken mostly
# by the prompts' window pages at admission, so requests wait to be admitted but, once
# running, hardly grow: no preemption).
SWA_MODELS = {
    "gpt_oss": (dict(initializer_range=0.1), 6 << 20, True),
    "gemma3": (dict(initializer_range=0.1, tie_word_embeddings=False), 4 << 20, False),
}
# GPT-OSS runs the engine core in its own process (the step plans cross a process boundary,
# as in `vllm serve`); Gemma 3 in the script's process (quicker to start).
SWA_ENV = {"gpt_oss": None, "gemma3": IN_PROCESS}


@pytest.fixture(scope="module")
def swa_runs(tiny_model, tmp_path_factory):
    """(stock, ulacache, preemption expected) per model name, each run once."""
    cache = {}

    def get(name):
        if name in cache:
            return cache[name]
        overrides, budget, preempts = SWA_MODELS[name]
        model = tiny_model(name, **overrides)
        env = SWA_ENV[name]
        # The move-fault control file (`engine/faults.py`): the script stalls copies
        # during its abort phase; GPT-OSS (the engine core in its own process, as served)
        # also fails two copy steps in a batch of its own.
        faults = tmp_path_factory.mktemp("faults") / "move_faults.json"
        # Side by side (``run_side_by_side``), each engine core where SWA_ENV puts it.
        ula, ref = run_side_by_side(
            lambda bind: _run(model, "ulacache", "float32",
                              dict(max_num_seqs=8, kv_cache_memory_bytes=budget,
                                   ula_arena_force_moves=3),
                              40, 100, {**bind, FAULTS_ENV: str(faults)},
                              raise_phase=name == "gpt_oss"),
            lambda bind: _run(model, "vllm", "float32",
                              dict(max_num_seqs=8, kv_cache_memory_bytes=256 << 20), 40, 100,
                              bind), in_process=env is not None)
        cache[name] = (ref, ula, preempts)
        return cache[name]
    return get


@pytest.fixture(scope="module", params=sorted(SWA_MODELS))
def swa_model(request, swa_runs):
    return swa_runs(request.param)


def test_qwen3_next_same_schedule_parity_with_forced_moves(qwen3_next):
    ref, ula = qwen3_next
    _check_distinct(ref["main"])
    assert ula["main"] == ref["main"]
    check_aborts(ref)
    check_aborts(ula, ref)
    _check_prefix_caching_off(ula)
    assert "hashes_blocks" in ula  # (an in-process core: the check above looked at it)
    # ulacache's connector is the transfer group, yet the attention layers ran no per-layer
    # connector hook; stock has no transfer group at all.
    assert ula["layer_hooks"] == [True, False] and ref["layer_hooks"] == [False, False]
    m = ula["metrics"]
    assert m["vllm:num_preemptions"] == 0 == ref["metrics"]["vllm:num_preemptions"]
    # The moves really ran, with real copies, and the tokens did not change.
    assert m["vllm:ulacache_arena_compactions"] > 0, m
    assert m["vllm:ulacache_arena_relayouts"] > 0, m
    assert m["vllm:ulacache_arena_bytes_copied"] > 0, m
    u = ula["usage_main"]
    assert u["worker"]["bytes_copied"] == u["arena_bytes_copied"] > 0, u
    # Natural page sizes: 32-token attention pages, state pages of exactly the state's bytes.
    assert u["kinds"]["full"]["block_size"] == 32, u
    assert set(u["kinds"]) == {"state", "full"}, u
    _check_clean(ula["usage_end"])


def test_sliding_window_pressure_preemption_and_abort_parity(swa_model):
    ref, ula, preempts = swa_model
    _check_distinct(ref["main"])
    assert min(ref["prompt_lens"]) > 128  # past the sliding window of 128
    assert ula["main"] == ref["main"]
    check_aborts(ref)
    check_aborts(ula, ref)
    _check_prefix_caching_off(ula)
    m = ula["metrics"]
    assert (m["vllm:num_preemptions"] > 0) == preempts, m
    assert ref["metrics"]["vllm:num_preemptions"] == 0
    assert m["vllm:ulacache_arena_compactions"] + m["vllm:ulacache_arena_relayouts"] > 0, m
    assert m["vllm:ulacache_arena_bytes_copied"] > 0, m
    assert set(ula["usage_main"]["kinds"]) == {"sliding", "full"}, ula["usage_main"]
    # The abort phase's copies stalled (and changed no token: the survivors above).
    w = ula["usage_end"]["worker"]
    assert w["stalled_copy_steps"] >= 1, w
    _check_clean(ula["usage_end"])


def test_a_failed_page_copy_ends_its_requests_with_an_error_and_no_other(swa_runs):
    """GPT-OSS, the engine core in its own process: two of the worker's page-copy steps
    raise during a batch of 8 under pressure. The requests holding pages those copies lost
    end with finish_reason "error", their tokens until then a prefix of the reference (never
    a wrong token); every other request gets exactly its reference tokens; sent again, the
    failed prompts get theirs; the arena ends clean (above: only its null page)."""
    ref, ula, _ = swa_runs("gpt_oss")
    want = [t[:48] for t in ref["main"]]
    failed = [i for i, (_, why) in enumerate(ula["faulted"]) if why == "error"]
    assert failed, ula["faulted"]
    for i, (tokens, why) in enumerate(ula["faulted"]):
        if i in failed:
            assert tokens == want[i][:len(tokens)], i
        else:
            assert why == "length" and tokens == want[i], i
    assert ula["again"] == {str(i): want[i] for i in failed}  # (JSON keys)
    before, after = ula["usage_before_faults"]["worker"], ula["usage_faults"]["worker"]
    assert after["failed_copy_steps"] - before["failed_copy_steps"] == 2, (before, after)
    assert after["lost_pages"] > before["lost_pages"], (before, after)
    assert ula["metrics"]["vllm:ulacache_failed_copies"] == 2, ula["metrics"]


TP_SCRIPT = r"""
from vllm import LLM, SamplingParams
# ~1,750 prompt tokens against a 1024-token step: one prefill continues in the next step
# from the state its first chunk left (a relayout is forced between the two chunks).
llm = LLM(model=ARGS["model"], dtype="bfloat16", enforce_eager=True, max_model_len=1024,
          max_num_batched_tokens=1024, enable_chunked_prefill=True, enable_prefix_caching=False,
          seed=0, max_num_seqs=6, tensor_parallel_size=2, disable_log_stats=False, **ARGS["kw"])
words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon").split()
prompts = [" ".join(words[(i * 7 + j * (i + 3)) % len(words)] for j in range(30 + 23 * i))
           for i in range(6)]
outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=40 + 11 * i,
                                             ignore_eos=True) for i in range(6)])
res = {"main": [list(o.outputs[0].token_ids) for o in outs],
       "prompt_lens": [len(o.prompt_token_ids) for o in outs]}
ula = ARGS["kw"]["kv_backend"] == "ulacache"
res["usage_main"] = llm.collective_rpc("ulacache_usage") if ula else None
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))
llm.llm_engine.step()  # the in-process core's empty step that frees the last pages
res["usage_end"] = llm.collective_rpc("ulacache_usage") if ula else None
""" + EMIT_WITH_METRICS


def test_tensor_parallel_2_arena_parity_with_forced_moves(tiny_model):
    """Qwen3-Next at TP=2: each rank's arena holds its heads' share of every page (state and
    attention), and one step plan (the same vids, granules and copies) runs on both ranks.
    Greedy output equals stock TP=2 (same schedule: the 6 requests run at once on both
    sides) with compactions and relayouts forced; each rank copied the bytes the plan says;
    both arenas end clean.

    The engine core runs in the script's process on both sides, so every request is queued
    before the first step: with a separate core process the first steps take whichever
    requests have arrived, and in bf16 another batch is another result, for stock against
    itself too (benchmarks/results/arena_host_parity.md)."""
    model = str(tiny_model("qwen3_next"))
    # Each rank's threads on cores of their own (fails, naming the CPUs, with fewer than 2).
    env = {**tp_omp_bind(2), **IN_PROCESS}
    ula, ref = run_at_once(  # (both at once: their start-ups overlap)
        lambda: run_vllm_script(TP_SCRIPT, args={"model": model, "kw": {
            "kv_backend": "ulacache", "kv_cache_memory_bytes": 16 << 20,
            "ula_arena_force_moves": 2}}, timeout=900, env=env),
        lambda: run_vllm_script(TP_SCRIPT, args={"model": model, "kw": {
            "kv_backend": "vllm", "kv_cache_memory_bytes": 128 << 20}}, timeout=900, env=env))
    _check_distinct(ref["main"])
    assert sum(ref["prompt_lens"]) > 1024, ref["prompt_lens"]  # a prefill split across steps
    assert ula["main"] == ref["main"]
    assert ula["metrics"]["vllm:num_preemptions"] == 0 == ref["metrics"]["vllm:num_preemptions"]
    ranks = ula["usage_main"]
    assert len(ranks) == 2, ranks
    for u in ranks:
        assert u["worker"]["bytes_copied"] == u["arena_bytes_copied"] > 0, u
        assert u["arena_compactions"] > 0 and u["arena_relayouts"] > 0, u
        assert u["arena_shortfalls"] == 0, u  # no admission waited on the arena: same batches
        assert set(u["kinds"]) == {"state", "full"}, u
    # One plan for both ranks: the same moves and pages, each rank on its own buffer.
    assert ranks[0]["worker"] == ranks[1]["worker"]
    assert ranks[0]["kinds"] == ranks[1]["kinds"]
    for u in ula["usage_end"]:
        _check_clean(u)
