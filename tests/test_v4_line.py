"""`--kv-backend ulacache` for DeepSeek-V4 (issue 44): the V4 line against stock V4.

One ulacache engine (the CSA compressed rows in the logical address space with a device pool
of 900 rows per layer, so long prompts' rows are demoted to the host pool and decodes promote
some back; every other V4 cache an arena kind at its natural page size, forced
compactions/relayouts every other step) and one stock engine run the same token-id prompts,
side by side: distinct prompts over 2048 tokens (the real indexer: top 512 of the compressed
rows) beside short ones, identical resends, next-turn prompts and siblings sharing a prefix
(prefix hits where vLLM's platform has prefix caching on, as on AMX hosts, or asked: at the
replay boundary and at the junction vLLM learns, where the compressor states' window tails stay
in the arena while a prefill's other states go through the step scratch), a batch of long prompts and
outputs, the same prompts one at a time, prompts near `max_model_len` one at a time (also
through a second arena barely above one such request: cached pages evicted; and a third
with prefix caching off, where a prefill chunk's compressor states out of the window after
the step live in the step's scratch, not the arena), aborts mid-decode,
`reset_prefix_cache()`.

Stock V4 on the CPU build is not schedule-invariant: a long request's greedy tokens depend on
which other requests share its steps (measured: stock with `max_num_seqs=1` and with 4 differ
on 3 of 7 long prompts; ulacache equals stock whenever the schedules are equal, and a tighter
arena, which admits fewer prefills at once, gives the tokens stock gives under that schedule).
So parity is asserted where both sides schedule alike: the batched phases at a budget that
admits what stock admits, the pressure on memory one request at a time, and a preemption
forced alike on both engines (one allocation refused at the same step: vLLM's scheduler
preempts its last running request, a long prompt, and recomputes it).

Asserted: token-exact greedy output in every phase; the indexer's top-k ran; CSA rows demoted
and promoted (counters and their `vllm:ulacache_v4_csa_*` series > 0); hits > 0 and at least
stock's (with prefix caching on); the forced moves copied pages and the arena evicted cached
pages; aborts drop their requests; at the end only the null page is live and no CSA row is
left in either tier. Plus, without an engine, the line choice, refusals, and the CSA pools'
sizing and its startup errors.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from _vllm_subprocess import (ABORT_TWO_OF_FOUR, EMIT_WITH_METRICS, NO_V4_KERNELS, check_aborts,
                              host_runs_v4, run_side_by_side, run_vllm_script)

V4 = "deepseek_v4"
# One prefill chunk for every prompt, and the same step budget on either host kind (AMX hosts
# default to 4096-token chunked steps, others to max(max_model_len, 2048) unchunked).
MAX_MODEL_LEN = 3072

SCRIPT = r"""
import random
import vllm._custom_ops as ops
from vllm import LLM, SamplingParams
kw = dict(ARGS["kw"])
llm = LLM(model=ARGS["model"], dtype="bfloat16", enforce_eager=True,
          max_model_len=ARGS["max_model_len"], max_num_batched_tokens=ARGS["max_model_len"],
          enable_prefix_caching=kw.pop("enable_prefix_caching", True), max_num_seqs=4,
          seed=0, disable_log_stats=False, **kw)
topk_calls = [0]
topk_op = ops.topk_transform_512_cpu
def counted(*a, **k):
    topk_calls[0] += 1
    return topk_op(*a, **k)
ops.topk_transform_512_cpu = counted
ula = ARGS["backend"] == "ulacache"
res = {"prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching}
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

def metric(name):
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)

def usage():
    return llm.collective_rpc("ulacache_usage")[0] if ula else None

def run(name, prompts, out):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy(out + 5 * (i % 3)) for i in range(len(prompts))],
                        use_tqdm=False)
    res[name] = [list(o.outputs[0].token_ids) for o in outs]
    res[name + "_cached"] = [o.num_cached_tokens for o in outs]
    res[name + "_hits"] = metric("vllm:prefix_cache_hits")

