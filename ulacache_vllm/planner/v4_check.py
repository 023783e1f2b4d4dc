"""The DeepSeek-V4 arithmetic (``v4_layout`` / ``v4_sizing``) against vLLM 0.32's own code and
the engine's arena sizing, on every deployment of a plan: V4's specs built with vLLM's spec
classes from the parameters V4's ``get_kv_cache_spec`` methods pass (their padding and page
sizes are vLLM's), vLLM's ``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` /
``get_max_concurrency_for_kv_cache_config`` (block-outermost layout) and its sliding-window
caps, and ``engine.arena.sizing.plan_arena`` on the arena kinds. A difference is a planner bug:
the plan is refused, naming it. Imports vLLM."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from .errors import PlannerError
from .standin import vllm_config
from .v4_layout import ARENA_MAX_GRANULES, ARENA_MIN_ALIGNMENT, Cache, cdiv

if TYPE_CHECKING:
    from .records import Plan


def vllm_specs(caches: list[Cache], cfg: dict[str, Any]) -> dict:
    """One rank's V4 specs, in vLLM's registration order, as its V4 modules declare them."""
    import torch
    from vllm.v1.kv_cache_interface import (
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        get_kv_quant_mode,
    )

    from .v4_layout import layer_specs

    fp8 = dict(cache_dtype_str="fp8_ds_mla", model_version="deepseek_v4",
               kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"), state_content_bytes=584)
    common = dict(num_kv_heads=1, max_tp_shards=1, alignment=576)
    hd, ihd = cfg.get("head_dim", 512), cfg["index_head_dim"]
    state_dim = {"c4_state": 2 * 2 * hd, "c4_idx_state": 2 * 2 * ihd, "c128_state": 2 * hd}
    out = {}
    for name, c in layer_specs(caches):
        if c.key in ("csa", "hca"):  # DeepseekV4Attention.get_kv_cache_spec
            out[name] = MLAAttentionSpec(block_size=c.block_size, head_size=hd,
                                         dtype=torch.uint8, tokens_per_state=c.tokens_per_row,
                                         **common, **fp8)
        elif c.key == "idx":  # DeepseekV4IndexerCache.get_kv_cache_spec
            out[name] = MLAAttentionSpec(block_size=c.block_size, head_size=c.row_bytes,
                                         dtype=torch.uint8, tokens_per_state=c.tokens_per_row,
                                         **common)
        elif c.key == "swa":  # DeepseekV4SWACache.get_kv_cache_spec
            out[name] = SlidingWindowMLASpec(block_size=c.block_size, head_size=hd,
                                             dtype=torch.uint8, sliding_window=c.window,
                                             bounded_replay=False, **common, **fp8)
        else:  # CompressorStateCache.get_kv_cache_spec
            out[name] = SlidingWindowMLASpec(block_size=c.block_size, head_size=state_dim[c.key],
                                             dtype=torch.float32, sliding_window=c.window,
                                             **common)
    return out


def _fail(what: str, ours: Any, vllms: Any) -> None:
    raise PlannerError(f"planner bug: DeepSeek-V4 {what} differs from vLLM's / the engine's "
                       f"({ours} here, {vllms} there); not printing figures that disagree")


def check_deployment(p: Plan, det: Any, d: Any) -> None:
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
        get_max_concurrency_for_kv_cache_config,
    )

    from ulacache_vllm.engine.arena import sizing as arena_sizing
    from ulacache_vllm.engine.config import KVBackendError, UlaSettings

    plan, L, s = d.plan, d.plan.request_tokens, det.sched
    cfg = vllm_config(plan.model, plan.cluster, L, layout="BLHNC")
    cfg.max_concurrent_batches = s.in_flight_batches
    cfg.max_in_flight_tokens = s.in_flight_tokens
    specs = vllm_specs(det.caches, plan.model.config)
    by_name = {c.name(i): c for c in det.caches for i in c.layers}
    for name, spec in specs.items():
        c = by_name[name]
        if (spec.page_size_bytes, spec.real_page_size_bytes) != (c.page, c.raw_page):
            _fail(f"page of {name}", (c.page, c.raw_page),
                  (spec.page_size_bytes, spec.real_page_size_bytes))
        if c.family == "sliding":
            res = min(spec.max_admission_blocks_per_request(1, L), cdiv(L, spec.block_size))
            if res != c.resident_pages(L):
                _fail(f"window pages of {name}", c.resident_pages(L), res)
    groups = get_kv_cache_groups(cfg, dict(specs))
    ours = sorted((sorted(n for n, _ in g.members), g.page) for g in d.stock.groups)
    theirs = sorted((sorted(g.layer_names), g.kv_cache_spec.page_size_bytes) for g in groups)
    if ours != theirs:
        _fail("stock grouping", [(len(n), pg) for n, pg in ours],
              [(len(n), pg) for n, pg in theirs])
    kv = get_kv_cache_config_from_groups(cfg, groups, plan.kv_budget)
    if kv.num_blocks - 1 != d.stock.usable_blocks:
        _fail("stock block count", d.stock.usable_blocks, kv.num_blocks - 1)
    conc = get_max_concurrency_for_kv_cache_config(
        cfg, dataclasses.replace(kv, num_blocks=kv.num_blocks - 1))
    if not math.isclose(conc, d.stock.reserve, rel_tol=1e-12):
        _fail("stock startup concurrency", d.stock.reserve, conc)
    line = d.line
    arena = {n: sp for n, sp in specs.items() if by_name[n].home == "arena"}
    try:
        lay, _ = arena_sizing.plan_arena(cfg, arena, plan.kv_budget, UlaSettings())
    except KVBackendError as e:
        raise PlannerError(f"the engine's plan_arena refuses V4's arena kinds: {e}") from None
    if (arena_sizing.MIN_ALIGNMENT, arena_sizing.MAX_GRANULES) != (ARENA_MIN_ALIGNMENT,
                                                                   ARENA_MAX_GRANULES):
        _fail("arena alignment rule", (ARENA_MIN_ALIGNMENT, ARENA_MAX_GRANULES),
              (arena_sizing.MIN_ALIGNMENT, arena_sizing.MAX_GRANULES))
    if lay.alignment != line.alignment:
        _fail("arena alignment", line.alignment, lay.alignment)
    ours = sorted((len(k.cache.layers), k.cache.page, k.cache.reserve_pages(
        L, s.in_flight_tokens)) for k in line.kinds)
    theirs = sorted((len(g.layer_names), g.layer_page_bytes, g.pages_per_max_request)
                    for g in lay.groups)
    if ours != theirs:
        _fail("arena kinds (layers, page, pages a request)", ours, theirs)
    if lay.request_bytes() != line.arena_bytes("reserve"):
        _fail("arena bytes a request", line.arena_bytes("reserve"), lay.request_bytes())
    if lay.null_page_bytes * 2 != line.arena_fixed:
        _fail("arena null page + view slack", line.arena_fixed, 2 * lay.null_page_bytes)


def check_against_vllm(p: Plan, det: Any) -> list[str]:
    """Checks every deployment; returns what was compared (all equal) for the assumptions."""
    for d in det.deployments.values():
        check_deployment(p, det, d)
    return ["every cache's page (vLLM's spec classes)",
            "stock's groups, block count and startup concurrency (get_kv_cache_groups, "
            "get_kv_cache_config_from_groups, get_max_concurrency_for_kv_cache_config)",
            "the window pages a decoding request holds (max_admission_blocks_per_request at "
            "one token)",
            "the arena kinds' pages, alignment and reserve (engine.arena.sizing.plan_arena)"]
