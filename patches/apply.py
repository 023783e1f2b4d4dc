"""Applies every vLLM patch of this project, in order; each one checks the vLLM version."""
from __future__ import annotations

from . import (
    block_hasher,
    block_table_translate,
    cli_args,
    cpu_mla_path,
    cpu_sparse_attention,
    cuda_sparse_backend,
    engine_args,
    engine_config,
    engine_startup_error,
    hybrid_block_size,
    kv_cache_sizing,
    kv_layer_hooks,
    llm_kwargs,
    mamba_align_translate,
    rotary_cpu,
)

ALL = (engine_args, cli_args, llm_kwargs, engine_config, engine_startup_error, rotary_cpu,
       cpu_sparse_attention, cpu_mla_path, kv_cache_sizing, hybrid_block_size,
       block_table_translate, mamba_align_translate, cuda_sparse_backend, block_hasher,
       kv_layer_hooks)
from . import v4_cpu_isa, v4_tile_scheduler, v4_triton_fallbacks  # noqa: E402 (DeepSeek-V4, CPU)
ALL += (v4_cpu_isa, v4_tile_scheduler, v4_triton_fallbacks)


def apply_all() -> None:
    for mod in ALL:
        mod.apply()
