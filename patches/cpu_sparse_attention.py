"""Hooks that let DSA (index-based sparse MLA) models run on vLLM's CPU build.

- `CpuPlatform.get_attn_backend_cls` (platforms/cpu.py): returns the project's CPU sparse-MLA
  backend (registered as `AttentionBackendEnum.CUSTOM`) instead of raising
  "Sparse Attention is not supported on CPU".
- `DeepseekV32IndexerCache.get_attn_backend` (models/deepseek_v2.py): a CPU indexer backend
  whose kernel block size accepts 16 (the CPU MLA block size) and whose metadata is plain.
- `SparseAttnIndexer.forward_cpu` (layers/sparse_attn_indexer.py): V3.2 indexer math in torch.
- `per_token_group_quant_fp8` as bound in models/deepseek_v2.py: a torch version (the CPU build
  falls through to a Triton kernel it cannot run).
All are CPU-only; CUDA builds keep vLLM's own paths.
"""
from __future__ import annotations

from ._hook import replace

HOOK = "cpu_sparse_attention"
BACKEND_PATH = "ulacache_vllm.engine.dsa.cpu_sparse_mla.CpuSparseMLABackend"


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ulacache_vllm.engine.dsa import cpu_indexer

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    orig_select = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if getattr(attn_selector_config, "use_sparse", False):
            return AttentionBackendEnum.CUSTOM.get_path()
        return orig_select(cls, selected_backend, attn_selector_config, num_heads)

    replace("vllm.platforms.cpu", "CpuPlatform.get_attn_backend_cls",
            classmethod(get_attn_backend_cls), HOOK)

    def get_attn_backend(self):
        return cpu_indexer.CpuIndexerBackend

    replace("vllm.model_executor.models.deepseek_v2", "DeepseekV32IndexerCache.get_attn_backend",
            get_attn_backend, HOOK)
    replace("vllm.model_executor.layers.sparse_attn_indexer", "SparseAttnIndexer.forward_cpu",
            cpu_indexer.indexer_forward_cpu, HOOK)
    replace("vllm.model_executor.models.deepseek_v2", "per_token_group_quant_fp8",
            cpu_indexer.per_token_group_quant_fp8_torch, HOOK)
