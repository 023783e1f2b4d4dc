"""The stand-in for vLLM's ``VllmConfig``: the fields vLLM's sizing functions, the engine's
``plan_layout`` / ``plan_arena`` and the planner's checks read, for one engine of a cluster."""
from __future__ import annotations

from types import SimpleNamespace

from .model import ModelShape
from .records import Cluster


class _CacheConfig:
    num_gpu_blocks_override = None
    prefix_cache_retention_interval = None

    def __init__(self, layout: str, mamba_cache_mode: str):
        self.kv_cache_layout = layout
        self.mamba_cache_mode = mamba_cache_mode

    def get_resolved_kv_cache_layout(self):
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return KVCacheLayout[self.kv_cache_layout]


def vllm_config(model: ModelShape, cluster: Cluster, request_tokens: int, *,
                layout: str = "LBHNC", hisparse: bool = False, mamba_cache_mode: str = "none"):
    """The fields of `VllmConfig` that vLLM's sizing functions and `plan_layout` read, for one
    engine of ``cluster`` serving requests of ``request_tokens`` (= max_model_len)."""
    from ulacache_vllm.engine.dsa.sizing import DEFAULTED_KEY

    hf = SimpleNamespace(**model.config)
    hisparse_config = None
    if hisparse:
        from vllm.config.attention import HiSparseConfig

        hisparse_config = HiSparseConfig()
    sched = SimpleNamespace(
        max_num_batched_tokens=cluster.max_num_batched_tokens,
        max_num_scheduled_tokens=cluster.max_num_batched_tokens,
        enable_chunked_prefill=cluster.chunked_prefill, max_num_seqs=cluster.max_num_seqs,
        disable_hybrid_kv_cache_manager=False)
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=request_tokens, hf_config=hf,
                                     hf_text_config=hf),
        scheduler_config=sched,
        cache_config=_CacheConfig(layout, mamba_cache_mode),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=cluster.tp, data_parallel_size=cluster.dp,
            pipeline_parallel_size=1, decode_context_parallel_size=1,
            prefill_context_parallel_size=1),
        attention_config=SimpleNamespace(hisparse_config=hisparse_config),
        speculative_config=None, max_concurrent_batches=1,
        max_in_flight_tokens=cluster.max_num_batched_tokens,
        additional_config={DEFAULTED_KEY: ["max_num_batched_tokens"]}
        if cluster.batch_tokens_defaulted else {})
