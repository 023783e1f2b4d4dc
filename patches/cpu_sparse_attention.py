"""Hooks that let the models of a line with CPU sparse-attention support (`Line.
cpu_sparse_attention`: the DSA line's V3.2-style models, DeepSeek-V3.2 and GLM-5 DSA) run on
vLLM's CPU build, under any `--kv-backend` (stock vLLM's CPU build has no sparse backend).

Each hook decides by model, per layer: the model being built is the one of the vLLM config
current while its layers are constructed (`engine.lines.cpu_sparse_attention_for`), and an
indexer's key cache records at construction the support serving its model (or None). Any model
no line serves (DeepSeek-V4, whose own CPU indexer goes through the same `SparseAttnIndexer`;
a dense model; any other) runs vLLM's own code unchanged.

- `CpuPlatform.get_attn_backend_cls` (platforms/cpu.py): a sparse layer of a served model gets
  the line's CPU sparse-MLA backend (registered as `AttentionBackendEnum.CUSTOM`) instead of
  vLLM's "Sparse Attention is not supported on CPU".
- `DeepseekV32IndexerCache.__init__` / `.get_attn_backend` (models/deepseek_v2.py): the cache
  records the support; a served one gets the line's indexer backend (its kernel block size
  takes 16, the CPU MLA block size, and its metadata is plain).
- `SparseAttnIndexer.forward_cpu` (layers/sparse_attn_indexer.py): the line's indexer math in
  torch for an indexer whose key cache is served; vLLM's own (V4's) otherwise.
- `per_token_group_quant_fp8` as bound in models/deepseek_v2.py (reached only from the V3.2
  indexer there): a torch version, installed only where vLLM's own function cannot run (it
  launches a Triton kernel, and this build's Triton has no CPU backend).
All are CPU-only; CUDA builds keep vLLM's own paths.
"""
from __future__ import annotations

from typing import Any

from ._hook import replace, resolve

HOOK = "cpu_sparse_attention"
DSV2 = "vllm.model_executor.models.deepseek_v2"
INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
# On an indexer key cache: the `CpuSparseAttention` serving its model, or None.
SUPPORT_ATTR = "_ulacache_cpu_sparse"


def support_here():
    """The CPU sparse-attention support serving the model of the current vLLM config (the one
    whose layers are being built), or None."""
    from vllm.config import get_current_vllm_config_or_none

    from ulacache_vllm.engine.lines import cpu_sparse_attention_for

    cfg = get_current_vllm_config_or_none()
    return cpu_sparse_attention_for(cfg.model_config if cfg is not None else None)


def support_of(layer: Any):
    """The support an indexer key cache recorded at construction (None: vLLM's own code)."""
    return getattr(layer, "__dict__", {}).get(SUPPORT_ATTR)


def triton_runs_here() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return HAS_TRITON


# The hooks, each given vLLM's original (``orig``) first; `apply` binds them.
def select_backend(orig, cls, selected_backend, attn_selector_config, num_heads=None):
    """`CpuPlatform.get_attn_backend_cls`: the line's backend for a served sparse layer."""
    if attn_selector_config.use_sparse and support_here() is not None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        return AttentionBackendEnum.CUSTOM.get_path()
    return orig(cls, selected_backend, attn_selector_config, num_heads)


def init_indexer_cache(orig, self, *args, **kwargs) -> None:
    """`DeepseekV32IndexerCache.__init__`: vLLM's, then the support serving the model."""
    orig(self, *args, **kwargs)
    self.__dict__[SUPPORT_ATTR] = support_here()


def indexer_cache_backend(orig, self):
    """`DeepseekV32IndexerCache.get_attn_backend`."""
    s = support_of(self)
    return s.indexer_backend if s is not None else orig(self)


def indexer_forward_cpu(orig, self, *args, **kwargs):
    """`SparseAttnIndexer.forward_cpu`: by the indexer's key cache."""
    s = support_of(self.k_cache)
    if s is None:
        return orig(self, *args, **kwargs)
    return s.indexer_forward(self, *args, **kwargs)


def install_quant(supports: list) -> bool:
    """The torch `per_token_group_quant_fp8` for deepseek_v2.py, only where vLLM's own cannot
    run (no Triton CPU backend); returns whether it was installed."""
    if triton_runs_here():
        return False
    replace(DSV2, "per_token_group_quant_fp8", supports[0].quant_fp8, HOOK)
    return True


def _original(module: str, attr: str):
    _, cur = resolve(module, attr, HOOK)
    return getattr(cur, "__ulacache_original__", cur)


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ulacache_vllm.engine.lines import LINES

    supports = [s for s in (line.cpu_sparse_attention() for line in LINES) if s is not None]
    if not supports:
        return
    if len({s.backend_path for s in supports}) > 1:
        raise RuntimeError("ulacache: more than one line brings a CPU sparse-MLA backend; vLLM "
                           "has one CUSTOM backend slot")
    register_backend(AttentionBackendEnum.CUSTOM, supports[0].backend_path)

    orig_select = _original("vllm.platforms.cpu", "CpuPlatform.get_attn_backend_cls").__func__
    orig_init = _original(DSV2, "DeepseekV32IndexerCache.__init__")
    orig_backend = _original(DSV2, "DeepseekV32IndexerCache.get_attn_backend")
    orig_forward = _original(INDEXER, "SparseAttnIndexer.forward_cpu")

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return select_backend(orig_select, cls, selected_backend, attn_selector_config,
                              num_heads)

    def __init__(self, *args, **kwargs):
        init_indexer_cache(orig_init, self, *args, **kwargs)

    def get_attn_backend(self):
        return indexer_cache_backend(orig_backend, self)

    def forward_cpu(self, *args, **kwargs):
        return indexer_forward_cpu(orig_forward, self, *args, **kwargs)

    replace("vllm.platforms.cpu", "CpuPlatform.get_attn_backend_cls",
            classmethod(get_attn_backend_cls), HOOK)
    replace(DSV2, "DeepseekV32IndexerCache.__init__", __init__, HOOK)
    replace(DSV2, "DeepseekV32IndexerCache.get_attn_backend", get_attn_backend, HOOK)
    replace(INDEXER, "SparseAttnIndexer.forward_cpu", forward_cpu, HOOK)
    install_quant(supports)
