"""LAB-ONLY pure-PyTorch emulation of DeepSeek-V4 CPU attention ops.

Emulates these ``torch.ops._C`` ops, which only exist in vLLM's AVX512-BF16 CPU build
(schemas as the real ``_C.abi3.so`` registers them):

* ``flash_mla_with_kvcache_cpu``     -- sparse MQA attention over the fp8_ds_mla cache
  (``csrc/cpu/sgl-kernels/flash_mla.cpp``).
* ``fused_qnorm_rope_kv_insert_cpu`` -- Q weight-free RMSNorm + GPT-J RoPE (padded heads
  zeroed) and KV GPT-J RoPE + UE8M0 fp8 quant + paged SWA-cache insert
  (``store_cache.cpp``).
* ``inverse_gptj_rope_o_proj_cpu``   -- inverse GPT-J RoPE of the attention output
  (``store_cache.cpp``).
* ``convert_weight_packed`` / ``bmm_cpu`` -- the brgemm weight pre-pack and batched GEMM
  (``gemm.cpp`` / ``bmm.cpp``).  The emulated "packed" weight is a plain contiguous copy
  (same shape and dtype); the emulated ``bmm_cpu`` reads that plain layout whether
  ``is_vnni`` is True or False, which is exactly what the real pair computes.

fp8_ds_mla "model1" cache layout (one 2-D uint8 row per block; row stride = the tensor's
``stride(0)``, bytes contiguous within a row)::

    token data : block*stride + pos*576        : 448 fp8 e4m3 NoPE bytes, 64 bf16 RoPE dims
    scales     : block*stride + bs*576 + pos*8 : 7 UE8M0 exponents (one per 64 NoPE dims)
                                                 + 1 pad byte (written 0)

with ``slot = block * block_size + pos``.

Never part of the product; registration is done by the caller from ``OPS``.
"""

from __future__ import annotations

import torch

from . import _selfcheck

# ---------------------------------------------------------------------------
# Layout constants (flash_mla.cpp / store_cache.cpp)
# ---------------------------------------------------------------------------

ROPE_DIM = 64  # kRopeDim: fixed in both kernels
QUANT_BLOCK = 64  # kQuantBlock
HEAD_DIM = 512  # flash_mla.cpp kHeadDim (448 NoPE + 64 RoPE)
NOPE_DIM = HEAD_DIM - ROPE_DIM
NUM_QUANT_BLOCKS = NOPE_DIM // QUANT_BLOCK  # 7
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES_PER_TOKEN = NUM_QUANT_BLOCKS + 1  # 8
FP8_MAX = 448.0
QUANT_EPS = 1e-4  # kQuantEps
FP8_MIN_NORMAL = 2.0**-6  # cvt_fp32x16_to_fp8x16 flushes |x| below this to (signed) 0

# Bound on fp32 elements held per chunk (gathered K/V rows, scores): ~64 MiB.
_CHUNK_ELEMS = 1 << 24

_REDUCED_FLOAT = (torch.bfloat16, torch.float16)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _byte_cols(base: torch.Tensor, width: int) -> torch.Tensor:
    """[N] int64 byte offsets -> [N, width] offsets base + arange(width)."""
    return base.unsqueeze(-1) + torch.arange(width, dtype=torch.int64, device=base.device)


def _e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte -> fp32, as flash_mla.cpp's ``fp8_e8m0_to_float``: float bits ``e << 23``
    (so 0 -> 0.0), 0xFF -> NaN."""
    f = (e.to(torch.int32) << 23).view(torch.float32)
    return torch.where(e == 0xFF, torch.full_like(f, float("nan")), f)


def _cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor, rope_dim: int):
    """cos/sin rows as the kernels address them: ``cache + pos * rope_dim``, cos first half,
    sin second half (cache fp32 contiguous, checked by the callers)."""
    half = rope_dim // 2
    flat = cos_sin_cache.reshape(-1)
    base = positions.to(torch.int64) * rope_dim
    cos = flat[_byte_cols(base, half)]
    sin = flat[_byte_cols(base + half, half)]
    return cos, sin


def _gptj_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False):
    """GPT-J (interleaved even/odd pairs) rotation of x[..., rope_dim] in fp32."""
    e = x[..., 0::2]
    o = x[..., 1::2]
    if inverse:
        out_e = e * cos + o * sin
        out_o = o * cos - e * sin
    else:
        out_e = e * cos - o * sin
        out_o = e * sin + o * cos
    return torch.stack((out_e, out_o), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------
# fp8_ds_mla cache read (flash_mla.cpp's load path)
# ---------------------------------------------------------------------------


def _dequant_rows(cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dequantize the cache rows of ``slots`` ([N] int64, all valid) -> [N, 512] fp32.

    NoPE: fp8 * 2^(e-127), rounded to bf16 (the kernel's ``cvt_fp8_32_to_scaled_bf16``);
    RoPE: the stored bf16. Reads through ``cache_2d``'s own strides: the block rows are
    viewed as ``[blocks, block_size, 576]`` token data and ``[blocks, block_size, 8]``
    scales (a block index past the view raises instead of reading elsewhere)."""
    n = slots.shape[0]
    if n == 0:
        return torch.zeros(0, HEAD_DIM, dtype=torch.float32, device=cache_2d.device)
    blk = torch.div(slots, block_size, rounding_mode="floor")
    pos = slots - blk * block_size
    data_end = block_size * TOKEN_DATA_BYTES
    data = cache_2d[:, :data_end].unflatten(1, (block_size, TOKEN_DATA_BYTES))[blk, pos]
    sc = cache_2d[:, data_end:data_end + block_size * SCALE_BYTES_PER_TOKEN].unflatten(
        1, (block_size, SCALE_BYTES_PER_TOKEN))[blk, pos, :NUM_QUANT_BLOCKS]  # [N, 7]
    nope = data[:, :NOPE_DIM].view(torch.float8_e4m3fn).float()
    scale = _e8m0_to_float(sc)
    nope = (nope.view(n, NUM_QUANT_BLOCKS, QUANT_BLOCK) * scale.unsqueeze(-1))
    nope = nope.to(torch.bfloat16).float().view(n, NOPE_DIM)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).float()  # [N, 64]
    return torch.cat((nope, rope), dim=-1)


