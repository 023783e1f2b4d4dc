"""The DeepSeek-V4 line as a `Line`: V4 (`DeepseekV4ForCausalLM`, model type `deepseek_v4`)
on vLLM's CPU build, its CSA rows in the logical address space and its other caches in the
arena (`sizing.py`). V4.1 (layer-shared KV and top-k,
ring-buffer states) is refused by name."""
from __future__ import annotations

from typing import Any, Callable

from ..config import UlaSettings
from ..dsa.line import is_deepseek_v4
from ..line import Line, UlaKVCacheConfig
from .metrics import METRICS

ARCHITECTURE = "DeepseekV4ForCausalLM"  # verified on vLLM's CPU build (the tiny V4)


class V4Line(Line):
    name = "v4"
    serves_text = ("DeepSeek-V4 (DeepseekV4ForCausalLM) with its CSA compressed rows in the "
                   "logical address space and every other cache at its natural page size in "
                   "its arena")
    metrics = METRICS

    def serves(self, hf_config: Any) -> bool:
        return ARCHITECTURE in (hf_config.architectures or ())

    def refusal(self, hf_config: Any) -> str | None:
        if self.serves(hf_config) or not is_deepseek_v4(hf_config):
            return None
        what = ", ".join(hf_config.architectures or ()) or hf_config.model_type
        return (f"--kv-backend ulacache does not serve this DeepSeek-V4-family model ({what}, "
                f"model type {hf_config.model_type!r}) yet: it serves DeepSeek-V4 as "
                f"{ARCHITECTURE}. V4.1 (layer-shared KV and top-k, ring-buffer compressor "
                f"states), V4's drafts (MTP, DSpark: no CPU implementation in vLLM) and other "
                f"V4 entry points are not placed by ulacache. Use --kv-backend vllm for this "
                f"model.")

    def prepare(self, vllm_config: Any, settings: UlaSettings) -> None:
        from . import sizing

        sizing.prepare(vllm_config, settings)

    def get_kv_cache_configs(self, orig: Callable, vllm_config: Any, kv_cache_specs: list[dict],
                             available_memory: list[int],
                             settings: UlaSettings) -> list[UlaKVCacheConfig]:
        from . import sizing

        return sizing.get_kv_cache_configs(orig, vllm_config, kv_cache_specs, available_memory,
                                           settings)


LINE = V4Line()