def _prompts() -> dict:  # (made here: the token lists are too long for ARGS)
    rng = random.Random(44)
    ids = lambda n: [rng.randrange(3, 500) for _ in range(n)]
    long_a, long_b = ids(2400), ids(2150)
    prime = [long_a, ids(300), long_b, ids(90)]
    # A conversation's next turn: the whole earlier prompt and a new tail (stock hashes the
    # window and compressor states where a prompt ends: vLLM's retention rule).
    variant = [long_a + ids(200), prime[1] + ids(100)]
    pressure = [ids(2100 + 97 * i) for i in range(4)] + [ids(200)]
    abort = [ids(30)] * 4 + [ids(400 + 50 * i) for i in range(4)]
    # Each prefill's compressor states nearly fill an arena sized for one max_model_len
    # request: the cached pages of the earlier ones make room (on either host kind).
    tight = [ids(2950), ids(2990), ids(2930), ids(2970)]
    # Two at once: one decodes (its boundaries read states from before the step) while the
    # other's prefill chunk runs (its early states out of the window after the step).
    pair = [ids(1400), ids(1700)]
    # A forced preemption (the same on both engines): the last admitted, a long prompt whose
    # CSA rows reach the host tier, is preempted mid-decode and recomputed.
    preempt = [ids(600), ids(2200), ids(2300)]
    # Siblings: one prefix, other tails, one at a time (vLLM learns the shared-prefix junction
    # and keeps the window's tail there; the third and later hit it).
    shared = ids(1500)
    siblings = [shared + ids(120 + 40 * i) for i in range(4)]
    return dict(prime=prime, variant=variant, pressure=pressure, abort=abort, tight=tight,
                pair=pair, preempt=preempt, siblings=siblings)

P = _prompts()
def tight():  # prompts near max_model_len, one at a time: the same schedule on every engine
    for i, p in enumerate(P["tight"][:2]):  # (two of the four: suite time)
        run(f"tight{i}", [p], ARGS["out"])
    run("pair", P["pair"], ARGS["out"])