def _unique_rows(cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int):
    """[Tc, K] int64 slot ids -> ([U, 512] fp32 dequantized rows, [Tc, K] int64 index into
    them, [Tc, K] valid). A slot is valid iff ``0 <= slot < cache_2d.size(0) * block_size``
    (flash_mla.cpp's ``is_valid_sparse_index``); invalid entries index a zero row (and are
    masked by the caller). Tokens share most rows (the window, a request's top-k): each row
    is dequantized once. The rows are ordered by their first use in ``slots`` (row-major),
    never by slot id: the sums over them then run in an order that depends on which entries
    name the same row, not on where the rows live, so the same tokens placed in other blocks
    (another request, a second pool) give the same bits, as the kernel does."""
    total = cache_2d.shape[0] * block_size
    valid = (slots >= 0) & (slots < total)
    flat = torch.where(valid, slots, -1).reshape(-1)
    uniq, inv = torch.unique(flat, return_inverse=True)
    u = uniq.shape[0]
    first = torch.full((u,), flat.shape[0], dtype=torch.int64, device=slots.device)
    first.scatter_reduce_(0, inv, torch.arange(flat.shape[0], device=slots.device), "amin")
    order = torch.argsort(first)  # (first uses are distinct: a strict order)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(u, device=slots.device)
    uniq = uniq[order]
    deq = _dequant_rows(cache_2d, uniq.clamp(min=0), block_size) if total > 0 else \
        torch.zeros(u, HEAD_DIM, dtype=torch.float32, device=slots.device)
    deq[uniq < 0] = 0.0  # the invalid sentinel's row, if any
    return deq, rank[inv].view(slots.shape), valid


# ---------------------------------------------------------------------------
# flash_mla_with_kvcache_cpu (flash_mla.cpp)
# ---------------------------------------------------------------------------

_FLASH_MLA_SCHEMA = (
    "flash_mla_with_kvcache_cpu(Tensor(a!) out, Tensor q, Tensor window_cache_2d, "
    "Tensor window_slots, int window_block_size, Tensor compressed_cache_2d, "
    "Tensor compressed_slots, int compressed_block_size, Tensor attn_sink, float scale) -> ()"
)


