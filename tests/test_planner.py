"""The capacity planner (`python -m ulacache_vllm.planner`): the presets print a table, its
ulacache figures are the engine's own `plan_layout` (DSA) and `plan_arena` (hybrids) figures,
TP sharding beats replication and stock, the H200 -> B300 direction, clear errors for bad
inputs, and (an engine boot per family, tiny DeepSeek-V3.2 and tiny Qwen3-Next, one after the
other in one interpreter) the planner's figure equals the engine's startup figure."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ulacache_vllm.engine.arena import sizing as arena_sizing
from ulacache_vllm.engine.dsa import sizing
from ulacache_vllm.engine.config import KVBackendError, UlaSettings
from ulacache_vllm.planner import PlannerError, load_model, make_cluster, plan
from ulacache_vllm.planner.__main__ import main
from ulacache_vllm.planner.capacity import vllm_config
from ulacache_vllm.planner.model import arena_specs, attention_token_bytes, dsa_specs
from ulacache_vllm.planner.presets import MODEL_PRESETS

L128K = 128 << 10
CLUSTERS = ("8xH200", "8xB300")


@pytest.fixture(scope="module")
def dsa_plans():
    """{(model, cluster): Plan} for the DSA presets at 128K-token requests."""
    out = {}
    for name in ("deepseek-v3.2", "glm-5-dsa"):
        model = load_model(name)
        for c in CLUSTERS:
            out[name, c] = plan(model, make_cluster(c), L128K)
    return out


def _spy(monkeypatch, module, name: str) -> list:
    """Replaces ``module.name`` by a wrapper; returns the list of what each call returned."""
    calls = []
    real = getattr(module, name)

    def spy(*a, **kw):
        calls.append(real(*a, **kw))
        return calls[-1]

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_presets_print_a_table(name, capsys):
    import os

    level = os.environ.get("VLLM_LOGGING_LEVEL")
    assert main([name, "--cluster", "8xH200", "--cluster", "8xB300"]) == 0
    # In-process use must not quiet the logs of every vLLM subprocess started after it.
    assert os.environ.get("VLLM_LOGGING_LEVEL") == level
    out = capsys.readouterr().out
    assert out.count("| scheme |") == 2 and out.count("Assumptions:") == 2
    assert "KV budget per GPU" in out and "weights per GPU" in out
    # Every printed multiple says what it counts: one note per table, one on the comparison
    # line (DSA models).
    dsa = bool(MODEL_PRESETS[name].config.get("index_topk"))
    assert out.count("requests that fit, not throughput") >= 2 + dsa
    if MODEL_PRESETS[name].config.get("index_topk"):
        for label in ("stock vLLM, TP-8 engines", "HiSparse, TP-8 engines, host copy per rank",
                      "vLLM 0.32 HiSparse, TP-8 engines, one host pool per node",
                      "ulacache TP-8 engines, ranks replicate", "ulacache TP-8 engines, shard",
                      "stock vLLM, DP engines (TP 1)", "HiSparse, DP engines (TP 1)",
                      "ulacache, DP engines (TP 1)"):
            assert f"| {label}" in out
        assert "ulacache against vLLM 0.32, cluster-wide: requests that fit" in out
        assert "vs best vLLM" in out and "vs HiSparse with one host pool per node" in out
    else:  # hybrids: stock HMA vs the arena, the DSA rows marked as not applying
        assert "| stock vLLM, HMA page geometry |" in out
        assert "| ulacache arena (natural page sizes) |" in out and "not a DSA model" in out
        assert "engine.arena_sizing.plan_arena" in out


def test_json_output(capsys):
    import json

    assert main(["deepseek-v3.2", "--json", "--request-tokens", "64K"]) == 0
    (p,) = json.loads(capsys.readouterr().out)
    assert p["request_tokens"] == 65536 and p["cluster"] == "8xH200"
    assert {r["key"] for r in p["rows"]} == {
        "stock", "hisparse_per_rank", "hisparse_shared", "ulacache_replicate", "ulacache_shard",
        "stock_dp", "hisparse_dp", "ulacache_dp"}
    assert p["anchor_key"] in {"stock", "hisparse_per_rank", "hisparse_shared", "stock_dp",
                               "hisparse_dp"} and p["base_key"] == "stock"
    dp = {r["key"]: r for r in p["rows"]}["ulacache_dp"]
    assert (dp["tp"], dp["dp"]) == (1, 8)
    assert dp["requests_per_cluster"] == 8 * dp["requests_per_engine"]


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_ulacache_rows_are_the_engines_plan_layout(dsa_plans, cluster, mode, monkeypatch):
    """Same inputs, same code path: the row is what engine.sizing.plan_layout returns."""
    p = dsa_plans["deepseek-v3.2", cluster]
    row = p.row("ulacache_shard" if mode == "shard" else "ulacache_replicate")
    cfg = vllm_config(p.model, p.cluster, L128K)
    cfg.additional_config = {}
    specs = dsa_specs(p.model, p.kv_dtype, p.block_size)
    settings = UlaSettings(host_pool_gib=row.host_pool_gib, tp_mode=mode)
    lay = sizing.plan_layout(cfg, specs, p.kv_budget, settings)
    assert row.tokens == lay.num_logical == row.layout.num_logical
    assert row.requests == lay.num_logical // L128K
    assert lay.shards == (8 if mode == "shard" else 1)

    calls = _spy(monkeypatch, sizing, "plan_layout")
    again = plan(p.model, p.cluster, L128K)
    assert calls, "the planner must size ulacache through engine.sizing.plan_layout"
    assert again.row(row.key).layout in calls


def test_stock_is_the_budget_over_all_kv_bytes_per_token(dsa_plans):
    """vLLM's sizing: KV budget / (MLA row + indexer key, all layers), whole 64-token blocks,
    less the null block; the same on every TP rank (max_tp_shards=1)."""
    p = dsa_plans["deepseek-v3.2", "8xH200"]
    per_token = 61 * (656 + 132)
    assert per_token == 48068
    blocks = p.kv_budget // (64 * per_token) - 1
    assert p.row("stock").tokens == blocks * 64
    assert p.row("stock").requests == blocks // (L128K // 64)


@pytest.mark.parametrize("name", ["deepseek-v3.2", "glm-5-dsa"])
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_shard_beats_replicate_and_stock_and_its_gain_dominates(dsa_plans, name, cluster):
    p = dsa_plans[name, cluster]
    stock, rep, shard = (p.row(k).cluster_requests
                         for k in ("stock", "ulacache_replicate", "ulacache_shard"))
    assert shard >= rep >= stock and shard > stock
    # TP sharding's gain (shard over replicate) is larger than the host tier's (replicate
    # over stock): the replicated indexer keys and rows, not the host pool, are what cost.
    assert shard / rep > rep / stock
    for key in ("hisparse_per_rank", "hisparse_shared"):
        assert shard > p.row(key).cluster_requests


def _hisparse_shared_by_hand(p) -> int:
    """vLLM 0.32 HiSparse, one host pool per node (TP 8 on one node), DeepSeek-V3.2 fp8_ds_mla,
    128K requests, worked out from its layout rules rather than its functions:
    - device blocks hold the indexer keys of 64 tokens x 61 layers (132 B each, 515,328 B),
      rounded up to a multiple of a hot-buffer page (64 rows x 656 B = 41,984 B): 545,792 B;
      MLA layers go into resident and hot groups of at most 12 layers (12 x 41,984 B fits the
      indexer page, 13 does not): 6 groups each;
    - a request admits 2048 indexer blocks + per group max_num_batched_tokens / 64 resident
      blocks + 2 x index_topk / 64 = 64 hot blocks; once it reads from the host it keeps
      2 resident tail pages per group; concurrency = 1 + (blocks - admission) / steady;
    - the host pool is 8 ranks x the host memory per GPU, in blocks of 61 x 64 x 656 B
      rounded up to 4 KiB (the shared region's alignment), less the null block, 2048 a
      request. Requests = the smaller bound, rounded down."""
    cl = p.cluster
    block = -(-(61 * 64 * 132) // (64 * 656)) * (64 * 656)
    assert block == 545_792
    blocks = p.kv_budget // block - 1
    per_req, groups = L128K // 64, -(-61 // 12)
    admission = per_req + groups * (cl.max_num_batched_tokens // 64) + groups * 64
    steady = per_req + groups * 2 + groups * 64
    device = 1 + (blocks - admission) / steady
    host_block = -(-(61 * 64 * 656) // 4096) * 4096
    host = (8 * int(cl.host_gib_per_gpu * (1 << 30)) // host_block - 1) / per_req
    return int(min(device, host))


@pytest.mark.parametrize("cluster,expected", [("8xH200", 30), ("8xB300", 122)])
def test_hisparse_shared_pool_anchor_by_hand(dsa_plans, cluster, expected):
    """The anchor a TP-8 user would pick, vLLM 0.32's HiSparse with one host pool per node,
    equals the count worked out by hand from its layout rules; ulacache TP shard's multiple
    over it is what the comparison line prints (requests that fit, not throughput)."""
    p = dsa_plans["deepseek-v3.2", cluster]
    row = p.row("hisparse_shared")
    assert row.error is None
    assert row.cluster_requests == row.requests == _hisparse_shared_by_hand(p) == expected
    ratio, extra = p.gain("ulacache_shard", "hisparse_shared")
    assert extra == p.row("ulacache_shard").cluster_requests - expected > 0
    from ulacache_vllm.planner.report import comparison

    assert f"{ratio:.1f}x ({extra:+,}) vs HiSparse with one host pool per node" in \
        comparison([p])


def test_dp_mode_is_dp_engines_not_a_replicated_tp_engine(dsa_plans):
    """DP mode is GPUs-many engines of TP 1, each with the dense weights whole, its own KV
    budget and host pool, and requests per cluster = per engine x engines; it is not the TP-8
    engine with replicating ranks (one engine's requests for the whole cluster)."""
    p = dsa_plans["deepseek-v3.2", "8xH200"]
    m, GIB = p.model, 1 << 30
    # By hand: FP8 weights, dense whole on the GPU, routed experts over the 8 GPUs.
    budget = int(140 * GIB * 0.9 - (m.dense_params + m.expert_params / 8) - 10 * GIB)
    d = p.dp_engines
    assert (d.cluster.tp, d.cluster.dp) == (1, 8) and d.kv_budget == budget < p.kv_budget
    # Stock on a DP engine: budget / (MLA row + indexer key, 61 layers), 64-token blocks.
    stock = p.row("stock_dp")
    blocks = budget // (64 * 61 * (656 + 132)) - 1
    assert (stock.tp, stock.dp) == (1, 8)
    assert stock.requests == blocks // (L128K // 64)
    assert stock.cluster_requests == 8 * stock.requests > p.row("stock").cluster_requests
    # ulacache DP: plan_layout at TP 1 on the DP engine's budget, times 8 engines.
    dp, rep = p.row("ulacache_dp"), p.row("ulacache_replicate")
    cfg = vllm_config(m, d.cluster, L128K)
    cfg.additional_config = {}
    lay = sizing.plan_layout(cfg, dsa_specs(m, p.kv_dtype, p.block_size), budget,
                             UlaSettings(host_pool_gib=dp.host_pool_gib))
    assert dp.tokens == lay.num_logical and lay.shards == 1
    assert dp.cluster_requests == 8 * dp.requests == 8 * (lay.num_logical // L128K)
    assert (rep.tp, rep.dp) == (8, 1) and rep.cluster_requests == rep.requests
    assert dp.cluster_requests > rep.cluster_requests


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_multiples_are_against_the_strongest_vllm_row(dsa_plans, cluster):
    """The "vs best vLLM" column divides by the vLLM row (stock or HiSparse, TP or DP engines)
    holding the most requests: HiSparse on DP engines on both presets, above the shared-pool
    HiSparse of a TP-8 engine; ulacache's best still holds more."""
    p = dsa_plans["deepseek-v3.2", cluster]
    vllm = {k: p.row(k).cluster_requests for k in
            ("stock", "hisparse_per_rank", "hisparse_shared", "stock_dp", "hisparse_dp")}
    assert p.anchor_key == max(vllm, key=lambda k: (vllm[k], k == "hisparse_dp"))
    assert p.anchor_key == "hisparse_dp" and vllm["hisparse_dp"] > vllm["hisparse_shared"]
    best_ula = max(p.row(k).cluster_requests for k in ("ulacache_shard", "ulacache_dp"))
    assert best_ula > vllm[p.anchor_key]
    from ulacache_vllm.planner.report import table

    ratio, extra = p.gain("ulacache_shard", p.anchor_key)
    assert f"| {ratio:.1f}x ({extra:+,}) |" in table(p)


def test_b300_gains_more_requests_than_h200(dsa_plans):
    """DeepSeek-V3.2 FP8, 128K requests: ulacache TP shard adds more requests over stock on
    8xB300 than on 8xH200 (both with 192 GiB of host per GPU). As a ratio it is the other way
    round: B300's larger HBM also lifts stock (26 vs 6 requests), so the claim holds for
    requests gained, not for the multiple."""
    h = dsa_plans["deepseek-v3.2", "8xH200"]
    b = dsa_plans["deepseek-v3.2", "8xB300"]
    (h_ratio, h_extra), (b_ratio, b_extra) = h.gain("ulacache_shard"), b.gain("ulacache_shard")
    assert b_extra > h_extra > 0
    assert h_ratio > b_ratio > 1


@pytest.mark.parametrize("model,mode", [("glm-5-dsa", "shard"), ("glm-5-dsa", "replicate"),
                                        ("deepseek-v3.2", "shard"), ("deepseek-v3.2", "replicate")])
def test_capped_host_pool_is_the_largest_that_starts(dsa_plans, model, mode):
    """8xH200: a 192 GiB pool per rank's indexer keys leave the device no room for one step,
    so the row uses the largest pool the engine starts with (MiB steps)."""
    p = dsa_plans[model, "8xH200"]
    row = p.row("ulacache_shard" if mode == "shard" else "ulacache_replicate")
    assert "capped at" in row.note
    gib = row.host_pool_gib
    assert gib < p.cluster.host_gib_per_gpu
    cfg = vllm_config(p.model, p.cluster, L128K)
    cfg.additional_config = {}
    specs = dsa_specs(p.model, p.kv_dtype, p.block_size)
    lay = sizing.plan_layout(cfg, specs, p.kv_budget, UlaSettings(host_pool_gib=gib,
                                                                  tp_mode=mode))
    assert lay.num_logical == row.tokens
    with pytest.raises(KVBackendError, match="device pool too small"):
        sizing.plan_layout(cfg, specs, p.kv_budget,
                           UlaSettings(host_pool_gib=gib + 1 / 1024, tp_mode=mode))


@pytest.mark.parametrize("name", ["qwen3-next-80b", "gpt-oss-120b"])
def test_arena_rows_are_the_engines_plan_arena(name, monkeypatch):
    """Same inputs, same code path: the arena row is what engine.arena_sizing.plan_arena
    returns for the engine's arena specs and the KV budget; its requests are the layout's
    max_requests (the engine's startup figure), less the null page."""
    model = load_model(name)
    calls = _spy(monkeypatch, arena_sizing, "plan_arena")
    for tokens in (1280, L128K):
        p = plan(model, make_cluster("8xH200"), tokens)
        row = p.row("arena")
        assert calls and row.layout is calls[-1][0], "the arena row must come from plan_arena"
        lay = row.layout
        assert lay.budget_bytes == p.kv_budget and lay.max_model_len == tokens
        assert row.requests == lay.max_requests > 0 and row.tokens == row.requests * tokens
        assert row.requests == ((lay.total_bytes - lay.null_page_bytes)
                                // lay.request_bytes(tokens))
        # The engine's page geometry: 32-token attention pages, one state page of exactly
        # the state's bytes per GDN layer (no padding to the attention page).
        specs = arena_specs(p.model, p.kv_dtype, p.cluster.tp, tokens)
        by_kind = {g.kind: g for g in lay.groups}
        for g in lay.groups:
            assert g.layer_page_bytes == specs[g.layer_names[0]].page_size_bytes
            if not g.kind.startswith("state"):
                assert g.block_size == 32
        # New pages zeroed only where vLLM zeroes its own (Mamba state; one KV precision
        # otherwise).
        assert lay.zero_new_pages == name.startswith("qwen3")
        if name.startswith("qwen3"):
            assert by_kind["state"].pages_per_max_request == 1
            padded = p.block_size * attention_token_bytes(p.model, p.kv_dtype, p.cluster.tp)
            assert by_kind["state"].layer_page_bytes < padded  # stock's page: padded
        else:  # vLLM's sliding admission cap: window - 1 + tokens in flight, + 1 page
            cap = min(model.config["sliding_window"] - 1 + p.cluster.max_num_batched_tokens,
                      tokens)
            assert by_kind["sliding"].pages_per_max_request == -(-cap // 32) + 1
        assert p.row("ulacache_shard").error and p.row("hisparse_shared").error


def test_arena_beats_stock_hma_where_stock_pads_states():
    """Qwen3-Next: stock HMA pads every GDN state to a 144-token attention page and keeps two
    per layer ('align'); the arena's exact state pages hold more short requests and no fewer
    long ones."""
    model = load_model("qwen3-next-80b")
    for cluster in CLUSTERS:
        short = plan(model, make_cluster(cluster), 1280)
        assert short.row("arena").requests > 1.2 * short.row("hma_stock").requests
        long = plan(model, make_cluster(cluster), L128K)
        assert long.row("arena").requests >= long.row("hma_stock").requests > 0


def test_bad_inputs_name_the_fix(capsys):
    with pytest.raises(PlannerError, match=r"not a preset \(deepseek-v3.2.*Pass a preset"):
        load_model("deepseek-v9")
    with pytest.raises(PlannerError, match=r"--tp 3 does not divide --gpus 8.*one of "
                                           r"\[1, 2, 4, 8\]"):
        make_cluster("8xH200", tp=3)
    with pytest.raises(PlannerError, match=r"--dp 4 .*pass --dp 1"):
        make_cluster("8xH200", tp=8, dp=4)
    with pytest.raises(PlannerError, match=r"unknown cluster"):
        make_cluster("8xH100")
    with pytest.raises(PlannerError, match=r"max_position_embeddings 163840\); pass "
                                           r"--request-tokens 163840 or less"):
        plan(load_model("deepseek-v3.2"), make_cluster("8xH200"), 200_000)
    with pytest.raises(PlannerError, match="no KV memory left.*larger --tp"):
        plan(load_model("deepseek-v3.2"), make_cluster("8xH200", tp=1), L128K,
             experts_over="tp")
    # The CLI prints the message and exits 2, no traceback.
    assert main(["deepseek-v3.2", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tp 3 does not divide") and "Traceback" not in err
    with pytest.raises(SystemExit):  # argparse: unknown cluster preset
        main(["deepseek-v3.2", "--cluster", "8xA100"])


def test_importing_the_planner_does_not_import_vllm():
    code = "import sys, ulacache_vllm.planner; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# Both engines boot in one interpreter, one after the other, with the engine core in-process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0): a startup figure is the engine core's KV sizing, the same
# in either process layout, and one interpreter spares the per-engine imports and process
# spawns of two separate boots. Each engine only starts and reports its figure.
STARTUP_SCRIPT = r"""
import gc
from vllm import LLM
out = {}
kv = ARGS["kv_bytes"]
llm = LLM(model=ARGS["models"]["deepseek_v32"], dtype="float32", enforce_eager=True,
          max_model_len=1024, max_num_seqs=8, seed=0, kv_backend="ulacache",
          kv_cache_memory_bytes=kv, ula_host_pool_gib=ARGS["host_gib"], **ARGS["path"])
usage = llm.collective_rpc("ulacache_usage")[0]
out["deepseek_v32"] = {"num_logical": usage["num_logical"], "block_size": usage["block_size"]}
del llm
gc.collect()
llm = LLM(model=ARGS["models"]["qwen3_next"], dtype="bfloat16", enforce_eager=True,
          max_model_len=1024, max_num_batched_tokens=1024, seed=0, kv_backend="ulacache",
          kv_cache_memory_bytes=kv, mamba_ssm_cache_dtype="float32",
          enable_prefix_caching=False)  # the planner's arena row models caching off
usage = llm.collective_rpc("ulacache_usage")[0]
out["qwen3_next"] = {k: usage[k] for k in ("max_requests", "kinds", "alignment")}
emit(out)
"""
STARTUP_KV_BYTES = 20_000_000
STARTUP_HOST_GIB = 0.01


@pytest.fixture(scope="module")
def startup_figures(tiny_model):
    """{family: the engine's startup figures} of tiny DeepSeek-V3.2 (with a host pool, the
    reference MLA path's schedule) and tiny Qwen3-Next booted with ``STARTUP_KV_BYTES``."""
    from _vllm_subprocess import mla_path_kwargs, run_vllm_script

    models = {f: str(tiny_model(f)) for f in ("deepseek_v32", "qwen3_next")}
    return run_vllm_script(STARTUP_SCRIPT, timeout=900, args={
        "models": models, "kv_bytes": STARTUP_KV_BYTES, "host_gib": STARTUP_HOST_GIB,
        # block 16, no chunked prefill, 2048-token steps
        "path": mla_path_kwargs("reference")}, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


@pytest.mark.engine
@pytest.mark.parametrize("family", ["deepseek_v32", "qwen3_next"])
def test_planner_matches_the_engines_startup_figure(tiny_model, startup_figures, family):
    """A tiny model booted with a given KV budget holds exactly what the planner computes from
    its config.json for the same budget: DeepSeek-V3.2 (with a host pool) the logical tokens
    of engine.sizing's layout; Qwen3-Next (GDN + full attention, the arena) the max concurrent
    requests of max_model_len the engine logs at startup, with the same page kinds, sizes and
    alignment."""
    from _vllm_subprocess import mla_path_kwargs

    model = tiny_model(family)
    kv_bytes = STARTUP_KV_BYTES
    got = startup_figures[family]
    if family == "qwen3_next":
        # The SSM state in float32 on both sides: vLLM's CPU build forces it on AVX512-BF16
        # hosts and keeps the model dtype elsewhere; given, it is the same on every host.
        shape = load_model(model)
        shape.mamba_ssm_cache_dtype = "float32"
        p = plan(shape, make_cluster(gpus=1, tp=1, host_gib_per_gpu=0,
                                     kv_bytes_per_gpu=kv_bytes, max_num_batched_tokens=1024),
                 1024, kv_dtype="bfloat16")
        row = p.row("arena")
        assert row.error is None
        lay = row.layout
        assert {g.kind: {"layers": len(g.layer_names), "page_bytes": g.page_bytes,
                         "block_size": g.block_size, "band": g.band}
                for g in lay.groups} == {k: {f: v[f] for f in ("layers", "page_bytes",
                                                                "block_size", "band")}
                                         for k, v in got["kinds"].items()}
        assert lay.alignment == got["alignment"]
        assert row.requests == got["max_requests"] > 0
        return
    host_gib = STARTUP_HOST_GIB
    path = mla_path_kwargs("reference")  # block 16, no chunked prefill, 2048-token steps
    p = plan(load_model(model),
             make_cluster(gpus=1, tp=1, host_gib_per_gpu=host_gib, kv_bytes_per_gpu=kv_bytes,
                          max_num_batched_tokens=path["max_num_batched_tokens"],
                          max_num_seqs=8, chunked_prefill=False),
             1024, kv_dtype="float32", block_size=16, ula_host_pool_gib=host_gib)
    row = p.row("ulacache_dp")
    assert got["block_size"] == 16
    assert row.error is None and row.tokens == got["num_logical"] > 0
