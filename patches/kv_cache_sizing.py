"""Hook: `get_kv_cache_configs` as imported by `vllm.v1.engine.core`.

Under `--kv-backend ulacache` this is where the product line is decided, once per engine
(`wiring.line_sizing`): the DSA line turns the block pool into a logical address space sized
to the device pool plus the host pool and moves the sparse-MLA rows into its own pools
(`ulacache_vllm/engine/dsa/sizing.py`); the arena line lays hybrid models out in one arena
(`ulacache_vllm/engine/arena/sizing.py`). Either returns `UlaKVCacheConfig`s carrying its
layout to the scheduler and the workers. Other backends pass through.
"""
from __future__ import annotations

from ._hook import replace

HOOK = "kv_cache_sizing"
MODULE = "vllm.v1.engine.core"


def apply() -> None:
    import vllm.v1.engine.core as core

    orig = core.get_kv_cache_configs

    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
        from ulacache_vllm.engine import config as ula_config

        if ula_config.kv_backend_of(vllm_config) != "ulacache":
            return orig(vllm_config, kv_cache_specs, available_memory)
        from vllm.logger import init_logger

        from ulacache_vllm.engine.wiring import line_sizing

        settings = ula_config.settings_from_additional_config(vllm_config.additional_config)
        configs = line_sizing(vllm_config.model_config).get_kv_cache_configs(
            orig, vllm_config, kv_cache_specs, available_memory, settings)
        init_logger("vllm.ulacache").info(
            configs[0].layout.summary(vllm_config.model_config.max_model_len))
        return configs

    replace(MODULE, "get_kv_cache_configs", get_kv_cache_configs, HOOK)