def flash_mla_with_kvcache_cpu(
    out: torch.Tensor,
    q: torch.Tensor,
    window_cache_2d: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache_2d: torch.Tensor,
    compressed_slots: torch.Tensor,
    compressed_block_size: int,
    attn_sink: torch.Tensor,
    scale: float,
) -> None:
    """Per token t and head h, over the K rows named by window_slots[t] then
    compressed_slots[t] (each a 512-dim dequantized cache row; it is both key and value):

        s_k = scale * <q[t,h], K_k>          (invalid slots: masked)
        out[t,h] = sum_k p_k V_k / (sum_k p_k + exp(sink[h] - m)),  p_k = exp(s_k - m)

    i.e. a softmax with a per-head sink logit of zero value. No valid slot -> zeros.
    ``out`` ([T, H, 512] bf16, contiguous) is written in place."""
    _check(q.dim() == 3 and q.size(2) == HEAD_DIM,
           "flash_mla_with_kvcache_cpu: q must be [num_tokens, num_heads, 512]")
    _check(out.dim() == 3 and out.size(0) == q.size(0) and out.size(1) == q.size(1)
           and out.size(2) == HEAD_DIM,
           "flash_mla_with_kvcache_cpu: out must be [num_tokens, num_heads, 512]")
    _check(out.dtype == torch.bfloat16 and out.is_contiguous(),
           "flash_mla_with_kvcache_cpu: out must be bf16 and contiguous")
    _check(q.dtype == torch.bfloat16, "flash_mla_with_kvcache_cpu: q must be bf16")
    _check(window_slots.dim() == 2 and window_slots.size(0) == q.size(0),
           "flash_mla_with_kvcache_cpu: window_slots must be [num_tokens, num_window]")
    _check(compressed_slots.dim() == 2 and compressed_slots.size(0) == q.size(0),
           "flash_mla_with_kvcache_cpu: compressed_slots must be [num_tokens, num_compressed]")
    _check(window_slots.dtype == torch.int64 and compressed_slots.dtype == torch.int64,
           "flash_mla_with_kvcache_cpu: slot tensors must be int64")
    _check(attn_sink.numel() == q.size(1),
           "flash_mla_with_kvcache_cpu: attn_sink must have num_heads entries")
    _check(attn_sink.dtype == torch.float32 and attn_sink.is_contiguous(),
           "flash_mla_with_kvcache_cpu: attn_sink must be float32 and contiguous")
    _check(window_slots.is_contiguous() and compressed_slots.is_contiguous(),
           "flash_mla_with_kvcache_cpu: window_slots/compressed_slots must be contiguous")
    _check(window_slots.size(1) > 0,
           "flash_mla_with_kvcache_cpu: window_slots must have at least one column")
    _check(q.stride(2) == 1, "flash_mla_with_kvcache_cpu: q's last dim must be contiguous")
    num_compressed = compressed_slots.size(1)
    _check(window_cache_2d.dim() == 2 and window_cache_2d.dtype == torch.uint8,
           "flash_mla_with_kvcache_cpu: window_cache_2d must be a 2D uint8 tensor")
    if num_compressed > 0:
        _check(compressed_cache_2d.dim() == 2 and compressed_cache_2d.dtype == torch.uint8,
               "flash_mla_with_kvcache_cpu: compressed_cache_2d must be a 2D uint8 tensor")

    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return
    num_window = window_slots.size(1)
    k_total = num_window + num_compressed
    sink = attn_sink.reshape(-1).to(torch.float32).view(1, num_heads)
    # Chunks of tokens bounded by their [Tc, H, K] scores.
    chunk = max(1, min(num_tokens, _CHUNK_ELEMS // (4 * k_total * num_heads)))

    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        tc = t1 - t0
        table, idx, valid = _unique_rows(window_cache_2d, window_slots[t0:t1],
                                         int(window_block_size))
        if num_compressed > 0:
            table_c, idx_c, valid_c = _unique_rows(
                compressed_cache_2d, compressed_slots[t0:t1], int(compressed_block_size))
            idx = torch.cat((idx, idx_c + table.shape[0]), dim=1)
            table = torch.cat((table, table_c))
            valid = torch.cat((valid, valid_c), dim=1)
        qf = q[t0:t1].float()  # [Tc, H, 512]
        u = table.shape[0]
        # Shared rows (a prefill chunk): scores against each distinct row once, then picked
        # per token; distinct rows per token (decode): the token's own rows gathered.
        shared = u * num_heads < k_total * (num_heads + 8)
        if shared:
            su = (qf.reshape(tc * num_heads, HEAD_DIM) @ table.T).view(tc, num_heads, u)
            scores = su.gather(2, idx.unsqueeze(1).expand(tc, num_heads, k_total))
            kv = None
        else:
            kv = table.index_select(0, idx.reshape(-1)).view(tc, k_total, HEAD_DIM)
            scores = torch.bmm(qf, kv.transpose(1, 2))  # [Tc, H, K]
        scores = scores * float(scale)
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m = scores.amax(dim=-1)  # [Tc, H]; -inf where no valid slot
        lonely = ~torch.isfinite(m)
        m_safe = torch.where(lonely, torch.zeros_like(m), m)
        p = torch.exp(scores - m_safe.unsqueeze(-1))
        s = p.sum(dim=-1)
        # PV on bf16-rounded probabilities (the kernel's s_delta2), fp32 accumulate.
        pb = p.to(torch.bfloat16).float()
        if shared:
            pu = torch.zeros(tc, num_heads, u, dtype=torch.float32, device=q.device)
            pu.scatter_add_(2, idx.unsqueeze(1).expand(tc, num_heads, k_total), pb)
            acc = (pu.view(tc * num_heads, u) @ table).view(tc, num_heads, HEAD_DIM)
        else:
            acc = torch.bmm(pb, kv)  # [Tc, H, 512]
        lonely = lonely | (s == 0)
        s_safe = torch.where(lonely, torch.ones_like(s), s)
        lse = m_safe + torch.log(s_safe)
        inv_s = (1.0 / s_safe) * (1.0 / (1.0 + torch.exp(sink - lse)))
        res = acc * inv_s.unsqueeze(-1)
        res = torch.where(lonely.unsqueeze(-1), torch.zeros_like(res), res)
        out[t0:t1].copy_(res.to(torch.bfloat16))


# ---------------------------------------------------------------------------
# fused_qnorm_rope_kv_insert_cpu (store_cache.cpp)
# ---------------------------------------------------------------------------

_QNORM_SCHEMA = (
    "fused_qnorm_rope_kv_insert_cpu(Tensor q, Tensor kv, Tensor positions, "
    "Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping, Tensor cos_sin_cache, "
    "int q_head_padded, float eps, int cache_block_size) -> Tensor"
)


def _quant_nope_ue8m0(nope: torch.Tensor):
    """[N, nope_dim] fp32 (bf16-exact) -> ([N, nope_dim] fp8 bytes, [N, nb] scale bytes), as
    ``quantize_tile_avx512``: per 64-tile scale = max(amax/448, 1e-4), exponent =
    ceil(log2(scale)) in fp32, x * 2^-exponent clamped to +-448, RNE to e4m3 with magnitudes
    below 2^-6 flushed to (signed) zero."""
    n, d = nope.shape
    tiles = nope.view(n, d // QUANT_BLOCK, QUANT_BLOCK)
    amax = tiles.abs().amax(dim=-1)
    sc = torch.clamp(amax / FP8_MAX, min=QUANT_EPS)
    expo = torch.ceil(torch.log2(sc))
    inv = 1.0 / torch.exp2(expo)
    x = (tiles * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    x = torch.where(x.abs() < FP8_MIN_NORMAL, x * 0.0, x)  # x * 0 keeps the sign bit
    fp8 = x.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, d)
    scale_bytes = (expo.to(torch.int32) + 127).to(torch.uint8)
    return fp8, scale_bytes


def fused_qnorm_rope_kv_insert_cpu(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    swa_kv_cache_2d: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_head_padded: int,
    eps: float,
    cache_block_size: int,
) -> torch.Tensor:
    """Returns q_out [T, q_head_padded, D] (q's dtype): per-head weight-free RMSNorm of q
    over all D dims, GPT-J RoPE on its last 64 dims at positions[t]; padded heads zero.
    For t < len(slot_mapping) with slot >= 0: kv[t] RoPE'd, rounded to bf16, NoPE UE8M0-fp8
    quantized, written into swa_kv_cache_2d (mutated) at slot; slot < 0 skipped."""
    _check(q.dim() == 3 and q.dtype in _REDUCED_FLOAT,
           "fused_qnorm_rope_kv_insert_cpu: q must be bf16/fp16 [num_tokens, num_heads_q, "
           "head_dim]")
    _check(kv.dim() == 2 and kv.dtype == q.dtype,
           "fused_qnorm_rope_kv_insert_cpu: kv dtype must match q")
    _check(positions.dtype == torch.int64,
           "fused_qnorm_rope_kv_insert_cpu: positions must be int64")
    _check(slot_mapping.dtype == torch.int64,
           "fused_qnorm_rope_kv_insert_cpu: slot_mapping must be int64")
    _check(swa_kv_cache_2d.dim() == 2 and swa_kv_cache_2d.dtype == torch.uint8,
           "fused_qnorm_rope_kv_insert_cpu: swa_kv_cache_2d must be a 2D uint8 tensor")
    num_tokens_full, num_heads_q, head_dim = q.shape
    nope_dim = head_dim - ROPE_DIM
    _check(nope_dim > 0 and nope_dim % QUANT_BLOCK == 0,
           "fused_qnorm_rope_kv_insert_cpu: unexpected head_dim")
    _check(q_head_padded >= num_heads_q,
           "fused_qnorm_rope_kv_insert_cpu: q_head_padded must be >= num_heads_q")
    _check(kv.size(1) == head_dim, "fused_qnorm_rope_kv_insert_cpu: kv head_dim must match q")
    _check(positions.numel() == num_tokens_full,
           "fused_qnorm_rope_kv_insert_cpu: positions must have num_tokens_full entries")
    num_tokens_insert = slot_mapping.size(0)
    _check(kv.size(0) >= num_tokens_insert,
           "fused_qnorm_rope_kv_insert_cpu: kv must have >= num_tokens_insert rows")
    _check(cache_block_size > 0,
           "fused_qnorm_rope_kv_insert_cpu: cache_block_size must be positive")
    _check(cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous(),
           "fused_qnorm_rope_kv_insert_cpu: cos_sin_cache must be float32 and contiguous")
    _check(q.is_contiguous() and kv.is_contiguous() and positions.is_contiguous()
           and slot_mapping.is_contiguous(),
           "fused_qnorm_rope_kv_insert_cpu: q/kv/positions/slot_mapping must be contiguous")

    token_data_bytes = nope_dim + 2 * ROPE_DIM
    scale_bytes_per_token = nope_dim // QUANT_BLOCK + 1
    pos_flat = positions.reshape(-1)

    q_out = torch.zeros(num_tokens_full, q_head_padded, head_dim, dtype=q.dtype,
                        device=q.device)
    # Q side, in token chunks.
    chunk = max(1, _CHUNK_ELEMS // max(1, num_heads_q * head_dim))
    for t0 in range(0, num_tokens_full, chunk):
        t1 = min(num_tokens_full, t0 + chunk)
        x = q[t0:t1].float()
        inv_rms = 1.0 / torch.sqrt(x.square().sum(dim=-1, keepdim=True) / head_dim + eps)
        x = x * inv_rms
        cos, sin = _cos_sin(cos_sin_cache, pos_flat[t0:t1], ROPE_DIM)
        x[..., nope_dim:] = _gptj_rope(x[..., nope_dim:], cos.unsqueeze(1), sin.unsqueeze(1))
        q_out[t0:t1, :num_heads_q] = x.to(q.dtype)

    # KV side: only rows with a valid (>= 0) slot.
    slots = slot_mapping.reshape(-1)
    idx = (slots >= 0).nonzero(as_tuple=True)[0]
    if idx.numel() > 0:
        slot = slots[idx]
        x = kv[idx].float()
        cos, sin = _cos_sin(cos_sin_cache, pos_flat[idx], ROPE_DIM)
        x[:, nope_dim:] = _gptj_rope(x[:, nope_dim:], cos, sin)
        x_bf16 = x.to(torch.bfloat16)  # bf16 round-trip (matches the CUDA kernel)
        fp8, scale_bytes = _quant_nope_ue8m0(x_bf16[:, :nope_dim].float())
        rope_bytes = x_bf16[:, nope_dim:].contiguous().view(torch.uint8)
        n = idx.numel()
        data = torch.cat((fp8, rope_bytes), dim=1)  # [n, token_data_bytes]
        scales = torch.cat((scale_bytes, scale_bytes.new_zeros(n, 1)), dim=1)  # pad byte 0

        blk = torch.div(slot, cache_block_size, rounding_mode="floor")
        pos = slot - blk * cache_block_size
        _check(bool((blk < swa_kv_cache_2d.size(0)).all()),
               "fused_qnorm_rope_kv_insert_cpu: slot_mapping holds a slot past the cache")
        rows = blk.unsqueeze(-1)
        # Index the given view (its own strides): an offset past a row raises.
        swa_kv_cache_2d[rows, _byte_cols(pos * token_data_bytes, token_data_bytes)] = data
        swa_kv_cache_2d[rows, _byte_cols(cache_block_size * token_data_bytes
                                         + pos * scale_bytes_per_token,
                                         scale_bytes_per_token)] = scales
    return q_out


# ---------------------------------------------------------------------------
# inverse_gptj_rope_o_proj_cpu (store_cache.cpp)
# ---------------------------------------------------------------------------

_INV_ROPE_SCHEMA = (
    "inverse_gptj_rope_o_proj_cpu(Tensor o, Tensor positions, Tensor cos_sin_cache, "
    "int rope_dim) -> Tensor"
)


def inverse_gptj_rope_o_proj_cpu(
    o: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rope_dim: int,
) -> torch.Tensor:
    """fp32 copy of o ([T, H, D] bf16/fp16) with its last rope_dim dims de-rotated by
    R(-pos[t]) (GPT-J pairs): even' = e*cos + o*sin, odd' = o*cos - e*sin."""
    _check(o.dim() == 3,
           "inverse_gptj_rope_o_proj_cpu: o must be 3D [num_tokens, num_heads, head_dim]")
    _check(o.dtype in _REDUCED_FLOAT, "inverse_gptj_rope_o_proj_cpu: o must be bf16/fp16")
    _check(positions.dtype == torch.int64,
           "inverse_gptj_rope_o_proj_cpu: positions must be int64")
    num_tokens, num_heads, head_dim = o.shape
    rope_dim = int(rope_dim)
    nope_dim = head_dim - rope_dim
    half = rope_dim // 2
    _check(nope_dim >= 0, "inverse_gptj_rope_o_proj_cpu: rope_dim must not exceed head_dim")
    _check(nope_dim % 16 == 0 and half % 16 == 0,
           "inverse_gptj_rope_o_proj_cpu: head_dim-rope_dim and rope_dim/2 must be multiples "
           "of 16")
    _check(cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous(),
           "inverse_gptj_rope_o_proj_cpu: cos_sin_cache must be float32 and contiguous")
    _check(o.is_contiguous() and positions.is_contiguous(),
           "inverse_gptj_rope_o_proj_cpu: o/positions must be contiguous")
    out = o.float()  # a new tensor (o is reduced-precision)
    if num_tokens == 0 or rope_dim == 0:
        return out
    cos, sin = _cos_sin(cos_sin_cache, positions.reshape(-1), rope_dim)
    out[..., nope_dim:] = _gptj_rope(out[..., nope_dim:], cos.unsqueeze(1), sin.unsqueeze(1),
                                     inverse=True)
    return out


# ---------------------------------------------------------------------------
# convert_weight_packed / bmm_cpu (gemm.cpp / bmm.cpp)
# ---------------------------------------------------------------------------

_CONVERT_SCHEMA = "convert_weight_packed(Tensor! weight) -> Tensor"
_BMM_SCHEMA = (
    "bmm_cpu(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()"
)


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """Emulated pre-pack: a contiguous copy, same shape and dtype (the real one VNNI-packs
    for the AMX brgemm; no emulated consumer reads a VNNI layout). ``weight`` is left as is."""
    return weight.clone(memory_format=torch.contiguous_format)


def bmm_cpu(
    out: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    is_vnni: bool,
    scale: torch.Tensor | None,
) -> None:
    """out[b] = mat1[b] @ mat2[b]^T (mat1 [B, M, K], mat2 [B, N, K], out [B, M, N], written
    in place through its strides). With ``scale`` (0-dim): mat2 is fp8 e4m3 with a per-tensor
    scale, out = mat1 @ (mat2 * scale)^T, bf16. fp32 accumulation. ``is_vnni`` only says
    whether mat2 came from convert_weight_packed: the emulated pack is the identity layout, so
    both cases compute the same."""
    del is_vnni
    _check(mat1.stride(-1) == 1, "bmm_cpu: mat1's last dim must be contiguous")
    _check(out.stride(-1) == 1, "bmm_cpu: out's last dim must be contiguous")
    _check(mat2.is_contiguous(), "bmm_cpu: mat2 must be contiguous")
    _check(out.dim() == 3 and mat1.dim() == 3 and mat2.dim() == 3,
           "bmm_cpu: out, mat1, mat2 must be 3-D")
    b, m, k = mat1.shape
    n = mat2.size(1)
    _check(n % 32 == 0, "tinygemm requires N to be 32x.")
    _check(mat2.size(0) == b and mat2.size(2) == k, "bmm: mat2 shape mismatch!")
    _check(out.size(0) == b and out.size(1) == m, "bmm: out shape mismatch!")
    _check(out.size(2) == n, "bmm: out shape mismatch!")
    if scale is None:
        _check(mat1.dtype in _REDUCED_FLOAT, "bmm_cpu: mat1 must be bf16/fp16")
        _check(mat2.dtype == mat1.dtype and out.dtype == mat1.dtype,
               "bmm_cpu: mat2/out dtype must match mat1")
        w = mat2.float()
    else:
        _check(scale.dim() == 0, "bmm: expect scale to be 0-dim tensor.")
        _check(mat1.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
               and mat2.dtype == torch.float8_e4m3fn,
               "bmm_cpu: the fp8 path takes bf16 mat1/out and fp8 e4m3 mat2")
        w = mat2.float() * float(scale.item())
    if b == 0 or m == 0 or n == 0:
        return
    chunk = max(1, _CHUNK_ELEMS // max(1, m * (n + k)))
    for b0 in range(0, b, chunk):
        b1 = min(b, b0 + chunk)
        res = torch.bmm(mat1[b0:b1].float(), w[b0:b1].transpose(1, 2))
        out[b0:b1].copy_(res.to(out.dtype))


OPS = {
    "flash_mla_with_kvcache_cpu": (_FLASH_MLA_SCHEMA, flash_mla_with_kvcache_cpu),
    "fused_qnorm_rope_kv_insert_cpu": (_QNORM_SCHEMA, fused_qnorm_rope_kv_insert_cpu),
    "inverse_gptj_rope_o_proj_cpu": (_INV_ROPE_SCHEMA, inverse_gptj_rope_o_proj_cpu),
    "convert_weight_packed": (_CONVERT_SCHEMA, convert_weight_packed),
    "bmm_cpu": (_BMM_SCHEMA, bmm_cpu),
}


# ---------------------------------------------------------------------------
# Self-check (lab only): cd benchmarks && python -m lab.v4_ops.attention
# ---------------------------------------------------------------------------


def self_check() -> None:
    """Compares every op of ``OPS`` with an independent eager reference (lab only).

    Pure: runs under ``torch.random.fork_rng`` with its own seed (the caller's RNG state is
    restored), registers nothing, leaves torch's thread settings alone, and restores the one
    module global it varies (``_CHUNK_ELEMS``). Raises AssertionError naming every failed
    check; on success prints one summary line."""
    _selfcheck.run("attention", _run_checks)


def _run_checks() -> list[tuple[str, bool, str]]:
    """The checks of ``self_check``: [(name, ok, detail)]."""
    global _CHUNK_ELEMS
    results: list[tuple[str, bool, str]] = []

    def report(name: str, ok: bool, detail: str = "") -> None:
        results.append((name, bool(ok), detail))

    # -- schemas parse and are named as the ops --------------------------------------------
    for op_name, (schema, fn) in OPS.items():
        parsed = torch._C.parse_schema(schema)
        report(f"schema {op_name}", parsed.name == op_name and callable(fn), str(parsed))

    def make_cos_sin_cache(max_pos: int, rope_dim: int) -> torch.Tensor:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float64)
                                      / rope_dim))
        f = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
        return torch.cat((f.cos(), f.sin()), dim=-1).float().contiguous()

    def ref_rope(x, cos, sin):  # vLLM test's _apply_gptj_rope
        xe, xo = x[..., 0::2], x[..., 1::2]
        return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1).flatten(-2)

    def padded_cache(num_blocks: int, block_size: int, pad: int) -> torch.Tensor:
        """[num_blocks, block_size*584] uint8 view of a wider buffer (row stride != width),
        random garbage everywhere."""
        width = block_size * (TOKEN_DATA_BYTES + SCALE_BYTES_PER_TOKEN)
        buf = torch.randint(0, 256, (num_blocks, width + pad), dtype=torch.uint8)
        return buf[:, :width]

    # -- reference fp8 quantizer: the kernel's bit manipulation, ported to int ops ---------
    def ref_fp32_to_fp8_bits(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        signs = (bits & 0x80000000) >> 24
        absb = bits & 0x7FFFFFFF
        f32_exp = absb >> 23
        mant = absb & 0x7FFFFF
        e = f32_exp - 120
        m3 = mant >> 20
        rnd = (mant >> 19) & 1
        sticky = ((mant & 0x7FFFF) != 0).to(torch.int64)
        m3 = m3 + (rnd & (sticky | (m3 & 1)))
        ovf = m3 == 8
        m3 = torch.where(ovf, 0, m3)
        e = torch.where(ovf, e + 1, e).clamp(max=15)
        r = (e << 3) | m3
        r = torch.where(f32_exp < 121, 0, r)
        return ((r | signs) & 0xFF).to(torch.uint8)

    def ref_quant_token(vals: torch.Tensor):
        """One token's NoPE (fp32, 448) -> (fp8 bytes, 7 scale bytes): scalar port of
        quantize_tile_avx512, one tile at a time."""
        fp8, sc = [], []
        for qb in range(vals.numel() // QUANT_BLOCK):
            tile = vals[qb * QUANT_BLOCK:(qb + 1) * QUANT_BLOCK]
            amax = float(tile.abs().max())
            scale = max(float(torch.tensor(amax, dtype=torch.float32) / FP8_MAX), QUANT_EPS)
            ceil_log2 = float(torch.ceil(torch.log2(torch.tensor(scale, dtype=torch.float32))))
            inv = torch.tensor(1.0 / 2.0 ** ceil_log2, dtype=torch.float32)
            s = (tile * inv).clamp(-FP8_MAX, FP8_MAX)
            fp8.append(ref_fp32_to_fp8_bits(s))
            sc.append(int(ceil_log2) + 127)
        return torch.cat(fp8), torch.tensor(sc, dtype=torch.uint8)

    def ref_qnorm_insert(q, kv, positions, cache, slot_mapping, cs, padded, eps, bs):
        """Per-(token, head) / per-token loop port of qnorm_rope_kv_insert_impl."""
        T, H, D = q.shape
        nope = D - ROPE_DIM
        q_out = torch.zeros(T, padded, D, dtype=q.dtype)
        for t in range(T):
            p = int(positions[t])
            cos, sin = cs[p, :ROPE_DIM // 2], cs[p, ROPE_DIM // 2:]
            for h in range(H):
                buf = q[t, h].float()
                inv_rms = 1.0 / torch.sqrt(buf.square().sum() / D + eps)
                buf = buf * inv_rms
                buf[nope:] = ref_rope(buf[nope:], cos, sin)
                q_out[t, h] = buf.to(q.dtype)
        for t in range(slot_mapping.numel()):
            slot = int(slot_mapping[t])
            if slot < 0:
                continue
            p = int(positions[t])
            cos, sin = cs[p, :ROPE_DIM // 2], cs[p, ROPE_DIM // 2:]
            buf = kv[t].float()
            buf[nope:] = ref_rope(buf[nope:], cos, sin)
            buf16 = buf.to(torch.bfloat16)
            fp8, sc = ref_quant_token(buf16[:nope].float())
            b, pos = slot // bs, slot % bs
            tdb = nope + 2 * ROPE_DIM
            row = cache[b]
            row[pos * tdb:pos * tdb + nope] = fp8
            row[pos * tdb + nope:(pos + 1) * tdb] = buf16[nope:].contiguous().view(torch.uint8)
            so = bs * tdb + pos * (nope // QUANT_BLOCK + 1)
            row[so:so + nope // QUANT_BLOCK] = sc
            row[so + nope // QUANT_BLOCK] = 0
        return q_out

    cs = make_cos_sin_cache(4096, ROPE_DIM)

    # -- fused_qnorm_rope_kv_insert_cpu -----------------------------------------------------
    for T, H, padded, n_ins, bs, pad in [(1, 1, 8, 1, 16, 0), (9, 8, 16, 9, 64, 40),
                                         (12, 8, 8, 10, 16, 8), (5, 4, 4, 5, 1, 0)]:
        qq = torch.randn(T, H, HEAD_DIM, dtype=torch.bfloat16) * 3
        kvv = torch.randn(T, HEAD_DIM, dtype=torch.bfloat16) * 2
        kvv[0, :QUANT_BLOCK] = 0  # an all-zero tile (scale clamp path)
        if T > 1:
            kvv[1, QUANT_BLOCK:2 * QUANT_BLOCK] *= 1e-3  # tiny tile: fp8 flush-to-zero
        positions = torch.randint(0, 4096, (T,), dtype=torch.int64)
        nb = (n_ins + bs - 1) // bs + 2
        slot_mapping = torch.randperm(nb * bs)[:n_ins].to(torch.int64)
        if n_ins > 2:
            slot_mapping[1] = -1
        c_emu = padded_cache(nb, bs, pad)
        c_ref = c_emu.clone()
        base_emu = c_emu._base.clone() if c_emu._base is not None else None
        q_emu = fused_qnorm_rope_kv_insert_cpu(qq, kvv, positions, c_emu, slot_mapping, cs,
                                               padded, 1e-6, bs)
        q_ref = ref_qnorm_insert(qq, kvv, positions, c_ref, slot_mapping, cs, padded, 1e-6, bs)
        tag = f"qnorm_insert T={T} H={H} pad_heads={padded} n_ins={n_ins} bs={bs} rowpad={pad}"
        report(f"{tag}: q_out shape/dtype",
               q_emu.shape == (T, padded, HEAD_DIM) and q_emu.dtype == torch.bfloat16)
        qd = (q_emu.float() - q_ref.float()).abs().max().item()
        report(f"{tag}: q_out vs loop reference", qd <= 1e-2, f"max abs diff {qd:.2e}")
        report(f"{tag}: padded heads zero", q_emu[:, H:].abs().max().item() == 0.0
               if padded > H else True)
        nbad = int((c_emu != c_ref).sum())
        report(f"{tag}: cache bytes == loop reference", nbad == 0, f"{nbad} bytes differ")
        if pad:
            # the bytes past each view row (the padding) are untouched
            full_emu = c_emu._base
            ok = torch.equal(full_emu[:, c_emu.shape[1]:], base_emu[:, c_emu.shape[1]:])
            report(f"{tag}: row padding untouched", ok)

    # out-of-range slot must raise, not write elsewhere
    try:
        c = padded_cache(2, 16, 0)
        fused_qnorm_rope_kv_insert_cpu(
            torch.randn(1, 1, HEAD_DIM, dtype=torch.bfloat16),
            torch.randn(1, HEAD_DIM, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64),
            c, torch.tensor([32], dtype=torch.int64), cs, 1, 1e-6, 16)
        report("qnorm_insert: out-of-range slot raises", False)
    except (RuntimeError, IndexError) as exc:
        report("qnorm_insert: out-of-range slot raises", True, type(exc).__name__)

    # -- flash_mla_with_kvcache_cpu ---------------------------------------------------------
    def pack_rows(cache: torch.Tensor, slots: torch.Tensor, kv_f32: torch.Tensor, bs: int):
        """vLLM test's _pack_flash_mla_cache, written at arbitrary slots of a (strided) cache;
        returns the exact dequantized value the kernel should reproduce."""
        n = kv_f32.shape[0]
        nope = kv_f32[:, :NOPE_DIM].reshape(n, NUM_QUANT_BLOCKS, QUANT_BLOCK)
        absmax = nope.abs().amax(dim=-1).clamp(min=1e-4)
        exponent = torch.ceil(torch.log2(absmax / FP8_MAX))
        scaled = (nope * torch.exp2(-exponent).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
        nope_fp8 = scaled.to(torch.float8_e4m3fn)
        deq = (nope_fp8.float() * torch.exp2(exponent).unsqueeze(-1)).reshape(n, NOPE_DIM)
        rope_bf16 = kv_f32[:, NOPE_DIM:].to(torch.bfloat16)
        for i in range(n):  # per-row python writes: independent of the impl's indexing
            s = int(slots[i])
            b, p = s // bs, s % bs
            row = cache[b]
            row[p * 576:p * 576 + 448] = nope_fp8[i].reshape(-1).view(torch.uint8)
            row[p * 576 + 448:(p + 1) * 576] = rope_bf16[i].view(torch.uint8)
            so = bs * 576 + p * 8
            row[so:so + 7] = (exponent[i] + 127).to(torch.uint8)
            row[so + 7] = 0
        return torch.cat((deq, rope_bf16.float()), dim=-1)

    def eager_attn(q, rows_w, valid_w, rows_c, valid_c, sink, scale):
        """vLLM test's _flash_mla_eager on pre-gathered rows: softmax over the valid rows plus
        a per-head sink logit of zero value."""
        T, H, _ = q.shape
        kv = torch.cat((rows_w, rows_c), 1)
        valid = torch.cat((valid_w, valid_c), 1)
        scores = torch.einsum("thd,tkd->thk", q.float(), kv) * scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        sk = sink.view(1, H, 1).expand(T, H, 1)
        probs = torch.softmax(torch.cat((scores, sk), -1), -1)
        return torch.einsum("thk,tkd->thd", probs[..., :-1], kv)

    def map_slots(local, req_idx, block_table, bs):  # cpu_utils.map_local_to_global_slots_cpu
        valid = local >= 0
        safe = local.clamp(min=0)
        blk = block_table[req_idx.unsqueeze(-1).expand_as(local), safe // bs]
        return torch.where(valid, blk * bs + safe % bs, torch.full_like(safe, -1))

    def run_attn_case(tag, T, H, window, win_bs, topk, comp_bs, comp_kind, row_pad=24,
                      all_invalid_token=False, oob=False):
        num_reqs = 2
        req_idx = torch.randint(0, num_reqs, (T,))
        positions = torch.randint(0, 3 * win_bs, (T,))
        # window: causal window over each request's paged SWA cache (as forward_mqa builds it)
        w_blocks_per_req = (3 * win_bs) // win_bs + 1
        n_wblocks = num_reqs * w_blocks_per_req + 2
        wbt = torch.randperm(n_wblocks)[:num_reqs * w_blocks_per_req].view(num_reqs, -1)
        start = (positions - window + 1).clamp(min=0)
        local = start.unsqueeze(-1) + torch.arange(window)
        local = torch.where(local <= positions.unsqueeze(-1), local, torch.full_like(local, -1))
        wslots = map_slots(local, req_idx, wbt, win_bs)
        wcache = padded_cache(n_wblocks, win_bs, row_pad)
        wvals = torch.randn(n_wblocks * win_bs, HEAD_DIM) * 2
        all_w = torch.arange(n_wblocks * win_bs)
        wdeq = pack_rows(wcache, all_w, wvals, win_bs)
        if comp_kind == "none":
            cslots = wslots.new_full((T, 0), -1)
            ccache, cdeq, cbs = wcache, wdeq[:0], 1
        else:
            if comp_kind == "pool":  # the plugin's pool: [rows, 1, 584] viewed [rows, 584]
                n_rows = T * topk + 5
                pool = torch.randint(0, 256, (n_rows, 1, 584), dtype=torch.uint8)
                ccache, cbs = pool.view(n_rows, -1), 1
                cslots = torch.randint(0, n_rows, (T, topk))
            else:  # paged compressed cache through a block table
                c_blocks_per_req = 4
                n_cblocks = num_reqs * c_blocks_per_req + 1
                cbt = torch.randperm(n_cblocks)[:num_reqs * c_blocks_per_req].view(num_reqs, -1)
                ccache, cbs = padded_cache(n_cblocks, comp_bs, row_pad), comp_bs
                clocal = torch.randint(0, c_blocks_per_req * comp_bs, (T, topk))
                cslots = map_slots(clocal, req_idx, cbt, comp_bs)
            cslots[:, -1] = -1
            cvals = torch.randn(ccache.shape[0] * cbs, HEAD_DIM) * 2
            cdeq = pack_rows(ccache, torch.arange(ccache.shape[0] * cbs), cvals, cbs)
        if all_invalid_token:
            wslots[0] = -1
            cslots[0] = -1
        if oob:  # slots past the cache: ignored by the kernel (like -1)
            wslots[-1, 0] = wcache.shape[0] * win_bs + 3
            if cslots.shape[1] > 1:
                cslots[-1, 0] = ccache.shape[0] * cbs
        q = (torch.randn(T, H, HEAD_DIM) * 0.5).to(torch.bfloat16)
        sink = torch.randn(H)
        scale = HEAD_DIM ** -0.5
        out = torch.full((T, H, HEAD_DIM), 7.0, dtype=torch.bfloat16)
        wcache_before = wcache.clone()
        flash_mla_with_kvcache_cpu(out, q, wcache, wslots.contiguous(), win_bs, ccache,
                                   cslots.contiguous(), cbs, sink, scale)

        def rows_of(deq, slots, total):
            valid = (slots >= 0) & (slots < total)
            return deq[torch.where(valid, slots, 0).clamp(max=max(total - 1, 0))] * \
                valid.unsqueeze(-1) if total else deq.new_zeros(*slots.shape, HEAD_DIM), valid

        rw, vw = rows_of(wdeq, wslots, wcache.shape[0] * win_bs)
        if cslots.shape[1]:
            rc, vc = rows_of(cdeq, cslots, ccache.shape[0] * cbs)
        else:
            rc, vc = rw[:, :0], vw[:, :0]
        ref = eager_attn(q, rw, vw, rc, vc, sink, scale)
        d = (out.float() - ref).abs().max().item()
        rel = d / max(ref.abs().max().item(), 1e-6)
        report(f"flash_mla {tag}: vs eager (vLLM test tol 2e-2)", d <= 2e-2,
               f"max abs diff {d:.2e} (rel {rel:.1e})")
        report(f"flash_mla {tag}: caches untouched", torch.equal(wcache, wcache_before))
        if all_invalid_token:
            report(f"flash_mla {tag}: all-invalid token -> zeros",
                   out[0].abs().max().item() == 0.0)

    run_attn_case("SWA-only T=3 H=4", 3, 4, 8, 16, 0, 1, "none")
    run_attn_case("paged C4A T=5 H=8", 5, 8, 8, 16, 12, 16, "paged", all_invalid_token=True,
                  oob=True)
    run_attn_case("plugin pool bs=1 T=4 H=8", 4, 8, 16, 64, 10, 1, "pool", oob=True)
    run_attn_case("vLLM-test sizes T=17 H=64", 17, 64, 6, 16, 5, 8, "paged")

    # chunking path: force tiny chunks, same result
    saved = _CHUNK_ELEMS
    try:
        T, H = 6, 4
        wcache = padded_cache(4, 16, 0)
        pack_rows(wcache, torch.arange(64), torch.randn(64, HEAD_DIM), 16)
        wslots = torch.randint(-1, 64, (T, 9))
        q = torch.randn(T, H, HEAD_DIM).to(torch.bfloat16)
        sink = torch.randn(H)
        cs0 = wslots.new_full((T, 0), -1)
        o1 = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16)
        flash_mla_with_kvcache_cpu(o1, q, wcache, wslots, 16, wcache, cs0, 1, sink, 0.05)
        _CHUNK_ELEMS = 1  # module global read by the impl (restored below)
        o2 = torch.empty_like(o1)
        flash_mla_with_kvcache_cpu(o2, q, wcache, wslots, 16, wcache, cs0, 1, sink, 0.05)
        report("flash_mla: token chunking invariant", torch.equal(o1, o2))
    finally:
        _CHUNK_ELEMS = saved

    # placement: the same rows at other slots (blocks and positions permuted, as another
    # request's or another pool's) give the same bits, along both paths (rows shared by a
    # chunk's tokens, and each token's own rows)
    # (sizes: enough outputs that a changed fp32 summation order shows in their bf16 bits)
    for tag, T, shared in (("shared rows", 192, True), ("own rows", 12, False)):
        bs, nblk, H, win = 16, 48, 16, 64
        n = nblk * bs
        vals = torch.randn(n, HEAD_DIM)
        c1 = padded_cache(nblk, bs, 8)
        pack_rows(c1, torch.arange(n), vals, bs)
        perm = torch.randperm(n)  # row r of c1 sits at slot perm[r] of c2
        c2 = padded_cache(nblk, bs, 8)
        pack_rows(c2, perm, vals, bs)
        if shared:  # a causal window over consecutive tokens, then 256 common rows
            loc = torch.arange(T).unsqueeze(-1) - torch.arange(win)
            sl = torch.cat((torch.where(loc >= 0, loc, -1), torch.randperm(n - T)[:256]
                            .add(T).expand(T, 256)), dim=1)
        else:
            sl = torch.stack([torch.randperm(n)[:win + 60] for _ in range(T)])
            sl[0, 3] = -1
        sl2 = torch.where(sl >= 0, perm[sl.clamp(min=0)], -1)
        q = (torch.randn(T, H, HEAD_DIM) * 0.5).to(torch.bfloat16)
        sink = torch.randn(H)
        outs = []
        for cache, slots in ((c1, sl), (c2, sl2)):
            o = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16)
            flash_mla_with_kvcache_cpu(o, q, cache, slots[:, :win].contiguous(), bs, cache,
                                       slots[:, win:].contiguous(), bs, sink, 0.02)
            outs.append(o)
        tbl = _unique_rows(c1, sl[:, win:].contiguous(), bs)[0].shape[0]
        report(f"flash_mla: placement invariant ({tag}; {tbl} distinct compressed rows)",
               torch.equal(outs[0], outs[1]))

    # -- integration: insert with the emulated store, read back with the emulated attention --
    T, H, bs = 6, 4, 16
    kvv = torch.randn(T, HEAD_DIM, dtype=torch.bfloat16)
    positions = torch.arange(T, dtype=torch.int64) + 100
    cache = padded_cache(2, bs, 16)
    slot_mapping = torch.arange(T, dtype=torch.int64) + 3
    fused_qnorm_rope_kv_insert_cpu(torch.randn(T, H, HEAD_DIM, dtype=torch.bfloat16), kvv,
                                   positions, cache, slot_mapping, cs, H, 1e-6, bs)
    got = _dequant_rows(cache, slot_mapping, bs)
    x = kvv.float()
    x[:, NOPE_DIM:] = ref_rope(x[:, NOPE_DIM:], cs[positions, :32], cs[positions, 32:])
    x = x.to(torch.bfloat16).float()
    rope_ok = torch.equal(got[:, NOPE_DIM:], x[:, NOPE_DIM:])
    rel = ((got[:, :NOPE_DIM] - x[:, :NOPE_DIM]).abs()
           / x[:, :NOPE_DIM].abs().clamp(min=2.0 ** -6 * 4)).max().item()
    report("insert->dequant round trip: RoPE exact, NoPE within fp8 precision",
           rope_ok and rel <= 0.07, f"NoPE max rel err {rel:.3f}")
    # one-slot attention reproduces the stored row exactly-ish (weight of the single row)
    q1 = torch.randn(1, H, HEAD_DIM).to(torch.bfloat16)
    o1 = torch.empty(1, H, HEAD_DIM, dtype=torch.bfloat16)
    sink = torch.full((H,), -1e4)
    flash_mla_with_kvcache_cpu(o1, q1, cache, slot_mapping[:1].view(1, 1), bs, cache,
                               slot_mapping.new_full((1, 0), -1), 1, sink, 0.1)
    d = (o1.float() - got[0]).abs().max().item()
    report("flash_mla: single valid row, negligible sink -> that row", d <= 2e-2 * max(
        1.0, got[0].abs().max().item()), f"max abs diff {d:.2e}")

    # -- inverse_gptj_rope_o_proj_cpu ------------------------------------------------------
    for dtype in (torch.bfloat16, torch.float16):
        for T, H, D, R in [(1, 8, 512, 64), (17, 8, 512, 64), (3, 1, 64, 64)]:
            o = torch.randn(T, H, D, dtype=dtype)
            positions = torch.randint(0, 4096, (T,), dtype=torch.int64)
            csr = make_cos_sin_cache(4096, R)
            got = inverse_gptj_rope_o_proj_cpu(o, positions, csr, R)
            nope = D - R
            of = o.float()
            ref = torch.empty_like(of)
            ref[..., :nope] = of[..., :nope]
            cos = csr[positions, :R // 2].unsqueeze(1)
            sin = csr[positions, R // 2:].unsqueeze(1)
            e, od = of[..., nope::2], of[..., nope + 1::2]
            ref[..., nope::2] = e * cos + od * sin
            ref[..., nope + 1::2] = od * cos - e * sin
            d = (got - ref).abs().max().item()
            fwd = of.clone()
            fwd[..., nope:] = ref_rope(of[..., nope:], cos, sin)
            back = inverse_gptj_rope_o_proj_cpu(fwd.to(dtype), positions, csr, R)
            rt = (back - of).abs().max().item()
            report(f"inverse_rope {dtype} T={T} H={H} D={D}: vs eager, fp32 out, roundtrip",
                   got.dtype == torch.float32 and got.shape == o.shape and d <= 1e-5
                   and rt <= 5e-2, f"diff {d:.1e}, roundtrip {rt:.1e}")

    # -- convert_weight_packed / bmm_cpu ---------------------------------------------------
    for shape, dtype in [((2, 64, 96), torch.bfloat16), ((128, 256), torch.bfloat16),
                         ((4, 32, 16), torch.float8_e4m3fn), ((32, 64), torch.int8),
                         ((16, 8), torch.float32)]:
        w = (torch.randn(shape) * 4).to(dtype)
        w_nc = w.transpose(-1, -2).contiguous().transpose(-1, -2)  # non-contiguous input
        pw = convert_weight_packed(w_nc)
        report(f"convert_weight_packed {tuple(shape)} {dtype}: shape/dtype kept, same values,"
               " new storage", pw.shape == w.shape and pw.dtype == w.dtype and pw.is_contiguous()
               and torch.equal(pw.view(torch.uint8) if dtype == torch.float8_e4m3fn else pw,
                               w.view(torch.uint8) if dtype == torch.float8_e4m3fn else w)
               and pw.data_ptr() != w_nc.data_ptr())

    G, T, R, K = 4, 5, 64, 96  # groups, tokens, o_lora_rank, heads_per_group*head_dim
    wo_a = torch.randn(G, R, K, dtype=torch.bfloat16)
    packed = convert_weight_packed(wo_a)
    o_grouped = torch.randn(T, G, K, dtype=torch.bfloat16)
    mat1 = o_grouped.transpose(0, 1).contiguous()
    z = o_grouped.new_empty((G, T, R))
    bmm_cpu(z, mat1, packed, True, None)
    ref = torch.einsum("gtk,grk->gtr", mat1.float(), wo_a.float())
    d = (z.float() - ref).abs().max().item()
    report("bmm_cpu vnni (cpu_sparse._o_proj shapes): out = mat1 @ mat2^T",
           d <= 2e-2 * ref.abs().max().item(), f"max abs diff {d:.2e}")
    z2 = torch.empty(T, G, R, dtype=torch.bfloat16).transpose(0, 1)  # strided out view
    bmm_cpu(z2, mat1, wo_a, False, None)
    report("bmm_cpu is_vnni=False into a strided out == vnni result", torch.equal(z2, z))
    w8 = (torch.randn(G, R, K) * 8).to(torch.float8_e4m3fn)
    sc = torch.tensor(0.125)
    z3 = torch.empty(G, T, R, dtype=torch.bfloat16)
    bmm_cpu(z3, mat1, convert_weight_packed(w8), True, sc)
    ref3 = torch.einsum("gtk,grk->gtr", mat1.float(), w8.float() * 0.125)
    d = (z3.float() - ref3).abs().max().item()
    report("bmm_cpu fp8 w8a16 with per-tensor scale", d <= 2e-2 * ref3.abs().max().item(),
           f"max abs diff {d:.2e}")
    try:
        bmm_cpu(torch.empty(1, 2, 16, dtype=torch.bfloat16),
                torch.randn(1, 2, 8).bfloat16(), torch.randn(1, 16, 8).bfloat16(), False, None)
        report("bmm_cpu rejects N % 32 != 0 (as the kernel)", False)
    except RuntimeError:
        report("bmm_cpu rejects N % 32 != 0 (as the kernel)", True)
    return results


if __name__ == "__main__":
    self_check()
