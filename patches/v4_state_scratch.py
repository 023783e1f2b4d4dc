"""Hook: DeepSeek-V4's CPU compressor (`DeepseekV4CPUCompressor.forward`), per instance, for the
compressors of a model ulacache's v4 line serves (`bind`); no class attribute of vLLM changes.

On a step where some of a state kind's pages are transient (`engine/v4/states.py`: the v4
line keeps only the last window of a prefill chunk's compressor states in the arena), the
forward below runs vLLM's two kernels over a scratch buffer instead of the state cache:
``save_partial_states_cpu`` writes the kept tokens' states to the arena and, a chunk of the
step's tokens at a time (with the window before it), every token's state to the scratch
(block size 1, one row a token); the arena rows before the step that the chunk's boundaries
read are copied in; ``compress_norm_rope_store_cpu`` (or its indexer twin) reads each
boundary's window from the scratch. Same inputs, same kernels: the same compressed rows. On
every other step (no transient page: decode, or prefix caching on) vLLM's own forward runs.

`check_upstream` (shared with `v4_csa_rows`) fails loudly when vLLM's compressor forward is
not the one this was written against.
"""
from __future__ import annotations

import types

import torch

from ._hook import VllmHookError
from .v4_csa_rows import check_upstream

HOOK = "v4_state_scratch"


class Scratch:
    """One fp32 buffer for every compressor call of a step (they run one at a time), grown on
    demand."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * 4

    def rows(self, n: int, dim: int) -> torch.Tensor:
        if self.buf.numel() < n * dim:
            self.buf = torch.empty(n * dim, dtype=torch.float32)
        return self.buf[:n * dim].view(n, 1, dim)


def _forward(orig, plans: dict, scratch: Scratch):
    from vllm._custom_ops import (
        compress_norm_rope_store_cpu,
        compress_norm_rope_store_indexer_cpu,
        save_partial_states_cpu,
    )
    from vllm.forward_context import get_forward_context

    def forward(self, kv_score, positions, rotary_emb):
        plan = plans.get(self.state_cache.prefix)
        md = get_forward_context().attn_metadata
        if plan is None or not isinstance(md, dict):
            return orig(kv_score, positions, rotary_emb)
        kv, score = kv_score.split([self.coff * self.head_dim, self.coff * self.head_dim],
                                   dim=-1)
        state_cache = self.state_cache.kv_cache
        save_partial_states_cpu(kv, score, self.ape, positions, state_cache, plan.keep_slots)
        k_slots = md[self.k_cache_prefix].slot_mapping
        kv_cache = self._static_forward_context[self.k_cache_prefix].kv_cache
        kv_2d = kv_cache.view(kv_cache.shape[0], -1)
        store = (compress_norm_rope_store_cpu if self.head_dim == 512
                 else compress_norm_rope_store_indexer_cpu)
        for c in plan.chunks:  # (row slices of kv / score: views, no copy)
            buf = scratch.rows(c.rows, state_cache.shape[-1])
            save_partial_states_cpu(kv[c.lo:c.end], score[c.lo:c.end], self.ape,
                                    positions[c.lo:c.end], buf, c.save_rows)
            if c.tail_rows.numel():
                buf[c.tail_rows, 0] = state_cache[c.tail_blocks, c.tail_offsets]
            store(buf, c.gather, positions[c.start:c.end], k_slots[c.start:c.end],
                  self._norm_weight_fp32, self.rms_norm_eps, rotary_emb.cos_sin_cache, kv_2d,
                  kv_cache.shape[1], self.compress_ratio)

    return forward


def bind(compressor, plans: dict, scratch: Scratch) -> None:
    """The forward above on this compressor instance: ``plans`` maps a state cache's prefix to
    this step's `states.ScratchPlan` (absent: vLLM's own forward)."""
    from vllm.models.deepseek_v4.cpu.cpu_compressor import DeepseekV4CPUCompressor

    check_upstream()
    if not isinstance(compressor, DeepseekV4CPUCompressor) or compressor.use_fp4_cache:
        raise VllmHookError(f"ulacache patch '{HOOK}': {compressor!r} is not a DeepSeek-V4 "
                            f"CPU compressor with an fp8 cache")
    compressor.forward = types.MethodType(_forward(compressor.forward, plans, scratch),
                                          compressor)
