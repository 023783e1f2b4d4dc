"""Concurrent requests of one length that fit a cluster, per KV scheme.

Invariants: every figure comes from the code that sizes the real thing. ulacache rows call
the engine's own sizing, looked up on its module at call time: `engine.dsa.sizing.plan_layout`
for DSA models, `engine.arena.sizing.plan_arena` (the hybrids' arena) for hybrids; stock and
HiSparse rows call vLLM's own `get_kv_cache_groups` / `get_kv_cache_config_from_groups` /
`get_max_concurrency_for_kv_cache_config` and HiSparse layout functions. All of them run on
a namespace standing in for `VllmConfig`; the planner's own code builds only the inputs (the
per-rank layer specs each engine would build, the budget). A vLLM block pool's null block and
the arena's null page are never counted as capacity. DSA plans deploy the same GPUs twice: as
the cluster's TP-P engines and as DP engines of TP 1 (`dp_plan`); multiples are requests that
fit, taken against the vLLM row holding the most (`Plan.anchor_key`) and against stock.
DeepSeek-V4 is the exception (`v4.py`): its figures are the planner's arithmetic for the v4
line's design (the CSA rows on the host tier, the rest at natural page sizes), compared with
vLLM's own functions and the engine's `plan_arena` before they are printed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .assumptions import assumptions
from .budget import GIB, dp_plan, hisparse_shared_ranks, kv_budget, weights_per_gpu  # noqa: F401
from .model import ModelShape, PlannerError, arena_specs, dsa_specs, hybrid_specs, kv_dtype_of
from .presets import CLUSTER_PRESETS, host_memory_note
from .records import ULA_KEYS, VLLM_KEYS, Cluster, Plan, Row  # noqa: F401  (re-exported)
from .standin import vllm_config  # noqa: F401  (re-exported: tests build it from here)

DSA_BLOCK_SIZE = 64  # FlashMLA sparse (DeepSeek-V3.2 / GLM DSA on GPU) reads 64-token pages


def make_cluster(preset: str | None = None, **given: Any) -> Cluster:
    """A cluster from a preset and/or explicit figures (None values are left to the preset).
    TP x DP must equal the GPU count; DP defaults to GPUs / TP."""
    fields = {k: v for k, v in given.items() if v is not None}
    if preset is not None:
        if preset not in CLUSTER_PRESETS:
            raise PlannerError(f"unknown cluster {preset!r}; presets: "
                               f"{', '.join(CLUSTER_PRESETS)} (or give --gpus, --gpu-gib, "
                               f"--host-gib-per-gpu and --tp without --cluster)")
        p = CLUSTER_PRESETS[preset]
        base = dict(name=preset, gpus=p.gpus, gpus_per_node=p.gpus_per_node,
                    gpu_gib=p.gpu_gib, host_gib_per_gpu=p.host_gib_per_gpu, tp=p.tp,
                    max_num_batched_tokens=p.max_num_batched_tokens,
                    max_num_seqs=p.max_num_seqs)
        if "max_num_batched_tokens" in fields:
            base["batch_tokens_defaulted"] = False
        changed = [f"{k}={v:g}" for k, v in fields.items()
                   if k in ("gpus", "gpu_gib", "host_gib_per_gpu", "tp", "dp", "gpu_util",
                            "activation_reserve_gib") and v != base.get(k)]
        if changed:
            base["name"] = f"{preset} ({', '.join(changed)})"
        base.update(fields)
        host_source = p.host_note if base["host_gib_per_gpu"] == p.host_gib_per_gpu else ""
        base["notes"] = (p.note, host_memory_note(base["host_gib_per_gpu"], host_source))
        fields = base
    else:
        missing = [f for f in ("gpus", "tp", "host_gib_per_gpu") if f not in fields]
        if "gpu_gib" not in fields and "kv_bytes_per_gpu" not in fields:
            missing.append("gpu_gib")
        if missing:
            flags = ", ".join("--" + m.replace("_", "-") for m in missing)
            raise PlannerError(f"no --cluster preset and {flags} not given: pass a preset "
                               f"({', '.join(CLUSTER_PRESETS)}) or all of them")
        fields.setdefault("gpu_gib", 0.0)
        if "max_num_batched_tokens" in fields:
            fields.setdefault("batch_tokens_defaulted", False)
        fields.setdefault("name", f"{fields['gpus']} GPUs")
        fields.setdefault("notes", (host_memory_note(fields["host_gib_per_gpu"], ""),))
    gpus = fields["gpus"]
    tp = fields.setdefault("tp", gpus)
    if tp < 1 or gpus < 1 or gpus % tp:
        divisors = [d for d in range(1, gpus + 1) if gpus % d == 0] if gpus > 0 else []
        raise PlannerError(f"--tp {tp} does not divide --gpus {gpus}: each engine is TP GPUs "
                           f"and the cluster is DP engines. Pass --tp one of {divisors} or "
                           f"change --gpus.")
    dp = fields.setdefault("dp", gpus // tp)
    if tp * dp != gpus:
        raise PlannerError(f"--tp {tp} x --dp {dp} = {tp * dp} GPUs, but the cluster has "
                           f"{gpus}: pass --dp {gpus // tp} (or leave --dp out).")
    if not 0 < fields.get("gpu_util", 0.9) <= 1:
        raise PlannerError("--gpu-util must be in (0, 1] (vLLM's gpu_memory_utilization)")
    return Cluster(**fields)


# ---------------------------------------------------------------- schemes

def _blocks_per_request(request_tokens: int, block_size: int) -> int:
    return -(-request_tokens // block_size)


def _vllm_concurrency(cfg, kv_cfg) -> float:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    usable = dataclasses.replace(kv_cfg, num_blocks=kv_cfg.num_blocks - 1)  # null block
    return get_max_concurrency_for_kv_cache_config(cfg, usable)


def stock_row(plan: Plan, specs: dict, key: str, label: str, mamba_cache_mode="none") -> Row:
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    cfg = vllm_config(plan.model, plan.cluster, plan.request_tokens,
                      mamba_cache_mode=mamba_cache_mode)
    groups = get_kv_cache_groups(cfg, dict(specs))
    kv_cfg = get_kv_cache_config_from_groups(cfg, groups, plan.kv_budget)
    conc = _vllm_concurrency(cfg, kv_cfg)
    n = int(conc)
    return Row(key, label, tokens=int(conc * plan.request_tokens), requests=n,
               cluster_requests=n * plan.cluster.dp, device_bytes=plan.kv_budget,
               tp=plan.cluster.tp, dp=plan.cluster.dp)


def hisparse_row(plan: Plan, specs: dict, shared: bool, key: str | None = None,
                 label: str | None = None) -> Row:
    from vllm.v1.hisparse.layout import (
        get_hisparse_kv_cache_config,
        get_hisparse_kv_cache_groups,
        get_hisparse_steady_state_concurrency,
    )
    from vllm.v1.hisparse.runtime import get_hisparse_host_block_stride

    cl = plan.cluster
    ranks = hisparse_shared_ranks(cl) if shared else 1
    key = key or ("hisparse_shared" if shared else "hisparse_per_rank")
    label = label or (f"vLLM 0.32 HiSparse, TP-{cl.tp} engines, one host pool per node"
                      if shared else f"HiSparse, TP-{cl.tp} engines, host copy per rank")
    if shared and ranks == 1:
        why = "TP=1" if cl.tp == 1 else f"TP={cl.tp} spans nodes of {cl.gpus_per_node} GPUs"
        return Row(key, label, error=f"no shared pool ({why}): same as a host copy per rank")
    cfg = vllm_config(plan.model, cl, plan.request_tokens, layout="BLHNC", hisparse=True)
    host_budget = int(cl.host_gib_per_gpu * GIB) * ranks
    try:
        groups = get_hisparse_kv_cache_groups(cfg, dict(specs))
        kv_cfg = get_hisparse_kv_cache_config(cfg, groups, plan.kv_budget, host_budget)
    except ValueError as e:
        return Row(key, label, error=f"does not start: {e}")
    source = next(g for g in kv_cfg.kv_cache_groups if g.host_resident)
    stride = get_hisparse_host_block_stride(source.kv_cache_spec.page_size_bytes,
                                            use_shared_host_pool=shared)
    host_blocks = host_budget // stride
    kv_cfg = dataclasses.replace(kv_cfg, num_blocks=kv_cfg.num_blocks - 1,
                                 hisparse_host_num_blocks=host_blocks - 1)  # null blocks
    conc = get_hisparse_steady_state_concurrency(cfg, kv_cfg)
    n = int(conc)
    return Row(key, label, tokens=int(conc * plan.request_tokens), requests=n,
               cluster_requests=n * cl.dp, device_bytes=plan.kv_budget,
               host_bytes=host_blocks * stride // ranks, tp=cl.tp, dp=cl.dp,
               note=(f"host pool {host_blocks * stride / GIB:.0f} GiB shared by {ranks} ranks"
                     if shared else "each rank pins its own copy of every MLA row"
                     if cl.tp > 1 else "each engine's own pinned host copy of its MLA rows"))


def ulacache_row(plan: Plan, specs: dict, tp_mode: str, host_pool_gib: float | None = None,
                 key: str | None = None, label: str | None = None) -> Row:
    """The engine's layout for this budget. The host pool is ``host_pool_gib`` when given
    (the engine's behaviour as is, a defaulted step budget lowered if it must be), else the
    largest pool up to the host memory per GPU with which the engine starts with the
    scheduler's step budget unchanged: every host token keeps its indexer key on the device,
    so a larger pool leaves the device pool too small for one step (plan_layout decides each
    probe)."""
    from ulacache_vllm.engine.dsa import sizing
    from ulacache_vllm.engine.config import KVBackendError, UlaSettings

    cl = plan.cluster
    key = key or ("ulacache_shard" if tp_mode == "shard" else "ulacache_replicate")
    label = label or (f"ulacache TP-{cl.tp} engines, shard" if tp_mode == "shard"
                      else f"ulacache TP-{cl.tp} engines, ranks replicate")
    if tp_mode == "shard" and cl.tp == 1:
        return Row(key, label, error="TP=1: nothing to shard (same as ulacache DP)")
    cfg = vllm_config(plan.model, cl, plan.request_tokens)
    if host_pool_gib is None:
        cfg.additional_config = {}  # the step budget as configured: never lowered

    def layout(gib: float):
        settings = UlaSettings(host_pool_gib=gib, tp_mode=tp_mode)
        return sizing.plan_layout(cfg, dict(specs), plan.kv_budget, settings)

    capped = None
    gib = host_pool_gib if host_pool_gib is not None else cl.host_gib_per_gpu
    try:
        lay = layout(gib)
    except KVBackendError as e:
        if host_pool_gib is not None or "device pool too small" not in str(e):
            return Row(key, label, error=f"does not start: {e}")
        lay, capped, err = _largest_starting_pool(plan, tp_mode, layout,
                                                  sizing.split_specs(specs)[0])
        if lay is None:
            return Row(key, label, error=f"does not start with any host pool: {err}")
        gib = capped
    n = (lay.num_logical // lay.block_size) // _blocks_per_request(plan.request_tokens,
                                                                    lay.block_size)
    M = sum(lay.mla_row_bytes.values())
    note = (f"per rank: {lay.device_slots} device + {lay.host_slots} host"
            + (f" + {lay.remote_slots} remote-buffer" if lay.shards > 1 else "")
            + " rows/layer")
    if capped is not None:
        note += (f"; host pool capped at {capped:.3f} GiB/GPU: a larger one's indexer keys "
                 f"leave the device no room for one step, and the device pool is at its "
                 f"minimum (a smaller --ula-host-pool-gib buys device rows back)")
    if lay.batch_tokens_lowered:
        note += (f"; max_num_batched_tokens lowered {lay.batch_tokens_lowered[0]} -> "
                 f"{lay.batch_tokens_lowered[1]}")
    return Row(key, label, tokens=lay.num_logical, requests=n, cluster_requests=n * cl.dp,
               device_bytes=plan.kv_budget, host_bytes=lay.host_slots * M, note=note,
               layout=lay, host_pool_gib=gib, tp=cl.tp, dp=cl.dp)


def _largest_starting_pool(plan: Plan, tp_mode: str, layout, mla_specs: dict):
    """(layout, GiB, last error) of the largest host pool, in MiB steps, that starts: from the
    least that holds one request's share (the engine's own floor) up to the host memory."""
    from ulacache_vllm.engine.config import KVBackendError

    M = sum(s.page_size_bytes // s.block_size for s in mla_specs.values())
    S = plan.cluster.tp if tp_mode == "shard" else 1
    need = -(-plan.request_tokens // S) + plan.block_size  # one share, whole blocks
    lo, hi = -(-need * M // (1 << 20)), int(plan.cluster.host_gib_per_gpu * 1024)
    try:
        best = layout(lo / 1024)
    except KVBackendError as e:
        return None, None, e
    while lo < hi:  # lo starts; find the largest that does
        mid = (lo + hi + 1) // 2
        try:
            best, lo = layout(mid / 1024), mid
        except KVBackendError:
            hi = mid - 1
    return best, lo / 1024, None


def arena_row(plan: Plan) -> Row:
    """The ulacache arena (hybrid models): `engine.arena_sizing.plan_arena`, the call the
    engine makes at startup, on the specs the engine builds under `--kv-backend ulacache`
    (`model.arena_specs`) and this budget; requests = the layout's `max_requests` (requests of
    max_model_len = the request length), the figure the engine logs at startup."""
    from ulacache_vllm.engine.arena import sizing as arena_sizing
    from ulacache_vllm.engine.config import KVBackendError, UlaSettings

    cl, L = plan.cluster, plan.request_tokens
    key, label = "arena", "ulacache arena (natural page sizes)"
    cfg = vllm_config(plan.model, cl, L)
    specs = arena_specs(plan.model, plan.kv_dtype, cl.tp, L)
    try:
        lay, _ = arena_sizing.plan_arena(cfg, specs, plan.kv_budget, UlaSettings())
    except KVBackendError as e:
        return Row(key, label, error=f"does not start: {e}")
    n = lay.max_requests
    pages = ", ".join(f"{g.kind} {len(g.layer_names)} x {g.layer_page_bytes} B"
                      for g in lay.groups)
    exact = sum(g.page_bytes * g.pages_per_max_request for g in lay.groups)
    return Row(key, label, tokens=n * L, requests=n, cluster_requests=n * cl.dp,
               device_bytes=plan.kv_budget, layout=lay, tp=cl.tp, dp=cl.dp,
               note=(f"{lay.request_bytes() / 2**20:.1f} MiB per request per rank; pages "
                     f"{pages}; {lay.alignment} B alignment "
                     f"(+{lay.request_bytes() / exact - 1:.1%} on the exact pages)"))


# ---------------------------------------------------------------- DP engines

def dp_rows(p: Plan, specs: dict) -> list[Row]:
    """stock, HiSparse and ulacache on DP engines of TP 1: nothing replicated across ranks,
    every engine's host pool its own. Requests per cluster = per engine x GPUs."""
    d = p.dp_engines
    labels = (("stock_dp", "stock vLLM, DP engines (TP 1)"),
              ("hisparse_dp", "HiSparse, DP engines (TP 1), host pool per engine"),
              ("ulacache_dp", "ulacache, DP engines (TP 1)"))
    if isinstance(d, str):
        return [Row(k, lab, error=f"DP engines of TP 1 do not fit: {d}") for k, lab in labels]
    return [stock_row(d, specs, *labels[0]),
            hisparse_row(d, specs, shared=False, key=labels[1][0], label=labels[1][1]),
            ulacache_row(d, specs, "replicate", p.ula_host_pool_gib, *labels[2])]


