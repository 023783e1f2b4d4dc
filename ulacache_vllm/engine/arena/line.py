"""The arena line as a `Line`: one byte arena per rank for the hybrid models verified on
vLLM's CPU build (full attention beside sliding-window KV or GDN state), each kind stored at
its natural page size."""
from __future__ import annotations

from typing import Any, Callable

from ..config import EXPERIMENTAL_CUDA_ENV, UlaSettings
from ..line import Line, UlaKVCacheConfig
from .metrics import METRICS

# Hybrid architectures the arena serves, as verified on vLLM's CPU build. Other hybrids (e.g.
# Mamba2 families) are refused by name.
ARENA_ARCHITECTURES = ("Qwen3NextForCausalLM", "GptOssForCausalLM", "Gemma3ForCausalLM")


class ArenaLine(Line):
    name = "arena"
    serves_text = (f"the hybrid models {', '.join(ARENA_ARCHITECTURES)} through its arena "
                   f"(other hybrids, e.g. Mamba2 families, are not verified on this build yet)")
    metrics = METRICS
    aligns_hybrid_block_size = False  # every kind at its natural page size

    def serves(self, hf_config: Any) -> bool:
        return any(a in ARENA_ARCHITECTURES for a in hf_config.architectures or ())

    @property
    def cuda_refusal(self) -> str:
        return (f"--kv-backend ulacache runs hybrid models (its arena) on vLLM's CPU build "
                f"only; the experimental CUDA glue ({EXPERIMENTAL_CUDA_ENV}=1) covers DSA "
                f"models only. Use --kv-backend vllm on this machine.")

    def prepare_engine_args(self, engine_args: Any) -> None:
        from . import sizing

        sizing.prepare_engine_args(engine_args)

    def prepare(self, vllm_config: Any, settings: UlaSettings) -> None:
        from . import sizing

        sizing.prepare(vllm_config, settings)

    def get_kv_cache_configs(self, orig: Callable, vllm_config: Any, kv_cache_specs: list[dict],
                             available_memory: list[int],
                             settings: UlaSettings) -> list[UlaKVCacheConfig]:
        from . import sizing

        return sizing.get_kv_cache_configs(orig, vllm_config, kv_cache_specs, available_memory,
                                           settings)


LINE = ArenaLine()
