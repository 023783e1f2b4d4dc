"""Hook: DeepSeek-V4's CPU attention (`DeepseekV4CPUAttention.forward_mqa`) and its compressor
(`DeepseekV4CPUCompressor.forward`), on the CSA layers whose compressed rows ulacache's v4 line
places, per instance (`bind`); no class attribute of vLLM changes, so every other layer and
every V4 model ulacache does not serve runs vLLM's own code.

vLLM's kernels read a CSA layer's rows as pages of 64 rows in its block table's blocks (a
page holds the 64 rows' data, then their scales). Under the v4 line a layer's rows live in a
pool of one-row pages (`engine/v4/rows.py`: device rows, then host rows, each row its own 584
bytes), so:

- the compressor writes its new rows into the pool (the layer's ``kv_cache`` is the pool,
  ``[rows, 1, 584]``: block size 1) at the pool rows the worker fixed before the forward
  (``rows.write_slots``), through a copy of the step's CSA metadata for the call;
- the attention (`forward_mqa`, vLLM's body with the compress-ratio-4 branch changed) reads
  the indexer's top-k through the mapping table: vLLM's own local -> logical slots, then
  ``rows.resolve`` (pool rows, host rows read in place), over the pool at block size 1.

`forward_mqa` below is vLLM 0.32.0's method with that branch changed; `check_upstream` fails
loudly when vLLM's method or the compressor's is not the one it was written against.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import types
from typing import cast

import torch

from ._hook import VllmHookError, check_vllm_version

HOOK = "v4_csa_rows"
# sha256[:16] of the methods' source as vLLM 0.32.0 ships them.
UPSTREAM = {"DeepseekV4CPUAttention.forward_mqa": "90e0ceef81676369",
            "DeepseekV4CPUCompressor.forward": "2fca21d6ad9f5763"}


def check_upstream() -> None:
    from vllm.models.deepseek_v4.cpu.cpu_compressor import DeepseekV4CPUCompressor
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    check_vllm_version(HOOK)
    owners = {"DeepseekV4CPUAttention": DeepseekV4CPUAttention,
              "DeepseekV4CPUCompressor": DeepseekV4CPUCompressor}
    for name, digest in UPSTREAM.items():
        cls, meth = name.split(".")
        src = inspect.getsource(getattr(owners[cls], meth))
        if hashlib.sha256(src.encode()).hexdigest()[:16] != digest:
            raise VllmHookError(
                f"ulacache patch '{HOOK}': vLLM's {name} changed since vLLM 0.32.0; port "
                f"patches/v4_csa_rows.py to it (and update UPSTREAM)")


def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                output: torch.Tensor) -> None:
    """vLLM 0.32.0's `DeepseekV4CPUAttention.forward_mqa` for a CSA layer whose rows the v4
    line places (``self._ula_rows``): the compressed branch resolves the indexer's logical
    top-k to pool rows. Only CSA layers (compress ratio 4) are bound."""
    from vllm.forward_context import get_forward_context
    from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    forward_context = get_forward_context()
    attn_metadata = forward_context.attn_metadata
    if attn_metadata is None:
        output.zero_()
        return
    assert isinstance(attn_metadata, dict)
    swa_metadata = cast(DeepseekSparseSWAMetadata,
                        attn_metadata.get(self.swa_cache_layer.prefix))
    assert swa_metadata is not None
    assert swa_metadata.token_to_req_indices is not None
    req_idx = swa_metadata.token_to_req_indices
    flashmla_metadata = cast(DeepseekV4FlashMLAMetadata | None, attn_metadata.get(self.prefix))
    num_tokens = q.shape[0]
    device = q.device

    # ---- SWA window: causal sliding window over the raw per-token cache (as vLLM)
    window = self.window_size
    win_offsets = torch.arange(window, device=device)
    start_pos = (positions - window + 1).clamp(min=0)
    local_pos = start_pos.unsqueeze(-1) + win_offsets
    valid_win = local_pos <= positions.unsqueeze(-1)
    win_local = torch.where(valid_win, local_pos, torch.full_like(local_pos, -1))
    window_slots = map_local_to_global_slots_cpu(
        win_local, req_idx, swa_metadata.block_table, swa_metadata.block_size)
    window_cache_2d = self.swa_cache_layer.kv_cache.view(
        self.swa_cache_layer.kv_cache.shape[0], -1)

    # ---- Compressed KV: the indexer's top-k, through the mapping table (ulacache)
    assert flashmla_metadata is not None and self.compress_ratio == 4
    assert self.topk_indices_buffer is not None
    rows = self._ula_rows
    rows_per_block = flashmla_metadata.block_size // self.compress_ratio
    local_topk = self.topk_indices_buffer[:num_tokens]
    logical = map_local_to_global_slots_cpu(
        local_topk, req_idx, flashmla_metadata.block_table, rows_per_block)
    compressed_slots = rows.resolve(logical)
    compressed_cache_2d = rows.rows2d
    compressed_block_size = 1

    torch.ops._C.flash_mla_with_kvcache_cpu(
        output, q, window_cache_2d, window_slots, swa_metadata.block_size,
        compressed_cache_2d, compressed_slots, compressed_block_size, self.attn_sink,
        self.scale)


def _compressor_forward(orig, rows):
    """The CSA compressor's forward with this step's pool rows as its write slots (a copy of
    the step's CSA metadata for the call; the shared one keeps the logical slots)."""

    def forward(self, kv_score, positions, rotary_emb):
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        if not isinstance(md, dict) or rows.write_slots is None:
            return orig(kv_score, positions, rotary_emb)
        key = self.k_cache_prefix
        shared = md[key]
        mine = copy.copy(shared)
        mine.slot_mapping = rows.write_slots
        md[key] = mine
        try:
            return orig(kv_score, positions, rotary_emb)
        finally:
            md[key] = shared

    return forward


def bind(layer, rows) -> None:
    """Put a CSA attention layer's rows in ``rows`` (an `engine.v4.rows.CsaLayerRows`): its KV
    cache becomes the pool, its attention and compressor the methods above (this instance
    only)."""
    from vllm.models.deepseek_v4.cpu.cpu_compressor import DeepseekV4CPUCompressor
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    check_upstream()
    if not isinstance(layer, DeepseekV4CPUAttention) or layer.compress_ratio != 4:
        raise VllmHookError(
            f"ulacache patch '{HOOK}': {getattr(layer, 'prefix', layer)!r} is not a "
            f"DeepSeek-V4 CPU attention layer of compress ratio 4")
    comp = layer.compressor
    if not isinstance(comp, DeepseekV4CPUCompressor) or comp.k_cache_prefix != layer.prefix:
        raise VllmHookError(
            f"ulacache patch '{HOOK}': the CSA compressor of {layer.prefix} does not write "
            f"the layer's own cache")
    layer._ula_rows = rows
    layer.kv_cache = rows.pool
    layer.forward_mqa = types.MethodType(forward_mqa, layer)
    comp.forward = types.MethodType(_compressor_forward(comp.forward, rows), comp)
