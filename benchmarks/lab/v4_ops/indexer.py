"""LAB-ONLY pure-PyTorch emulation of DeepSeek-V4's CPU indexer/compressor ops.

vLLM registers these as ``torch.ops._C.*`` only in its AVX512-BF16 ``_C``
build (csrc/cpu/sgl-kernels/{paged_mqa_logits,topk,indexer,compressor}.cpp).
This module re-implements them with vectorized torch so V4 engine tests can
run on an AVX2-only host.  Never part of the product.

Ops (schemas copied verbatim from the strings registered by vLLM's
``_C.abi3.so``):

* ``fp8_paged_mqa_logits_cpu``      (paged_mqa_logits.cpp)
* ``topk_transform_512_cpu``        (topk.cpp)
* ``fused_indexer_q_rope_quant_cpu`` (indexer.cpp)
* ``save_partial_states_cpu``       (compressor.cpp)
* ``compress_norm_rope_store_cpu``  (compressor.cpp)
* ``compress_norm_rope_store_indexer_cpu`` (compressor.cpp)

``OPS`` maps op name -> (schema, impl).  No registration happens here.
"""

from __future__ import annotations

import torch

from . import _selfcheck

FP8_MAX = 448.0
INDEX_HEAD_DIM = 128  # indexer head dim (paged_mqa_logits.cpp kIndexHeadDim)
INDEX_SCALE_BYTES = 4  # one raw fp32 scale per token in the indexer cache
TOPK = 512  # topk.cpp kC4Topk

# main-attention compressor (fp8_ds_mla "model1" layout)
MAIN_NOPE_DIM = 448
MAIN_ROPE_DIM = 64
MAIN_HEAD_DIM = MAIN_NOPE_DIM + MAIN_ROPE_DIM
MAIN_QUANT_BLOCK = 64
MAIN_NUM_QUANT_BLOCKS = MAIN_NOPE_DIM // MAIN_QUANT_BLOCK  # 7
MAIN_SCALE_BYTES = MAIN_NUM_QUANT_BLOCKS + 1  # 7 UE8M0 + 1 pad
MAIN_TOKEN_BYTES = MAIN_NOPE_DIM + MAIN_ROPE_DIM * 2  # 576
MAIN_QUANT_EPS = 1e-4

# indexer compressor
IDX_ROPE_DIM = 64
IDX_NOPE_DIM = INDEX_HEAD_DIM - IDX_ROPE_DIM
# compressor.cpp addresses cos_sin_cache as a flat [*, 64] array for both paths
COMPRESS_COS_SIN_WIDTH = 64

# rough per-chunk element budget for temporaries (keeps peak memory bounded)
_CHUNK_ELEMS = 1 << 24


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (RNE) -> fp32, like at::BFloat16 / _mm512_cvtneps_pbh."""
    return x.to(torch.bfloat16).to(torch.float32)


def _f32_scalar(v: float) -> torch.Tensor:
    return torch.tensor(float(v), dtype=torch.float32)


def _gptj_rope_fma(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Interleaved (GPT-J) RoPE on the last dim of ``x`` (fp32), emulating the
    kernels' ``_mm512_fmadd_ps(x, cos, swap(x) * (+-sin))``:
        even' = fma(x_e, cos, round(x_o * -sin))
        odd'  = fma(x_o, cos, round(x_e *  sin))
    The fp32*fp32 product is exact in fp64, so one fp64 add + fp32 round
    reproduces the fused single rounding (up to a vanishingly rare double
    rounding).  cos/sin broadcast against x[..., ::2]."""
    x_e = x[..., 0::2]
    x_o = x[..., 1::2]
    t_e = (x_o * (-sin)).double()
    t_o = (x_e * sin).double()
    cos_d = cos.double()
    out_e = (x_e.double() * cos_d + t_e).float()
    out_o = (x_o.double() * cos_d + t_o).float()
    return torch.stack((out_e, out_o), dim=-1).flatten(-2)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


# ---------------------------------------------------------------------------
# fp8_paged_mqa_logits_cpu
# ---------------------------------------------------------------------------