if ARGS.get("tight_only"):
    tight()
    res["reset_ok"] = llm.reset_prefix_cache()
    llm.llm_engine.step()  # (in-process core) the empty step that ships the freed figures
    res["usage_end"] = usage()
    res["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                      if m.name.startswith("vllm:ulacache_")}
    emit(res)
    raise SystemExit(0)
run("prime", P["prime"], ARGS["out"])
res["topk_calls_prime"] = topk_calls[0]
run("resend", P["prime"], ARGS["out"])
run("variant", P["variant"], ARGS["out"])
for i, p in enumerate(P["siblings"]):
    run(f"sib{i}", [p], ARGS["out"])
res["usage_hits"] = usage()
run("pressure", P["pressure"], ARGS["pressure_out"])
for i, p in enumerate(P["pressure"][:3]):  # one at a time: the same schedule on both sides
    run(f"seq{i}", [p], ARGS["out"])
tight()
run("after", P["prime"][:2], ARGS["out"])
res["usage_pressure"] = usage()

# Preemption changes the schedule (stock V4 is not schedule-invariant), so both engines get
# the same one: once the first request has decoded 6 tokens, its next allocation fails once and
# vLLM's scheduler preempts its last running request (then retries). Each engine's own memory
# admits the whole batch, so this is the only preemption (asserted by the count).
sched = llm.llm_engine.engine_core.engine_core.scheduler
kvm = sched.kv_cache_manager
alloc = kvm.allocate_slots
fired = []
def failing_once(request, *a, **k):
    if (not fired and len(sched.running) >= 2
            and request.num_computed_tokens >= request.num_prompt_tokens + 6):
        fired.append((request.num_computed_tokens, sched.running[-1].num_prompt_tokens))
        return None
    return alloc(request, *a, **k)
kvm.allocate_slots = failing_once
preempted0 = metric("vllm:num_preemptions")
run("preempt", P["preempt"], ARGS["out"] + 8)
kvm.allocate_slots = alloc
res["preempt_fired"] = fired
res["preemptions"] = metric("vllm:num_preemptions") - preempted0
prompts = [{"prompt_token_ids": p} for p in P["abort"]]
abort_tokens = 24
""" + ABORT_TWO_OF_FOUR + r"""
res["reset_ok"] = llm.reset_prefix_cache()
run("after_reset", P["prime"][:1], 4)
res["reset_ok2"] = llm.reset_prefix_cache()
llm.llm_engine.step()  # (in-process core) the empty step that ships the freed figures
res["usage_end"] = usage()
res["topk_calls"] = topk_calls[0]
""" + EMIT_WITH_METRICS

TIGHT = ("tight0", "tight1")
SIBLINGS = ("sib0", "sib1", "sib2", "sib3")
PHASES = ("prime", "resend", "variant", *SIBLINGS, "pressure", "seq0", "seq1", "seq2", *TIGHT,
          "after", "preempt", "after_reset")


@pytest.fixture(scope="module")
def v4_line_runs(tiny_model):
    model = str(tiny_model(V4))
    base = dict(model=model, max_model_len=MAX_MODEL_LEN, out=12,
                pressure_out=40)

    def call(backend, kw):
        args = {**base, "backend": backend, "kw": {"kv_backend": backend, **kw}}
        return lambda bind: run_vllm_script(SCRIPT, args=args, timeout=900, env=bind)

    # The arena: room for the batches stock admits, little more (72 MiB was ~1.4 max_model_len
    # requests when a prefill chunk's compressor states took pages; now ~9 of them);
    # compactions/relayouts forced every other step. Stock: room.
    ula, ref = run_side_by_side(
        call("ulacache", dict(kv_cache_memory_bytes=ULA_BUDGET, ula_arena_force_moves=2,
                              ula_v4_csa_device_rows=CSA_DEVICE_ROWS)),
        call("vllm", dict(kv_cache_memory_bytes=256 << 20)), in_process=True)
    # And an arena barely above one max_model_len request (its startup check: ~8 MB) for
    # the near-max_model_len prompts alone.
    # The same with prefix caching off (on every host kind): a prefill chunk's compressor
    # states out of the window after the step stay in the step's scratch, not the arena.
    base["tight_only"] = True
    tight = call("ulacache", dict(kv_cache_memory_bytes=TIGHT_BUDGET,
                                  ula_v4_csa_device_rows=CSA_DEVICE_ROWS))
    states = call("ulacache", dict(kv_cache_memory_bytes=TIGHT_BUDGET,
                                   enable_prefix_caching=False,
                                   ula_v4_csa_device_rows=CSA_DEVICE_ROWS))
    return (ref, ula, *run_side_by_side(tight, states, in_process=True))


ULA_BUDGET = 72 << 20
# CSA rows on the device per layer: one step's new rows (3072 / 4 + 4) and little more, so the
# long prompts' rows are demoted to the host pool and the decodes' reads promote some back.
CSA_DEVICE_ROWS = 900
# One max_model_len request's arena (its startup check with prefix caching on: ~8.0 MB with
# the null page, the compressor states at a window and its kept tails) and the CSA device rows
# (900 x 584 B): cached pages are evicted to make room.
TIGHT_BUDGET = 9_500_000


@pytest.mark.engine
@pytest.mark.skipif(not host_runs_v4(), reason=NO_V4_KERNELS)
def test_v4_under_the_arena_is_token_exact_against_stock(v4_line_runs):
    ref, ula, tight, states = v4_line_runs
    assert ula["prefix_caching"] == ref["prefix_caching"] == tight["prefix_caching"]
    assert not states["prefix_caching"]
    for p in TIGHT:
        assert tight[p] == ref[p], p
    for p in (*TIGHT, "pair"):  # (both admit the pair at once: the states take no pages)
        assert states[p] == ref[p], p
    # The out-of-window states ran through the scratch (no arena page), and nothing is left;
    # also with prefix caching on (the tails vLLM hashes kept: the hits asserted below).
    assert states["usage_end"]["state_scratch_tokens"] > 0, states["usage_end"]
    assert ula["usage_end"]["state_scratch_tokens"] > 0, ula["usage_end"]
    assert tight["usage_end"]["state_scratch_tokens"] > 0, tight["usage_end"]
    assert states["metrics"]["vllm:ulacache_v4_state_scratch_tokens"] > 0, states["metrics"]
    assert states["usage_end"]["arena_live_pages"] == 0, states["usage_end"]
    for p in PHASES:
        assert ula[p] == ref[p], p
    # The real indexer ran (prompts over 4 * index_topk tokens), on both sides alike.
    assert ula["topk_calls_prime"] > 0 and ula["topk_calls"] == ref["topk_calls"], \
        (ula["topk_calls"], ref["topk_calls"])
    if ula["prefix_caching"]:  # vLLM's CPU platform turns it off for V4 without AMX
        for p in ("resend", "variant"):
            assert all(u >= r for u, r in zip(ula[p + "_cached"], ref[p + "_cached"])), \
                (p, ula[p + "_cached"], ref[p + "_cached"])
        assert sum(ula["resend_cached"]) > 0 and ula["variant_cached"][0] > 0, ula
        # The siblings hit at the junction vLLM learnt (the window's tail kept there while
        # the prefill's other states went through the scratch), at least as stock does.
        sib = [ula[p + "_cached"][0] for p in SIBLINGS]
        sib_ref = [ref[p + "_cached"][0] for p in SIBLINGS]
        assert all(u >= r for u, r in zip(sib, sib_ref)) and sum(sib) > 0, (sib, sib_ref)
    m = ula["metrics"]
    assert m["vllm:ulacache_arena_bytes_copied"] > 0, m  # the forced moves ran
    # The CSA rows' tiers ran: rows demoted to the host and promoted back, under pressure.
    csa = ula["usage_pressure"]["csa"]
    assert csa["device_rows"] == CSA_DEVICE_ROWS, csa
    assert csa["demotions"] > 0 and csa["promotions"] > 0, csa
    # (Taken once the batches finished: with prefix caching on, their cached blocks keep rows on
    # the host; with it off, as on hosts without AMX, rows go with their requests, the last
    # batch's with the next step: that nothing stays is checked at the end.)
    if ula["prefix_caching"]:
        assert csa["host_used"] > 0, csa
    assert m["vllm:ulacache_v4_csa_demotions"] > 0, m
    assert m["vllm:ulacache_v4_csa_promotions"] > 0, m
    if tight["prefix_caching"]:  # room made from cached pages
        assert tight["metrics"]["vllm:ulacache_arena_cache_evictions"] > 0, tight["metrics"]
    assert tight["reset_ok"] and tight["usage_end"]["arena_live_pages"] == 0, tight["usage_end"]
    # The forced preemption hit the same request at the same step on both engines, and only it
    # (a long prompt, recomputed: its freed rows and pages and its resumption token-exact).
    assert ula["preempt_fired"] == ref["preempt_fired"] and len(ref["preempt_fired"]) == 1, \
        (ula["preempt_fired"], ref["preempt_fired"])
    assert ref["preempt_fired"][0][1] == 2300, ref["preempt_fired"]
    assert ula["preemptions"] == ref["preemptions"] == 1, (ula["preemptions"], ref["preemptions"])
    check_aborts(ref)
    check_aborts(ula, ref)
    assert ula["after_reset_cached"] == [0] == ref["after_reset_cached"]
    u = ula["usage_end"]
    assert u["arena_used_bytes"] == 0 and u["arena_live_pages"] == 0, u
    assert u["arena_withheld_bytes"] == 0, u
    assert u["arena_free_bytes"] + u["kinds_null_bytes"] == u["arena_total_bytes"], u
    # Every CSA row went with its logical block (nothing left in either tier).
    for run_ in (u, tight["usage_end"]):
        assert run_["csa"]["device_used"] == 0 and run_["csa"]["host_used"] == 0, run_["csa"]


# ------------------------------------------------------------------ the line, no engine
def _hf(model_type: str, arch: str):
    return SimpleNamespace(model_type=model_type, architectures=[arch],
                           get_text_config=lambda: SimpleNamespace(index_topk=512))


def test_v4_is_served_by_its_own_line():
    from ulacache_vllm.engine.lines import choose_line, line_serving

    cfg = SimpleNamespace(hf_config=_hf("deepseek_v4", "DeepseekV4ForCausalLM"))
    assert choose_line(cfg).name == "v4"
    assert line_serving(cfg.hf_config).name == "v4"


def test_v41_is_refused_naming_what_is_missing():
    from ulacache_vllm.engine.config import KVBackendError
    from ulacache_vllm.engine.lines import choose_line

    cfg = SimpleNamespace(hf_config=_hf("deepseek_v41", "DeepseekV41ForCausalLM"))
    with pytest.raises(KVBackendError, match="V4.1.*--kv-backend vllm"):
        choose_line(cfg)


def test_only_the_indexer_key_pages_widen_the_granule():
    from ulacache_vllm.engine.arena.sizing import _alignment
    from ulacache_vllm.engine.v4.sizing import strided_layer

    assert strided_layer("model.layers.1.attn.indexer.k_cache")
    assert not strided_layer("model.layers.1.attn")
    assert not strided_layer("model.layers.1.attn.swa_cache")
    assert not strided_layer("model.layers.1.attn.indexer.compressor.state_cache")
    pages = [37440, 8640, 1728, 32832]
    assert _alignment(pages, 1 << 28) == 512  # the pages' gcd is 576: a 512-B granule
    a = _alignment(pages, 1 << 28, 8640)
    assert a >= 8640 and a % 512 == 0


@pytest.mark.parametrize("what, change, needle", [
    ("tp", dict(tensor_parallel_size=2), "tensor or pipeline parallelism"),
    ("spec", dict(speculative=True), "speculative decoding"),
])
def test_v4_refusals_name_the_fix(what, change, needle):
    from ulacache_vllm.engine.config import KVBackendError, UlaSettings
    from ulacache_vllm.engine.v4.sizing import prepare

    pc = SimpleNamespace(tensor_parallel_size=change.get("tensor_parallel_size", 1),
                         pipeline_parallel_size=1, decode_context_parallel_size=1,
                         prefill_context_parallel_size=1)
    cfg = SimpleNamespace(parallel_config=pc,
                          speculative_config=object() if change.get("speculative") else None,
                          scheduler_config=SimpleNamespace(async_scheduling=True))
    with pytest.raises(KVBackendError, match=needle) as e:
        prepare(cfg, UlaSettings())
    assert "--kv-backend vllm" in str(e.value) or "Drop" in str(e.value)


def _csa_spec():
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                            tokens_per_state=4, state_content_bytes=584,
                            model_version="deepseek_v4", cache_dtype_str="fp8_ds_mla",
                            alignment=576)


def _cfg(max_model_len, batch=3072, seqs=4):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=batch),
        model_config=SimpleNamespace(max_model_len=max_model_len,
                                     hf_text_config=SimpleNamespace(index_topk=512)))


def test_csa_rows_are_sized_from_the_step_and_the_host_pool():
    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.v4.sizing import csa_layers, plan_csa

    spec = _csa_spec()
    specs = {"model.layers.1.attn": spec, "model.layers.3.attn": spec,
             "model.layers.1.attn.indexer.k_cache": spec}  # (an indexer cache: not a CSA one)
    csa = csa_layers(specs)
    assert sorted(csa) == ["model.layers.1.attn", "model.layers.3.attn"]
    p = plan_csa(_cfg(65536), csa, 5, UlaSettings(host_pool_gib=1.0))
    assert (p.rows_per_block, p.row_bytes, p.group) == (64, 584, 5)
    assert p.device_rows == 3072 // 4 + 4 + 512  # one step's rows + one request's top-k
    assert p.host_rows == (1 << 30) // (584 * 2)
    assert p.num_blocks == (p.device_rows + p.host_rows) // 64 + 1
    assert plan_csa(_cfg(65536), csa, 5, UlaSettings(v4_csa_device_rows=800)).device_rows == 800


def test_a_host_pool_or_device_pool_too_small_is_refused_with_the_size_that_fits():
    from ulacache_vllm.engine.config import KVBackendError, UlaSettings
    from ulacache_vllm.engine.v4.sizing import plan_csa

    csa = {"model.layers.1.attn": _csa_spec(), "model.layers.3.attn": _csa_spec()}
    with pytest.raises(KVBackendError, match=r"host pool too small.*65536 \(16384 rows\).*"
                                             r"at least 0\.018"):
        plan_csa(_cfg(65536), csa, 5, UlaSettings(host_pool_gib=0.01))
    p = plan_csa(_cfg(65536), csa, 5, UlaSettings(host_pool_gib=0.018))  # the size it named
    assert p.host_rows >= 16384
    with pytest.raises(KVBackendError, match=r"smaller than one step's new CSA rows \(772.*"
                                             r"at least 772"):
        plan_csa(_cfg(65536), csa, 5, UlaSettings(v4_csa_device_rows=700))
