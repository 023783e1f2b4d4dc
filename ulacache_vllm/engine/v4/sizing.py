"""DeepSeek-V4 under ulacache: every cache an arena kind at its natural page size.

V4 declares seven kinds of cache per model (`../shared/reference/deepseek-v4-notes.md` §1.2):
the sliding window of every layer (64-token pages), the CSA compressed rows (584 B per 4
tokens), the CSA indexer keys (132 B per 4 tokens), the HCA rows (584 B per 128 tokens), and
three fp32 compressor states (4- and 8-token pages). Stock vLLM's hybrid allocator gives every
block id the bytes of its widest group (47,808 B on the factory's 3-layer tiny V4, 189,504 B on
an 8-layer one, for pages of 1,728 to 37,440 B per layer); the arena stores each at its own
size. Layers are grouped by spec equality, the sliding
and state kinds in the arena's LOW band, the compressed kinds in its HIGH band, as for any
hybrid (`arena.sizing.plan_arena`).

Invariant: the indexer's key kernel (`fp8_paged_mqa_logits_cpu`) reads a layer's pages at the
view's block stride and refuses pages that overlap in the view, so the granule (the arena's
block stride) is at least one indexer layer page (`INDEXER_CACHE_SUFFIX`); every other V4
kernel takes pages at any granule.
"""
from __future__ import annotations

from typing import Any, Callable

from vllm.logger import init_logger

from ..config import KVBackendError, UlaSettings, refuse_context_parallel
from ..line import UlaKVCacheConfig

logger = init_logger("vllm.ulacache")

# vLLM's V4 names a CSA layer's indexer key cache `<layer>.attn.indexer.k_cache`
# (`vllm/models/deepseek_v4/attention.py`, the indexer's `k_cache` module).
INDEXER_CACHE_SUFFIX = ".indexer.k_cache"


def strided_layer(name: str) -> bool:
    """Layers whose kernel needs the view's block stride to hold a whole page."""
    return name.endswith(INDEXER_CACHE_SUFFIX)


def stock_requests(orig: Callable, vllm_config: Any, kv_cache_specs: list[dict],
                   available_memory: list[int]) -> int | None:
    """Requests of max_model_len stock vLLM fits in the same budget: its own sizing and its
    own concurrency figure (the one it logs as "Maximum concurrency")."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    try:
        cfg = orig(vllm_config, kv_cache_specs, available_memory)[0]
        return int(get_max_concurrency_for_kv_cache_config(vllm_config, cfg))
    except Exception as err:  # noqa: BLE001 - a figure for the startup line only
        logger.debug("ulacache v4: stock's sizing for comparison failed: %s", err)
        return None


def get_kv_cache_configs(orig: Callable, vllm_config: Any, kv_cache_specs: list[dict],
                         available_memory: list[int],
                         settings: UlaSettings) -> list[UlaKVCacheConfig]:
    from ..arena import sizing as arena_sizing

    configs = arena_sizing.get_kv_cache_configs(orig, vllm_config, kv_cache_specs,
                                                available_memory, settings, strided_layer)
    stock = stock_requests(orig, vllm_config, kv_cache_specs, available_memory)
    for cfg in configs:
        cfg.layout.stock_requests = stock
    return configs


def prepare(vllm_config: Any, settings: UlaSettings) -> None:
    """What the V4 line does not run yet is refused, naming the fix; V4's own CPU settings
    (block size 256, the fp8 cache) stay as vLLM's platform sets them."""
    pc = vllm_config.parallel_config
    fix = " Use --kv-backend vllm for this setup."
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        raise KVBackendError(
            f"--kv-backend ulacache does not run DeepSeek-V4 with tensor or pipeline "
            f"parallelism yet (tensor_parallel_size {pc.tensor_parallel_size}, "
            f"pipeline_parallel_size {pc.pipeline_parallel_size}): its replicated caches under "
            f"the arena are verified on one rank only.{fix}")
    refuse_context_parallel(pc, "--kv-backend ulacache (DeepSeek-V4)", f" yet.{fix}")
    if vllm_config.speculative_config is not None:
        raise KVBackendError(
            "--kv-backend ulacache does not run speculative decoding with DeepSeek-V4: vLLM's "
            "CPU build has no V4 draft (its MTP and DSpark drafts raise NotImplementedError "
            "there). Drop --speculative-config.")
    sc = vllm_config.scheduler_config
    if sc.async_scheduling:
        # The arena fences a step's pages until its output is processed (one batch in flight).
        logger.info("ulacache v4: async scheduling is turned off (the arena runs with "
                    "synchronous scheduling)")
        sc.async_scheduling = False