def fp8_paged_mqa_logits_cpu(
    q_fp8: torch.Tensor,
    kvcache_fp8: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    max_seq_len: int,
) -> torch.Tensor:
    """logits[b, t] = k_scale[b, t] * sum_h weight[b, h] * relu(q[b, h] . k[b, t])
    for t < min(seq_lens[b], max_seq_len); k/k_scale read from page
    page_table[b, t // block_size], token t % block_size (K region:
    block_size*128 fp8 bytes, then block_size fp32 scales).  The kernel leaves
    t >= seq_len uninitialized; this emulation fills those with -inf."""
    _check(
        q_fp8.dim() == 3 and q_fp8.dtype == torch.float8_e4m3fn,
        "fp8_paged_mqa_logits_cpu: q_fp8 must be a 3D float8_e4m3fn tensor "
        "[batch, heads, 128]",
    )
    _check(q_fp8.size(2) == INDEX_HEAD_DIM, "fp8_paged_mqa_logits_cpu: head_dim must be 128")
    _check(
        kvcache_fp8.dim() == 2 and kvcache_fp8.dtype == torch.uint8,
        "fp8_paged_mqa_logits_cpu: kvcache_fp8 must be a 2D uint8 tensor",
    )
    block_size = int(block_size)
    max_seq_len = int(max_seq_len)
    _check(block_size > 0, "fp8_paged_mqa_logits_cpu: block_size must be positive")
    _check(
        kvcache_fp8.size(1) >= block_size * (INDEX_HEAD_DIM + INDEX_SCALE_BYTES),
        "fp8_paged_mqa_logits_cpu: kvcache_fp8 page byte width too small for block_size",
    )
    batch, num_heads = q_fp8.size(0), q_fp8.size(1)
    _check(
        weight.dim() == 2 and weight.dtype == torch.float32
        and tuple(weight.shape) == (batch, num_heads),
        "fp8_paged_mqa_logits_cpu: weight must be a 2D fp32 tensor [batch, heads]",
    )
    _check(seq_lens.dim() == 1 and seq_lens.size(0) == batch,
           "fp8_paged_mqa_logits_cpu: seq_lens must be a 1D tensor [batch]")
    _check(page_table.dim() == 2 and page_table.size(0) == batch,
           "fp8_paged_mqa_logits_cpu: page_table must be a 2D tensor [batch, pages]")
    _check(max_seq_len >= 0, "fp8_paged_mqa_logits_cpu: max_seq_len must be non-negative")

    logits = torch.full((batch, max_seq_len), float("-inf"), dtype=torch.float32,
                        device=q_fp8.device)
    if batch == 0 or max_seq_len == 0:
        return logits

    num_pages = kvcache_fp8.size(0)
    n_lp = -(-max_seq_len // block_size)  # logical pages covering max_seq_len
    Lp = n_lp * block_size
    eff_len = seq_lens.to(torch.int64).clamp(min=0, max=max_seq_len)  # [B]
    pages_needed = torch.div(eff_len + block_size - 1, block_size, rounding_mode="floor")

    pt = page_table.to(torch.int64)
    if pt.size(1) < n_lp:
        pt = torch.cat([pt, pt.new_full((batch, n_lp - pt.size(1)), -1)], dim=1)
    pt = pt[:, :n_lp]
    lp_idx = torch.arange(n_lp, device=pt.device)
    page_valid = lp_idx.unsqueeze(0) < pages_needed.unsqueeze(1)  # [B, n_lp]
    bad = page_valid & ((pt < 0) | (pt >= num_pages))
    if bool(bad.any()):
        raise IndexError(
            "fp8_paged_mqa_logits_cpu: page_table entry out of range [0, "
            f"{num_pages}) for a position < seq_len (or page_table too narrow)")
    pt = torch.where(page_valid, pt, torch.zeros_like(pt))

    # Page-shaped views through the cache's real strides (row stride may
    # exceed the page width: per-layer view of a pooled allocation).
    s0, s1 = kvcache_fp8.stride()
    k_pages = kvcache_fp8.as_strided(
        (num_pages, block_size, INDEX_HEAD_DIM),
        (s0, INDEX_HEAD_DIM * s1, s1),
        kvcache_fp8.storage_offset(),
    ) if num_pages > 0 else None
    scale_region = kvcache_fp8[:, block_size * INDEX_HEAD_DIM:
                               block_size * (INDEX_HEAD_DIM + INDEX_SCALE_BYTES)]
    if k_pages is None:  # no pages at all: only seq_len == 0 rows are legal
        return logits

    q_f = q_fp8.float()  # exact (fp8 -> fp32)
    pos = torch.arange(max_seq_len, device=q_fp8.device)
    per_row = Lp * (INDEX_HEAD_DIM * 5 + num_heads * 4 + 16)
    rows_per_chunk = max(1, (_CHUNK_ELEMS * 8) // max(per_row, 1))
    for r0 in range(0, batch, rows_per_chunk):
        r1 = min(batch, r0 + rows_per_chunk)
        ptc = pt[r0:r1]  # [Bc, n_lp]
        k = k_pages[ptc]  # [Bc, n_lp, bs, 128] uint8
        k = k.reshape(r1 - r0, Lp, INDEX_HEAD_DIM)[:, :max_seq_len]
        k = k.view(torch.float8_e4m3fn).float()  # exact
        sc = scale_region[ptc].contiguous().view(torch.float32)  # [Bc, n_lp, bs]
        sc = sc.reshape(r1 - r0, Lp)[:, :max_seq_len]
        dots = torch.bmm(q_f[r0:r1], k.transpose(1, 2)).clamp_min_(0.0)  # [Bc,H,L]
        score = torch.bmm(weight[r0:r1].unsqueeze(1), dots).squeeze(1)  # [Bc, L]
        out = score * sc
        valid = pos.unsqueeze(0) < eff_len[r0:r1].unsqueeze(1)
        logits[r0:r1] = torch.where(valid, out, logits[r0:r1])
    return logits


# ---------------------------------------------------------------------------
# topk_transform_512_cpu
# ---------------------------------------------------------------------------


def _topk512_select_sorted(s: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Rows with seq > 512: the kernel's heap-selected index set, returned in
    ascending index order. [R, L] fp32, [R] int64 -> [R, 512] int64.

    Kernel: min-heap over the first 512 scores, then stream i = 512..seq-1,
    replacing the heap front (lowest score, smallest index among equal
    scores) when score > front.score (equal scores never replace, since
    i > every index in the heap).  Resulting set, with T = 512th largest:
    every element > T, plus of the elements == T the ones that entered the
    heap (== T element j enters iff #(scores >= T in [0..j]) <= 512), minus
    the smallest-index entered ones that later elements > T evicted; i.e.
    the *last* (512 - #(> T)) entered == T elements."""
    R, L = s.shape
    idx = torch.arange(L, device=s.device)
    valid = idx.unsqueeze(0) < seq.unsqueeze(1)
    sm = s.masked_fill(~valid, float("-inf"))
    T = torch.topk(sm, TOPK, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    gt = valid & (sm > T)
    eq = valid & (sm == T)
    c_ge = (gt | eq).cumsum(1)
    rank_eq = eq.cumsum(1)
    entered_eq = eq & (c_ge <= TOPK)
    b = entered_eq.sum(1, keepdim=True)
    r = TOPK - gt.sum(1, keepdim=True)
    sel = gt | (entered_eq & (rank_eq > (b - r)))
    slot = sel.cumsum(1) - 1
    slot = torch.where(sel, slot, torch.full_like(slot, TOPK))  # dummy column
    out = torch.full((R, TOPK + 1), -1, dtype=torch.int64, device=s.device)
    out.scatter_(1, slot, idx.unsqueeze(0).expand(R, L))
    return out[:, :TOPK]


def topk_transform_512_cpu(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: torch.Tensor | None = None,
) -> None:
    """Per row b (seq_len clamped to [0, scores.size(1)]): raw = [0..seq_len)
    padded with -1 if seq_len <= 512, else the top-512 positions of
    scores[b, :seq_len] (ascending index order here; the kernel emits heap
    order).  out_page_indices[b, :512] = page_tables[b, raw // page_size] *
    page_size + raw % page_size (-1 where raw == -1); out_raw_indices[b, :512]
    = raw if given.  Columns >= 512 untouched."""
    _check(scores.dtype == torch.float32 and scores.dim() == 2,
           "topk_transform_512_cpu: scores must be a 2D float32 tensor")
    _check(out_page_indices.dtype == torch.int32 and out_page_indices.dim() == 2,
           "topk_transform_512_cpu: out_page_indices must be a 2D int32 tensor")
    _check(seq_lens.dim() == 1 and page_tables.dim() == 2,
           "topk_transform_512_cpu: seq_lens 1D, page_tables 2D")
    B, L = scores.shape
    _check(seq_lens.size(0) == B and page_tables.size(0) == B
           and out_page_indices.size(0) == B,
           "topk_transform_512_cpu: row counts must match scores")
    _check(out_page_indices.size(1) >= TOPK,
           "topk_transform_512_cpu: out_page_indices must have at least 512 columns")
    if out_raw_indices is not None:
        _check(out_raw_indices.dtype == torch.int32 and out_raw_indices.dim() == 2
               and out_raw_indices.shape == out_page_indices.shape,
               "topk_transform_512_cpu: out_raw_indices must be int32 and match "
               "out_page_indices' shape")
    page_size = int(page_size)
    _check(page_size > 0, "page_size must be positive")
    _check((page_size & (page_size - 1)) == 0, "page_size must be a power of 2")
    if B == 0:
        return

    seq = seq_lens.to(torch.int64).clamp(min=0, max=L)
    raw = torch.arange(TOPK, dtype=torch.int64).unsqueeze(0).repeat(B, 1)
    raw = torch.where(raw < seq.unsqueeze(1), raw, torch.full_like(raw, -1))
    big = (seq > TOPK).nonzero(as_tuple=True)[0]
    if big.numel() > 0:
        rows_per_chunk = max(1, _CHUNK_ELEMS // max(L, 1))
        for c0 in range(0, big.numel(), rows_per_chunk):
            rows = big[c0:c0 + rows_per_chunk]
            raw[rows] = _topk512_select_sorted(scores[rows], seq[rows])

    valid = raw >= 0
    safe = raw.clamp(min=0)
    page_idx = torch.div(safe, page_size, rounding_mode="floor")
    if bool((valid & (page_idx >= page_tables.size(1))).any()):
        raise IndexError("topk_transform_512_cpu: page_tables too narrow for seq_lens")
    page_idx = torch.where(valid, page_idx, torch.zeros_like(page_idx))
    phys = torch.gather(page_tables.to(torch.int64), 1, page_idx) if page_tables.size(1) > 0 \
        else torch.zeros_like(page_idx)
    page_slot = phys * page_size + safe % page_size
    page_slot = torch.where(valid, page_slot, torch.full_like(page_slot, -1))
    # int64 -> int32 wraps like the kernel's static_cast<int32_t>
    out_page_indices[:, :TOPK].copy_(page_slot.to(torch.int32))
    if out_raw_indices is not None:
        out_raw_indices[:, :TOPK].copy_(raw.to(torch.int32))


# ---------------------------------------------------------------------------
# fused_indexer_q_rope_quant_cpu
# ---------------------------------------------------------------------------


def fused_indexer_q_rope_quant_cpu(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_q_fp8: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    index_weights_out: torch.Tensor,
) -> None:
    """Per (token t < positions.numel(), head): GPT-J RoPE on the last rot_dim
    (= cos_sin_cache.size(-1)) dims with cos/sin = cache[pos, :half] /
    cache[pos, half:], rotated values bf16-round-tripped; amax = max(1e-4,
    |nope|, |rope_bf16|); scale = 2^ceil(log2(amax/448)); index_q_fp8 =
    fp8(clamp(x / scale, +-448)); index_weights_out = w * scale *
    softmax_scale * head_scale (fp32).  Mutates index_q_fp8, index_weights_out."""
    _check(positions.dim() == 1 and positions.dtype == torch.int64,
           "fused_indexer_q_rope_quant_cpu: positions must be a 1D int64 tensor")
    _check(index_q.dim() == 3 and index_q.dtype == torch.float32,
           "fused_indexer_q_rope_quant_cpu: index_q must be a 3D float32 tensor")
    _check(index_q_cos_sin_cache.dim() == 2 and index_q_cos_sin_cache.dtype == torch.float32,
           "fused_indexer_q_rope_quant_cpu: cos_sin_cache must be a 2D float32 tensor")
    _check(index_q_fp8.shape == index_q.shape and index_q_fp8.dtype == torch.float8_e4m3fn,
           "fused_indexer_q_rope_quant_cpu: index_q_fp8 must match index_q, float8_e4m3fn")
    _check(index_weights.dim() == 2 and index_weights.dtype == torch.float32,
           "fused_indexer_q_rope_quant_cpu: index_weights must be 2D float32")
    _check(index_weights_out.shape == index_weights.shape
           and index_weights_out.dtype == torch.float32,
           "fused_indexer_q_rope_quant_cpu: index_weights_out must match index_weights, fp32")
    T = positions.size(0)
    H, D = index_q.size(1), index_q.size(2)
    half = index_q_cos_sin_cache.size(-1) // 2
    rot = 2 * half
    nope = D - rot
    _check(D % 16 == 0 and nope % 16 == 0 and half % 16 == 0,
           "fused_indexer_q_rope_quant_cpu: head_dim, head_dim-rot_dim, rot_dim/2 "
           "must be multiples of 16")
    _check(index_q.size(0) >= T and index_weights.size(0) >= T,
           "fused_indexer_q_rope_quant_cpu: fewer index_q/index_weights rows than positions")
    _check(index_weights.size(1) >= H, "fused_indexer_q_rope_quant_cpu: index_weights too narrow")
    if T == 0:
        return
    if bool((positions < 0).any()):
        raise IndexError("fused_indexer_q_rope_quant_cpu: negative position")
    sm = _f32_scalar(index_weights_softmax_scale)
    hs = _f32_scalar(index_weights_head_scale)
    eps = _f32_scalar(1e-4)
    tok_chunk = max(1, _CHUNK_ELEMS // max(H * D * 4, 1))
    for t0 in range(0, T, tok_chunk):
        t1 = min(T, t0 + tok_chunk)
        pos = positions[t0:t1]
        cs = index_q_cos_sin_cache[pos]  # IndexError on out-of-range positions
        cos = cs[:, :half].unsqueeze(1)  # [t, 1, half]
        sin = cs[:, half:rot].unsqueeze(1)
        q = index_q[t0:t1]
        q_nope = q[..., :nope]
        q_rope = _bf16_round(_gptj_rope_fma(q[..., nope:], cos, sin))
        x = torch.cat((q_nope, q_rope), dim=-1)  # [t, H, D]
        amax = torch.maximum(x.abs().amax(dim=-1), eps)  # [t, H]
        exponent = torch.ceil(torch.log2(amax / FP8_MAX))
        scale = torch.exp2(exponent)
        inv_scale = 1.0 / scale
        y = (x * inv_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
        index_q_fp8[t0:t1].copy_(y.to(torch.float8_e4m3fn))
        w = index_weights[t0:t1, :H] * scale
        w = w * sm
        w = w * hs
        index_weights_out[t0:t1, :H].copy_(w)


# ---------------------------------------------------------------------------
# save_partial_states_cpu
# ---------------------------------------------------------------------------


def _check_state_cache(state_cache: torch.Tensor, name: str) -> None:
    _check(state_cache.dim() == 3 and state_cache.dtype == torch.float32,
           f"{name}: state_cache must be a 3D fp32 tensor")
    _check(state_cache.stride(2) == 1 and state_cache.stride(1) == state_cache.size(2),
           f"{name}: state_cache rows must be contiguous within a block")


def save_partial_states_cpu(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """For each token with slot >= 0: state_cache[slot // bs, slot % bs, :W] =
    kv[t]; state_cache[..., W:2W] = score[t] + ape[position % ape.size(0)].
    W = kv.size(1), bs = state_cache.size(1); the block stride of the 3D view is
    honored (may be padded).  Mutates state_cache."""
    name = "save_partial_states_cpu"
    _check(kv.dim() == 2 and kv.dtype == torch.float32, f"{name}: kv must be a 2D fp32 tensor")
    _check(score.shape == kv.shape and score.dtype == torch.float32,
           f"{name}: score must match kv's shape/dtype")
    _check(ape.dim() == 2 and ape.size(1) == kv.size(1) and ape.dtype == torch.float32,
           f"{name}: ape must be [compress_ratio, state_width] fp32")
    _check(positions.dtype == torch.int64 and positions.numel() == kv.size(0),
           f"{name}: positions must be int64 with num_tokens entries")
    _check(slot_mapping.dtype == torch.int64 and slot_mapping.numel() == kv.size(0),
           f"{name}: slot_mapping must be int64 with num_tokens entries")
    _check_state_cache(state_cache, name)
    _check(state_cache.size(2) == 2 * kv.size(1),
           f"{name}: state_cache must be [num_blocks, block_size, 2*state_width]")
    sm = slot_mapping.reshape(-1)
    idx = (sm >= 0).nonzero(as_tuple=True)[0]
    if idx.numel() == 0:
        return
    bs = state_cache.size(1)
    slots = sm[idx]
    blk = torch.div(slots, bs, rounding_mode="floor")
    pib = slots % bs
    if bool((blk >= state_cache.size(0)).any()):
        raise IndexError(f"{name}: slot_mapping entry beyond state_cache")
    pos = positions.reshape(-1)[idx]
    ape_row = torch.fmod(pos, ape.size(0))  # C++ '%' (truncating)
    if bool((ape_row < 0).any()):
        raise IndexError(f"{name}: negative position for a valid slot")
    row = torch.cat((kv[idx], score[idx] + ape[ape_row]), dim=-1)
    state_cache[blk, pib] = row


# ---------------------------------------------------------------------------
# compress_norm_rope_store_cpu / compress_norm_rope_store_indexer_cpu
# ---------------------------------------------------------------------------


def _compress_common_checks(name, state_cache, gather_slots, positions, kv_slot_mapping,
                            rms_norm_weight, cos_sin_cache, kv_cache_2d, head_dim):
    _check_state_cache(state_cache, name)
    _check(gather_slots.dim() == 2 and gather_slots.dtype == torch.int64,
           f"{name}: gather_slots must be a 2D int64 tensor")
    n = gather_slots.size(0)
    _check(positions.dtype == torch.int64 and positions.numel() == n,
           f"{name}: positions must be int64 with num_tokens entries")
    _check(kv_slot_mapping.dtype == torch.int64 and kv_slot_mapping.numel() == n,
           f"{name}: kv_slot_mapping must be int64 with num_tokens entries")
    _check(rms_norm_weight.numel() == head_dim,
           f"{name}: rms_norm_weight must have head_dim ({head_dim}) entries")
    _check(kv_cache_2d.dim() == 2 and kv_cache_2d.dtype == torch.uint8,
           f"{name}: kv_cache_2d must be a 2D uint8 tensor")
    _check(state_cache.size(2) % 2 == 0, f"{name}: state_cache width must be even")
    _check(rms_norm_weight.dtype == torch.float32 and cos_sin_cache.dtype == torch.float32,
           f"{name}: rms_norm_weight/cos_sin_cache must be float32")



def _compress_prelude(name, state_cache, gather_slots, positions, kv_slot_mapping,
                      rms_norm_weight, cos_sin_cache, kv_cache_2d, kv_cache_block_size,
                      compress_ratio, head_dim):
    """The two compress ops' shared start: checks, the boundary tokens that write (``sel``;
    empty: nothing to do) and the token chunk bounding the pooled window's memory."""
    _compress_common_checks(name, state_cache, gather_slots, positions, kv_slot_mapping,
                            rms_norm_weight, cos_sin_cache, kv_cache_2d, head_dim)
    compress_ratio = int(compress_ratio)
    sel = _select_compress_tokens(positions, kv_slot_mapping, compress_ratio)
    chunk = max(1, _CHUNK_ELEMS // max(gather_slots.size(1) * head_dim * 4, 1))
    return compress_ratio, int(kv_cache_block_size), sel, chunk

def _compress_pool_norm_rope(
    state_cache, gather_slots, positions, rms_norm_weight, rms_norm_eps,
    cos_sin_cache, compress_ratio, head_dim, rope_dim,
):
    """Shared prologue for the selected tokens: per-channel softmax pooling
    over the window (invalid slots excluded), RMSNorm (x * inv_rms * w),
    GPT-J RoPE on the last rope_dim dims at compressed_pos.  Returns
    (normed_pre_rope, normed_post_rope) both fp32 [N, head_dim]."""
    N, W = gather_slots.shape
    state_width = state_cache.size(2) // 2
    sbs = state_cache.size(1)
    valid = gather_slots >= 0  # [N, W]
    safe = gather_slots.clamp(min=0)
    blk = torch.div(safe, sbs, rounding_mode="floor")
    pib = safe % sbs
    if bool((valid & (blk >= state_cache.size(0))).any()):
        raise IndexError("compress: gather_slots entry beyond state_cache")
    w_idx = torch.arange(W, device=gather_slots.device)
    head_off = torch.where(w_idx >= compress_ratio, head_dim, 0)  # [W]
    col = head_off.unsqueeze(-1) + torch.arange(head_dim)  # [W, hd]
    _check(int(col.max()) + state_width < state_cache.size(2),
           "compress: state_cache too narrow for window/head_dim")
    b3 = blk.unsqueeze(-1)
    p3 = pib.unsqueeze(-1)
    kv_vals = state_cache[b3, p3, col.unsqueeze(0)]  # [N, W, hd]
    sc_vals = state_cache[b3, p3, (col + state_width).unsqueeze(0)]
    v3 = valid.unsqueeze(-1)
    # An invalid slot reads row 0 above (whatever bytes it holds): skipped, as the kernel
    # skips it, never multiplied by a zero weight (0 * inf or 0 * NaN would leak in).
    kv_vals = kv_vals.masked_fill(~v3, 0.0)
    sc_masked = sc_vals.masked_fill(~v3, float("-inf"))
    mx = sc_masked.amax(dim=1, keepdim=True)  # -inf if no valid slot
    e = torch.exp(sc_masked - mx).masked_fill(~v3, 0.0)
    denom = e.sum(dim=1)
    acc = (e * kv_vals).sum(dim=1)
    pooled = acc / denom  # NaN when the whole window is invalid (as kernel)

    sq = (pooled * pooled).sum(dim=-1, keepdim=True)
    inv_rms = 1.0 / torch.sqrt(sq / float(head_dim) + _f32_scalar(rms_norm_eps))
    normed = pooled * inv_rms * rms_norm_weight.reshape(-1).float()

    pos = positions.reshape(-1)
    cpos = torch.div(pos, compress_ratio, rounding_mode="trunc") * compress_ratio
    half = rope_dim // 2
    flat = cos_sin_cache.reshape(-1)
    base = (cpos * COMPRESS_COS_SIN_WIDTH).unsqueeze(-1)
    ar = torch.arange(half)
    if bool(((base + COMPRESS_COS_SIN_WIDTH > flat.numel()) | (base < 0)).any()):
        raise IndexError("compress: compressed position beyond cos_sin_cache")
    cos = flat[base + ar]
    sin = flat[base + half + ar]
    nope = head_dim - rope_dim
    rotated = _gptj_rope_fma(normed[:, nope:], cos, sin)
    post = torch.cat((normed[:, :nope], rotated), dim=-1)
    return normed, post


def _select_compress_tokens(positions, kv_slot_mapping, compress_ratio):
    pos = positions.reshape(-1)
    ks = kv_slot_mapping.reshape(-1)
    boundary = torch.fmod(pos + 1, compress_ratio) == 0  # C++ '%'
    return (boundary & (ks >= 0)).nonzero(as_tuple=True)[0]


def _write_token_bytes(kv_cache_2d, blk, col_start, data):
    """kv_cache_2d[blk[i], col_start[i] + j] = data[i, j] through the view's
    strides; out-of-range columns/rows raise instead of spilling."""
    ncols = data.size(1)
    cols = col_start.unsqueeze(-1) + torch.arange(ncols)
    if bool((cols >= kv_cache_2d.size(1)).any()) or bool((blk >= kv_cache_2d.size(0)).any()):
        raise IndexError("compress: kv slot beyond kv_cache_2d")
    kv_cache_2d[blk.unsqueeze(-1), cols] = data


def compress_norm_rope_store_cpu(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """head_dim=512 compressor.  Only tokens with (pos+1) % ratio == 0 and
    kv_slot >= 0 write.  NoPE (first 448 of the pre-RoPE normed vector,
    bf16-rounded) -> 7 x 64-wide UE8M0 fp8 blocks; RoPE (last 64, rotated in
    fp32) -> bf16.  Cache row kv_slot // bs, token p = kv_slot % bs: bytes
    [p*576, p*576+448) fp8, [+448, +576) bf16 rope, scales at bs*576 + p*8
    (7 exponent+127 bytes, then a 0 pad byte).  Mutates kv_cache_2d."""
    compress_ratio, bs, sel, chunk = _compress_prelude(
        "compress_norm_rope_store_cpu", state_cache, gather_slots, positions, kv_slot_mapping,
        rms_norm_weight, cos_sin_cache, kv_cache_2d, kv_cache_block_size, compress_ratio,
        MAIN_HEAD_DIM)
    for c0 in range(0, sel.numel(), chunk):
        idx = sel[c0:c0 + chunk]
        normed, post = _compress_pool_norm_rope(
            state_cache, gather_slots[idx], positions.reshape(-1)[idx], rms_norm_weight,
            rms_norm_eps, cos_sin_cache, compress_ratio, MAIN_HEAD_DIM, MAIN_ROPE_DIM)
        n = idx.numel()
        nope = _bf16_round(normed[:, :MAIN_NOPE_DIM]).reshape(n, MAIN_NUM_QUANT_BLOCKS,
                                                             MAIN_QUANT_BLOCK)
        amax = nope.abs().amax(dim=-1)
        scale = torch.maximum(amax / FP8_MAX, _f32_scalar(MAIN_QUANT_EPS))
        ceil_log2 = torch.ceil(torch.log2(scale))
        inv = 1.0 / torch.exp2(ceil_log2)
        q = (nope * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
        nope_bytes = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, MAIN_NOPE_DIM)
        scale_bytes = (ceil_log2.to(torch.int32) + 127).to(torch.uint8)  # [n, 7]
        rope_bytes = post[:, MAIN_NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
        data = torch.cat((nope_bytes, rope_bytes), dim=-1)  # [n, 576]
        scale_row = torch.cat((scale_bytes, scale_bytes.new_zeros(n, 1)), dim=-1)  # [n, 8]

        slot = kv_slot_mapping.reshape(-1)[idx]
        blk = torch.div(slot, bs, rounding_mode="floor")
        p = slot % bs
        _write_token_bytes(kv_cache_2d, blk, p * MAIN_TOKEN_BYTES, data)
        _write_token_bytes(kv_cache_2d, blk, bs * MAIN_TOKEN_BYTES + p * MAIN_SCALE_BYTES,
                           scale_row)


def compress_norm_rope_store_indexer_cpu(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """head_dim=128 indexer compressor.  Same selection/pool/RMSNorm/RoPE as
    the 512 path, then the whole post-RoPE vector is bf16-rounded and
    quantized as ONE block: absmax = max(1e-4, |x|), scale = 2^ceil(log2(
    absmax/448)); fp8 bytes at [p*128, p*128+128) of row kv_slot // bs, the raw
    fp32 scale at bs*128 + p*4.  Mutates kv_cache_2d."""
    compress_ratio, bs, sel, chunk = _compress_prelude(
        "compress_norm_rope_store_indexer_cpu", state_cache, gather_slots, positions,
        kv_slot_mapping, rms_norm_weight, cos_sin_cache, kv_cache_2d, kv_cache_block_size,
        compress_ratio, INDEX_HEAD_DIM)
    for c0 in range(0, sel.numel(), chunk):
        idx = sel[c0:c0 + chunk]
        _, post = _compress_pool_norm_rope(
            state_cache, gather_slots[idx], positions.reshape(-1)[idx], rms_norm_weight,
            rms_norm_eps, cos_sin_cache, compress_ratio, INDEX_HEAD_DIM, IDX_ROPE_DIM)
        n = idx.numel()
        x = _bf16_round(post)
        absmax = torch.maximum(x.abs().amax(dim=-1), _f32_scalar(1e-4))
        exponent = torch.ceil(torch.log2(absmax / FP8_MAX))
        scale = torch.exp2(exponent)
        inv = 1.0 / scale
        q = (x * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
        fp8_bytes = q.to(torch.float8_e4m3fn).view(torch.uint8)  # [n, 128]
        scale_bytes = scale.to(torch.float32).contiguous().view(torch.uint8).reshape(n, 4)

        slot = kv_slot_mapping.reshape(-1)[idx]
        blk = torch.div(slot, bs, rounding_mode="floor")
        p = slot % bs
        _write_token_bytes(kv_cache_2d, blk, p * INDEX_HEAD_DIM, fp8_bytes)
        _write_token_bytes(kv_cache_2d, blk, bs * INDEX_HEAD_DIM + p * INDEX_SCALE_BYTES,
                           scale_bytes)


OPS = {
    "fp8_paged_mqa_logits_cpu": (
        "fp8_paged_mqa_logits_cpu(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, "
        "Tensor seq_lens, Tensor page_table, int block_size, int max_seq_len) -> Tensor",
        fp8_paged_mqa_logits_cpu,
    ),
    "topk_transform_512_cpu": (
        "topk_transform_512_cpu(Tensor scores, Tensor seq_lens, Tensor page_tables, "
        "Tensor(a!) out_page_indices, int page_size, Tensor(b!)? out_raw_indices) -> ()",
        topk_transform_512_cpu,
    ),
    "fused_indexer_q_rope_quant_cpu": (
        "fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
        "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
        "float index_weights_softmax_scale, float index_weights_head_scale, "
        "Tensor(b!) index_weights_out) -> ()",
        fused_indexer_q_rope_quant_cpu,
    ),
    "save_partial_states_cpu": (
        "save_partial_states_cpu(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
        "Tensor(a!) state_cache, Tensor slot_mapping) -> ()",
        save_partial_states_cpu,
    ),
    "compress_norm_rope_store_cpu": (
        "compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, "
        "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
        "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
        "int kv_cache_block_size, int compress_ratio) -> ()",
        compress_norm_rope_store_cpu,
    ),
    "compress_norm_rope_store_indexer_cpu": (
        "compress_norm_rope_store_indexer_cpu(Tensor state_cache, Tensor gather_slots, "
        "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
        "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
        "int kv_cache_block_size, int compress_ratio) -> ()",
        compress_norm_rope_store_indexer_cpu,
    ),
}


# ---------------------------------------------------------------------------
# self-check (independent eager references, adapted from vLLM's
# tests/kernels/cpu/..deepseek_v4.. parity tests; per-token loops are fine here)
# ---------------------------------------------------------------------------



def self_check() -> None:
    """Compares every op of ``OPS`` with an independent eager reference (lab only).

    Pure: runs under ``torch.random.fork_rng`` with its own seed (the caller's RNG state is
    restored), registers nothing and leaves torch's thread settings alone. Raises
    AssertionError naming every failed check; on success prints one summary line."""
    _selfcheck.run("indexer", _run_checks)


def _run_checks() -> list[tuple[str, bool, str]]:
    """The checks of ``self_check``: [(name, ok, detail)]."""
    import heapq

    results: list[tuple[str, bool, str]] = []

    def report(name: str, ok: bool, detail: str = "") -> None:
        results.append((name, bool(ok), detail))

    def fp8_ulp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        def ordv(x):
            u = x.contiguous().view(torch.uint8).to(torch.int32)
            mag = u & 0x7F
            return torch.where((u & 0x80) != 0, -mag, mag)
        return (ordv(a) - ordv(b)).abs()

    def bf16_ulp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        def ordv(x):
            u = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
            mag = u & 0x7FFF
            return torch.where((u & 0x8000) != 0, -mag, mag)
        return (ordv(a) - ordv(b)).abs()

    def make_cos_sin(max_pos, rot_dim):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
        ang = torch.arange(max_pos).float().unsqueeze(-1) * inv_freq
        return torch.cat((ang.cos(), ang.sin()), dim=-1).contiguous()

    def ref_rope(x, cos, sin):
        xe, xo = x[..., 0::2], x[..., 1::2]
        return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), -1).flatten(-2)

    # ---------------- fp8_paged_mqa_logits_cpu ----------------
    def rand_fp8(*shape):
        return torch.randn(shape).clamp(-3, 3).to(torch.float8_e4m3fn)

    for block_size, pad in ((16, 0), (64, 48)):
        H = 4
        seq_lens = [1, block_size + 7, 3 * block_size, 0, 2 * block_size - 1]
        per_req = [-(-s // block_size) for s in seq_lens]
        n_pages = sum(per_req) + 2
        width = block_size * (INDEX_HEAD_DIM + INDEX_SCALE_BYTES)
        buf = torch.zeros(n_pages, width + pad, dtype=torch.uint8)
        pages = buf[:, :width]
        perm = torch.randperm(n_pages)
        pt = torch.full((len(seq_lens), max(per_req) + 1), -1, dtype=torch.int32)
        ref_k, ref_s, nxt = [], [], 0
        for b, s in enumerate(seq_lens):
            ks, ss = [], []
            for p in range(per_req[b]):
                phys = int(perm[nxt]); nxt += 1
                pt[b, p] = phys
                k = rand_fp8(block_size, INDEX_HEAD_DIM)
                sc = torch.rand(block_size) * 0.05 + 0.01
                pages[phys, :block_size * 128].copy_(k.view(torch.uint8).flatten())
                pages[phys, block_size * 128:].copy_(sc.view(torch.uint8))
                n_here = min(block_size, s - p * block_size)
                ks.append(k[:n_here]); ss.append(sc[:n_here])
            ref_k.append(torch.cat(ks) if ks else torch.empty(0, 128, dtype=torch.float8_e4m3fn))
            ref_s.append(torch.cat(ss) if ss else torch.empty(0))
        B = len(seq_lens)
        q = rand_fp8(B, H, INDEX_HEAD_DIM)
        w = torch.rand(B, H) * 0.1
        max_len = max(seq_lens)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        out = fp8_paged_mqa_logits_cpu(q, pages, w, seq_t, pt, block_size, max_len)
        ok = out.shape == (B, max_len) and out.dtype == torch.float32
        maxerr = 0.0
        for b, s in enumerate(seq_lens):
            if s == 0:
                ok &= bool(torch.isneginf(out[b]).all())
                continue
            dot = torch.einsum("jd,hd->jh", ref_k[b].float(), q[b].float()).clamp(min=0)
            r = (dot * w[b]).sum(1) * ref_s[b]
            maxerr = max(maxerr, (out[b, :s] - r).abs().max().item())
            ok &= torch.allclose(out[b, :s], r, atol=1e-4, rtol=1e-5)
            ok &= bool(torch.isneginf(out[b, s:]).all())
        report(f"fp8_paged_mqa_logits bs={block_size} pad={pad}", ok, f"maxerr={maxerr:.2e}")
        # max_seq_len smaller than some seq_lens (kernel computes t < max_seq_len only)
        out2 = fp8_paged_mqa_logits_cpu(q, pages, w, seq_t.long(), pt.long(), block_size, 5)
        report("fp8_paged_mqa_logits truncated max_seq_len",
               out2.shape == (B, 5) and torch.equal(
                   torch.nan_to_num(out2, neginf=-1), torch.nan_to_num(out[:, :5], neginf=-1)))

    # ---------------- topk_transform_512_cpu ----------------
    def heap_ref(row, seq_len):
        # faithful replay of the kernel's heap streaming (set only)
        if seq_len <= TOPK:
            return list(range(seq_len))
        h = [(float(row[i]), i) for i in range(TOPK)]
        heapq.heapify(h)  # front = lowest score, smallest index among ties
        for i in range(TOPK, seq_len):
            s = float(row[i])
            fs, fi = h[0]
            if s > fs or (s == fs and i < fi):
                heapq.heapreplace(h, (s, i))
        return sorted(i for _, i in h)

    for page_size, tie_mode in ((1, False), (4, True), (64, True), (16, False)):
        L = 1600
        seq_list = [0, 17, 512, 513, 1299, 1600, 700]
        B = len(seq_list)
        if tie_mode:
            scores = torch.randint(0, 6, (B, L)).float()  # lots of ties
            scores[2, 100:] = float("-inf")
        else:
            scores = torch.randn(B, L)
        seq_t = torch.tensor(seq_list, dtype=torch.int64)
        n_lp = -(-L // page_size)
        page_tables = torch.randint(0, 10000, (B, n_lp), dtype=torch.int32)
        out_page = torch.zeros(B, TOPK, dtype=torch.int32)
        raw_buf = torch.zeros(B, TOPK + 8, dtype=torch.int32)
        out_raw = raw_buf[:, :TOPK]  # strided view (row stride 520)
        topk_transform_512_cpu(scores, seq_t, page_tables, out_page, page_size, out_raw)
        ok = bool((raw_buf[:, TOPK:] == 0).all())
        for b, s in enumerate(seq_list):
            exp = heap_ref(scores[b], s)
            got = out_raw[b].tolist()
            n = len(exp)
            ok &= got[:n] == exp and all(x == -1 for x in got[n:])
            exp_page = [int(page_tables[b, i // page_size]) * page_size + i % page_size
                        for i in exp]
            ok &= out_page[b].tolist() == exp_page + [-1] * (TOPK - n)
        report(f"topk_transform_512 page_size={page_size} ties={tie_mode}", ok)
    # without out_raw_indices
    out_page2 = torch.zeros(B, TOPK, dtype=torch.int32)
    topk_transform_512_cpu(scores, seq_t, page_tables, out_page2, page_size, None)
    report("topk_transform_512 no raw", torch.equal(out_page2, out_page))

    # ---------------- fused_indexer_q_rope_quant_cpu ----------------
    def q_ref(positions, q, csc, weights, sm_scale, head_scale):
        half = csc.shape[-1] // 2
        nope_dim = q.shape[-1] - 2 * half
        pcs = csc.float()[positions]
        cos = pcs[:, :half].unsqueeze(1)
        sin = pcs[:, half:].unsqueeze(1)
        nope = q[..., :nope_dim]
        rot = q[..., nope_dim:]
        xe, xo = rot[..., 0::2], rot[..., 1::2]
        re = (xe * cos - xo * sin).to(torch.bfloat16).float()
        ro = (xo * cos + xe * sin).to(torch.bfloat16).float()
        comb = torch.cat((nope, torch.stack((re, ro), -1).flatten(-2)), -1)
        amax = comb.abs().amax(-1).clamp(min=1e-4)
        scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
        qf = (comb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return qf, weights * scale * sm_scale * head_scale

    for T in (1, 37):
        Hq = 8
        q = torch.randn(T, Hq, INDEX_HEAD_DIM)
        q_big = torch.randn(T, Hq + 2, INDEX_HEAD_DIM)[:, :Hq]  # strided view
        q_big.copy_(q)
        pos = torch.randint(0, 4096, (T,), dtype=torch.int64)
        csc = torch.randn(4096, 64)
        wts = torch.randn(T, Hq)
        smx, hsx = INDEX_HEAD_DIM ** -0.5, Hq ** -0.5
        q8 = torch.empty(T, Hq, INDEX_HEAD_DIM, dtype=torch.float8_e4m3fn)
        wo_buf = torch.zeros(T, Hq + 3)
        wo = wo_buf[:, :Hq]
        fused_indexer_q_rope_quant_cpu(pos, q_big, csc, q8, wts, smx, hsx, wo)
        rq, rw = q_ref(pos, q, csc, wts, smx, hsx)
        ulp = fp8_ulp(q8, rq)
        ok = int(ulp.max()) <= 1 and torch.allclose(wo, rw, rtol=1e-5, atol=1e-6)
        ok &= bool((wo_buf[:, Hq:] == 0).all())
        report(f"fused_indexer_q_rope_quant T={T}", ok,
               f"max_ulp={int(ulp.max())} exact={float((ulp == 0).float().mean()):.5f}")

    # ---------------- save_partial_states_cpu ----------------
    def padded_cache(nb, bs, width, pad):
        stride = bs * width + pad
        flat = torch.randn(nb, stride)
        return flat, torch.as_strided(flat, (nb, bs, width), (stride, width, 1))

    for T, pad in ((1, 0), (17, 24)):
        ratio, bs, sw = 4, 4, 512
        nb = (T + 4 + bs - 1) // bs + 1
        kvs = torch.randn(T, 2 * sw)  # fused kv_score projection, column-split
        kv, sc = kvs[:, :sw], kvs[:, sw:]
        ape = torch.randn(ratio, sw)
        pos = torch.randint(0, 4096, (T,), dtype=torch.int64)
        flat_a, ca = padded_cache(nb, bs, 2 * sw, pad)
        flat_b = flat_a.clone()
        cb = torch.as_strided(flat_b, ca.shape, ca.stride())
        sm_ = torch.randperm(nb * bs)[:T].to(torch.int64)
        if T > 1:
            sm_[-1] = -1
        # eager ref (vLLM's _run_save_partial_states_eager)
        idx = (sm_ >= 0).nonzero(as_tuple=True)[0]
        sl = sm_[idx]
        ca[sl // bs, sl % bs, :sw] = kv[idx]
        ca[sl // bs, sl % bs, sw:] = sc[idx] + ape[pos[idx] % ratio]
        save_partial_states_cpu(kv, sc, ape, pos, cb, sm_)
        report(f"save_partial_states T={T} pad={pad}", torch.equal(flat_a, flat_b))

    # ---------------- compress (main + indexer) ----------------
    def compress_inputs(T, ratio, overlap, hd, pad=24):
        coff = 1 + int(overlap)
        sw = coff * hd
        W = coff * ratio
        sbs = 4 if ratio == 4 else 8
        nslots = T * W + 8
        nb = (nslots + sbs - 1) // sbs + 1
        flat, state = padded_cache(nb, sbs, 2 * sw, pad)
        gs = torch.randint(0, nb * sbs, (T, W), dtype=torch.int64)
        inv = torch.rand(T, W) < 0.1
        inv[:, -1] = False
        gs = torch.where(inv, torch.full_like(gs, -1), gs)
        base = (torch.arange(T) + 1) * ratio
        is_b = torch.arange(T) % 2 == 0
        pos = torch.where(is_b, base - 1, base + 1).to(torch.int64)
        ks = torch.arange(T, dtype=torch.int64)
        if T > 1:
            ks[1] = -1
        rw = torch.randn(hd)
        csc = make_cos_sin(4096, 64)
        return state, gs, pos, ks, rw, csc, is_b

    def pool_norm_ref(state, slots, position, rw, eps, csc, ratio, hd, nope_dim):
        sw = state.shape[-1] // 2
        sbs = state.shape[1]
        W = slots.shape[0]
        head_off = torch.where(torch.arange(W) >= ratio, hd, 0)
        valid = slots >= 0
        safe = slots.clamp(min=0)
        rows = state[safe // sbs, safe % sbs]
        col = head_off.unsqueeze(-1) + torch.arange(hd)
        kvv = torch.gather(rows, 1, col)
        scv = torch.gather(rows, 1, sw + col)
        scv = torch.where(valid.unsqueeze(-1), scv, torch.full_like(scv, -torch.inf))
        comp = (kvv * torch.softmax(scv, 0)).sum(0)
        normed = comp * torch.rsqrt(comp.pow(2).mean() + eps) * rw
        cp = (position // ratio) * ratio
        cos, sin = csc[cp, :32], csc[cp, 32:]
        rot = ref_rope(normed[nope_dim:].clone(), cos, sin)
        return normed, rot

    eps = 1e-6
    for (ratio, overlap), T in (((128, False), 1), ((128, False), 9), ((4, True), 17)):
        # main, head_dim=512
        state, gs, pos, ks, rw, csc, is_b = compress_inputs(T, ratio, overlap, MAIN_HEAD_DIM)
        bs, cpad = 16, 32
        nbk = (T + bs - 1) // bs + 1
        bw = bs * (MAIN_TOKEN_BYTES + MAIN_SCALE_BYTES)
        pad_ref = torch.randint(0, 256, (nbk, bw + cpad), dtype=torch.uint8)
        pad_imp = pad_ref.clone()
        kref, kimp = pad_ref[:, :bw], pad_imp[:, :bw]
        for t in range(T):
            if (int(pos[t]) + 1) % ratio != 0 or int(ks[t]) < 0:
                continue
            normed, rot = pool_norm_ref(state, gs[t], int(pos[t]), rw, eps, csc, ratio,
                                        MAIN_HEAD_DIM, MAIN_NOPE_DIM)
            qi = normed.to(torch.bfloat16).float()[:MAIN_NOPE_DIM].view(7, 64)
            amax = qi.abs().amax(-1)
            # kernel formula: max(amax / 448, 1e-4) (vLLM's test eager clamps amax first)
            e = torch.ceil(torch.log2(torch.clamp(amax / FP8_MAX, min=1e-4)))
            f8 = (qi * torch.exp2(-e).unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
            s = int(ks[t]); b_, p_ = s // bs, s % bs
            o = p_ * MAIN_TOKEN_BYTES
            kref[b_, o:o + 448] = f8.reshape(-1).view(torch.uint8)
            kref[b_, o + 448:o + 576] = rot.to(torch.bfloat16).contiguous().view(torch.uint8)
            so = bs * MAIN_TOKEN_BYTES + p_ * MAIN_SCALE_BYTES
            kref[b_, so:so + 7] = (e + 127).clamp(0, 255).to(torch.uint8)
            kref[b_, so + 7] = 0
        compress_norm_rope_store_cpu(state, gs, pos, ks, rw, eps, csc, kimp, bs, ratio)
        # byte-level: regions other than rope must match (<=1 fp8 ulp / exact scales),
        # rope <=1 bf16 ulp; padding columns untouched
        ok = torch.equal(pad_ref[:, bw:], pad_imp[:, bw:])
        max_nope = max_rope = 0
        for t in range(T):
            s = int(ks[t])
            if s < 0 or not bool(is_b[t]):
                continue
            b_, p_ = s // bs, s % bs
            o = p_ * MAIN_TOKEN_BYTES
            nope_imp = kimp[b_, o:o + 448].view(torch.float8_e4m3fn)
            nope_ref = kref[b_, o:o + 448].view(torch.float8_e4m3fn)
            max_nope = max(max_nope, int(fp8_ulp(nope_imp, nope_ref).max()))
            rope_imp = kimp[b_, o + 448:o + 576].contiguous().view(torch.bfloat16)
            rope_ref = kref[b_, o + 448:o + 576].contiguous().view(torch.bfloat16)
            max_rope = max(max_rope, int(bf16_ulp(rope_imp, rope_ref).max()))
            so = bs * MAIN_TOKEN_BYTES + p_ * MAIN_SCALE_BYTES
            ok &= torch.equal(kimp[b_, so:so + 8], kref[b_, so:so + 8])
        # untouched token bytes identical
        mask = torch.ones_like(kref, dtype=torch.bool)
        for t in range(T):
            s = int(ks[t])
            if s < 0 or not bool(is_b[t]):
                continue
            b_, p_ = s // bs, s % bs
            mask[b_, p_ * 576:(p_ + 1) * 576] = False
            so = bs * 576 + p_ * 8
            mask[b_, so:so + 8] = False
        ok &= torch.equal(kimp[mask], kref[mask])
        ok &= max_nope <= 1 and max_rope <= 1
        report(f"compress_norm_rope_store ratio={ratio} T={T}", ok,
               f"nope_ulp={max_nope} rope_ulp={max_rope}")

        # indexer, head_dim=128
        state, gs, pos, ks, rw, csc, is_b = compress_inputs(T, ratio, overlap, INDEX_HEAD_DIM)
        bw = bs * (INDEX_HEAD_DIM + INDEX_SCALE_BYTES)
        pad_ref = torch.randint(0, 256, (nbk, bw + cpad), dtype=torch.uint8)
        pad_imp = pad_ref.clone()
        kref, kimp = pad_ref[:, :bw], pad_imp[:, :bw]
        for t in range(T):
            if (int(pos[t]) + 1) % ratio != 0 or int(ks[t]) < 0:
                continue
            normed, rot = pool_norm_ref(state, gs[t], int(pos[t]), rw, eps, csc, ratio,
                                        INDEX_HEAD_DIM, IDX_NOPE_DIM)
            full = torch.cat((normed[:IDX_NOPE_DIM], rot)).to(torch.bfloat16).float()
            amax = full.abs().amax().clamp(min=1e-4)
            scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
            f8 = (full / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            s = int(ks[t]); b_, p_ = s // bs, s % bs
            kref[b_, p_ * 128:(p_ + 1) * 128] = f8.view(torch.uint8)
            so = bs * 128 + p_ * 4
            kref[b_, so:so + 4] = scale.reshape(1).view(torch.uint8)
        compress_norm_rope_store_indexer_cpu(state, gs, pos, ks, rw, eps, csc, kimp, bs, ratio)
        ok = torch.equal(pad_ref[:, bw:], pad_imp[:, bw:])
        mx_ulp = 0
        mask = torch.ones_like(kref, dtype=torch.bool)
        for t in range(T):
            s = int(ks[t])
            if s < 0 or not bool(is_b[t]):
                continue
            b_, p_ = s // bs, s % bs
            tok_imp = kimp[b_, p_ * 128:(p_ + 1) * 128].view(torch.float8_e4m3fn)
            tok_ref = kref[b_, p_ * 128:(p_ + 1) * 128].view(torch.float8_e4m3fn)
            mx_ulp = max(mx_ulp, int(fp8_ulp(tok_imp, tok_ref).max()))
            so = bs * 128 + p_ * 4
            ok &= torch.equal(kimp[b_, so:so + 4], kref[b_, so:so + 4])
            mask[b_, p_ * 128:(p_ + 1) * 128] = False
            mask[b_, so:so + 4] = False
        ok &= torch.equal(kimp[mask], kref[mask]) and mx_ulp <= 1
        report(f"compress_norm_rope_store_indexer ratio={ratio} T={T}", ok, f"fp8_ulp={mx_ulp}")

    # ---------------- end-to-end: indexer compress -> paged logits ----------------
    T, ratio = 9, 4
    state, gs, pos, ks, rw, csc, is_b = compress_inputs(T, ratio, True, INDEX_HEAD_DIM)
    pos = (torch.arange(T, dtype=torch.int64) + 1) * ratio - 1  # all boundaries
    bs = 4
    kc = torch.zeros(4, bs * 132 + 16, dtype=torch.uint8)[:, :bs * 132]
    ks = torch.arange(T, dtype=torch.int64)
    compress_norm_rope_store_indexer_cpu(state, gs, pos, ks, rw, eps, csc, kc, bs, ratio)
    qx = rand_fp8(2, 4, 128)
    wx = torch.rand(2, 4)
    lg = fp8_paged_mqa_logits_cpu(qx, kc, wx, torch.tensor([T, 5]),
                                  torch.tensor([[0, 1, 2], [0, 1, 2]]), bs, T)
    kdeq = torch.stack([
        kc[s // bs, (s % bs) * 128:(s % bs + 1) * 128].view(torch.float8_e4m3fn).float()
        * kc[s // bs, bs * 128 + (s % bs) * 4: bs * 128 + (s % bs) * 4 + 4].view(torch.float32)
        for s in range(T)])
    ok = True
    for b, sl in enumerate((T, 5)):
        r = (torch.einsum("jd,hd->jh", kdeq[:sl], qx[b].float()).clamp(min=0) * wx[b]).sum(1)
        ok &= torch.allclose(lg[b, :sl], r, rtol=1e-4, atol=1e-5)
    report("e2e indexer compress -> paged logits", ok)

    # ---------------- out-of-range guards ----------------
    try:
        fp8_paged_mqa_logits_cpu(qx, kc, wx, torch.tensor([T, 5]),
                                 torch.tensor([[0, 1, 9], [0, 1, 2]]), bs, T)
        report("guard: bad page id raises", False)
    except IndexError:
        report("guard: bad page id raises", True)
    try:
        compress_norm_rope_store_indexer_cpu(state, gs, pos, ks + 100, rw, eps, csc, kc, bs,
                                             ratio)
        report("guard: kv slot beyond cache raises", False)
    except IndexError:
        report("guard: kv slot beyond cache raises", True)
    return results


if __name__ == "__main__":
    self_check()