# ---------------------------------------------------------------- the plan

def plan(model: ModelShape, cluster: Cluster, request_tokens: int, *,
         kv_dtype: str | None = None, experts_over: str = "gpus",
         block_size: int | None = None, ula_host_pool_gib: float | None = None,
         check_vllm: bool = True) -> Plan:
    """``check_vllm`` (DeepSeek-V4 only): compare its arithmetic with vLLM's own functions
    first (imports vLLM); the other models always size through vLLM's and the engine's code."""
    if request_tokens < 1:
        raise PlannerError("--request-tokens must be at least 1")
    if model.max_len and request_tokens > model.max_len:
        raise PlannerError(
            f"a request of {request_tokens} tokens is longer than {model.name} supports "
            f"(max_position_embeddings {model.max_len}); pass --request-tokens "
            f"{model.max_len} or less.")
    if experts_over not in ("gpus", "tp"):
        raise PlannerError("--experts-over must be 'gpus' (expert parallelism over TP x DP) "
                           "or 'tp'")
    if model.kind == "v4":  # DeepSeek-V4: its own rows and per-kind figures (v4.py)
        from .v4 import plan_v4

        return plan_v4(model, cluster, request_tokens, kv_dtype=kv_dtype,
                       experts_over=experts_over, block_size=block_size,
                       ula_host_pool_gib=ula_host_pool_gib, check=check_vllm)
    kvd = kv_dtype_of(model, kv_dtype)
    budget, w = kv_budget(model, cluster, experts_over)
    bs = block_size or (DSA_BLOCK_SIZE if model.kind == "dsa" else 16)
    p = Plan(model, cluster, request_tokens, kvd, bs, w, budget,
             ula_host_pool_gib=ula_host_pool_gib)
    if model.kind == "dsa":
        specs = dsa_specs(model, kvd, bs)
        tp = cluster.tp
        if tp > 1:
            p.rows.append(stock_row(p, specs, "stock",
                                    f"stock vLLM, TP-{tp} engines (KV replicated per rank)"))
            p.rows.append(hisparse_row(p, specs, shared=False))
        else:
            why = "TP=1: the cluster's engines are the DP engines below"
            p.rows.append(Row("stock", "stock vLLM, TP engines", error=why))
            p.rows.append(Row("hisparse_per_rank", "HiSparse, TP engines, host copy per rank",
                              error=why))
        p.rows.append(hisparse_row(p, specs, shared=True))
        if tp > 1:
            p.rows.append(ulacache_row(p, specs, "replicate", ula_host_pool_gib))
        else:
            p.rows.append(Row("ulacache_replicate", "ulacache TP engines, ranks replicate",
                              error="TP=1: the cluster's engines are the DP engines below"))
        p.rows.append(ulacache_row(p, specs, "shard", ula_host_pool_gib))
        p.dp_engines = dp_plan(p, experts_over)
        p.rows.extend(dp_rows(p, specs))
    else:
        specs, bs = hybrid_specs(model, kvd, cluster.tp, block_size=bs)
        p.block_size = bs
        mode = "align" if model.kind == "gdn" else "none"
        p.rows.append(stock_row(p, specs, "hma_stock", "stock vLLM, HMA page geometry",
                                mamba_cache_mode=mode))
        p.rows.append(arena_row(p))
        why = "not a DSA model: HiSparse serves sparse-MLA (DSA) models only"
        for key, label in (("hisparse_per_rank", "HiSparse, host copy per rank"),
                           ("hisparse_shared", "vLLM 0.32 HiSparse, one host pool per node")):
            p.rows.append(Row(key, label, error=why))
        why = ("not a DSA model: the host tier and TP sharding serve sparse-MLA (DSA) models; "
               "ulacache serves hybrids through the arena row above")
        for key, label in (("ulacache_dp", "ulacache DSA host tier (DP engines / replicate)"),
                           ("ulacache_shard", "ulacache TP shard")):
            p.rows.append(Row(key, label, error=why))
    p.assumptions = assumptions(p, experts_over)
    return p
