"""The DSA line as a `Line`: the logical address space for V3.2-style index-based sparse
attention (DeepSeek-V3.2, GLM-5 DSA), with the CPU sparse-MLA backend and indexer its models
need on vLLM's CPU build under any `--kv-backend`.

V3.2-style means a model vLLM runs on its V3.2 DSA code: MLA plus the lightning indexer of
`model_executor/models/deepseek_v2.py` (one top-k of single tokens per indexer layer). The
DeepSeek-V4 family (`vllm/models/deepseek_v4`, `deepseek_v41`: compressed rows, sliding
windows, compressor states) also has `index_topk`, but is not this line's: V4 has a line of its
own (`engine/v4`), and its layers keep vLLM's own code under any backend.
"""
from __future__ import annotations

from typing import Any, Callable

from ..config import UlaSettings
from ..line import CpuSparseAttention, Line, UlaKVCacheConfig
from .metrics import METRICS

# Architectures whose attention is index-based sparse MLA (DSA) of the V3.2 generation.
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
# vLLM modules that run V3.2's DSA: a model of one of them whose config has `index_topk`
# (DeepseekV2/V3ForCausalLM and their MTP layers included) is V3.2-style.
V32_MODULES = ("vllm.model_executor.models.deepseek_v2", "vllm.models.deepseek_v32",
               "vllm.model_executor.models.deepseek_mtp")
# DeepSeek-V4's family: not this line's, and handed to vLLM's own code under any backend.
V4_MODULES = ("vllm.models.deepseek_v4", "vllm.models.deepseek_v41")
V4_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
CPU_BACKEND_PATH = "ulacache_vllm.engine.dsa.cpu_sparse_mla.CpuSparseMLABackend"


def vllm_module_of(arch: str) -> str | None:
    """The module vLLM's model registry runs ``arch`` from (None: not registered)."""
    from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel

    model = ModelRegistry.models.get(arch)
    if model is None:
        return None
    if isinstance(model, _LazyRegisteredModel):
        return model.module_name
    return model.model_cls.__module__


def is_deepseek_v4(hf_config: Any) -> bool:
    """The DeepSeek-V4 family (V4, V4.1, their drafts), by model type or by the vLLM module
    its architecture runs from."""
    if hf_config.model_type in V4_MODEL_TYPES:
        return True
    return any((vllm_module_of(a) or "").startswith(V4_MODULES)
               for a in hf_config.architectures or ())


class DsaLine(Line):
    name = "dsa"
    serves_text = (f"index-based sparse-attention (DSA) models of the V3.2 generation "
                   f"({', '.join(DSA_ARCHITECTURES)}, or a DeepSeek-V2/V3 architecture whose "
                   f"config has `index_topk`) through its logical address space")
    metrics = METRICS
    runs_on_cuda = True  # the experimental glue (dsa/cuda), behind the opt-in

    def __init__(self) -> None:
        self._cpu: CpuSparseAttention | None = None

    def serves(self, hf_config: Any) -> bool:
        archs = hf_config.architectures or ()
        if any(a in DSA_ARCHITECTURES for a in archs):
            return True
        if not getattr(hf_config.get_text_config(), "index_topk", None):
            return False  # (a config without the field: not an indexer model)
        return (not is_deepseek_v4(hf_config)
                and any(vllm_module_of(a) in V32_MODULES for a in archs))

    def prepare_engine_args(self, engine_args: Any) -> None:
        from . import sizing

        sizing.prepare_engine_args(engine_args)
        if engine_args.max_num_batched_tokens is None:
            # Left to vLLM's default: the engine core may lower it to what the device pool
            # holds (sizing.plan_layout) instead of refusing to start.
            engine_args.additional_config = {**(engine_args.additional_config or {}),
                                             sizing.DEFAULTED_KEY: ["max_num_batched_tokens"]}

    def prepare(self, vllm_config: Any, settings: UlaSettings) -> None:
        from . import sizing

        sizing.prepare(vllm_config, settings)

    @property
    def cuda_refusal(self) -> str:
        from .cuda import CUDA_REFUSAL

        return CUDA_REFUSAL

    def check_cuda_config(self, vllm_config: Any) -> None:
        from .cuda import check_cuda_config

        check_cuda_config(vllm_config)

    def get_kv_cache_configs(self, orig: Callable, vllm_config: Any, kv_cache_specs: list[dict],
                             available_memory: list[int],
                             settings: UlaSettings) -> list[UlaKVCacheConfig]:
        from . import sizing

        return sizing.get_kv_cache_configs(orig, vllm_config, kv_cache_specs, available_memory,
                                           settings)

    def cpu_sparse_attention(self) -> CpuSparseAttention:
        if self._cpu is None:
            from . import cpu_indexer

            self._cpu = CpuSparseAttention(
                backend_path=CPU_BACKEND_PATH, indexer_backend=cpu_indexer.CpuIndexerBackend,
                indexer_forward=cpu_indexer.indexer_forward_cpu,
                quant_fp8=cpu_indexer.per_token_group_quant_fp8_torch)
        return self._cpu

    def cuda_attention_backend(self) -> str:
        from .cuda.backend import BACKEND_PATH

        return BACKEND_PATH

    def translate_slot_mappings(self, by_layer: dict, register: bool) -> dict:
        """The active `CudaRows`' MLA layers get views of its static slot-mapping buffer
        (same address at capture and replay), filled with translated rows in the pre-forward
        step (``register=False``: the buffers without their slots); indexer layers keep the
        logical slots (indexer keys stay at their logical rows, as on the CPU build)."""
        from .cuda.runtime import ACTIVE

        rows = ACTIVE["rows"]
        if rows is None:
            return by_layer
        out = dict(by_layer)
        for name in rows.layers:
            if name in out:
                out[name] = (rows.register_writes(name, out[name]) if register
                             else rows.static_view(name, out[name]))
        return out


LINE = DsaLine()
__all__ = ["DSA_ARCHITECTURES", "LINE", "DsaLine", "is_deepseek_v4"]
