"""Hook: `RotaryEmbedding.forward_cpu` (model_executor/layers/rotary_embedding/base.py).

vLLM's CPU kernel `_C.rotary_embedding` is only right for 2-D `[T, H*D]` query/key. MLA
(layers/mla.py) and the DSA indexer pass 3-D `[T, H, 64]` views; the kernel then rotates heads
with other tokens' positions (results depend on batch composition) and can write past the end
of the key tensor, silently. The fix routes every non-2-D or non-contiguous call to the exact
PyTorch implementation and keeps the fast kernel for the shapes it handles. Applied for every
run on the CPU build, stock and ulacache alike, so parity comparisons stay meaningful.
"""
from __future__ import annotations

from ._hook import replace

HOOK = "rotary_cpu"
MODULE = "vllm.model_executor.layers.rotary_embedding.base"


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.rotary_embedding.base as base

    orig = base.RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        kernel_safe = (
            query.dim() == 2
            and query.is_contiguous()
            and (key is None or (key.dim() == 2 and key.is_contiguous()))
        )
        if not kernel_safe:
            return self.forward_native(positions, query, key)
        return orig(self, positions, query, key)

    replace(MODULE, "RotaryEmbedding.forward_cpu", forward_cpu, HOOK)
