"""The experimental CUDA glue (ulacache_vllm/engine/dsa/cuda, patches/cuda_sparse_backend.py) on
the CPU, against vLLM 0.32.0's real FlashMLA-sparse classes with the compiled pieces replaced by
torch references over the same bytes: ``flash_mla_sparse_fwd`` (bf16), ``flash_mla_with_kvcache``
(fp8_ds_mla, 656 B rows dequantised here), the Triton logical converter, and the fused write
kernel (a byte scatter at the slot mapping it is handed). Stock's impl reads a cache where every
logical slot holds its row; ulacache's reads ``[staging | device pool]`` with part of the rows in
the host pool: the attention outputs must be bit-equal, with host rows staged (counts > 0).

The impls are built without their __init__ (it needs a CUDA workspace manager and a model): the
attributes the forward reads are set as __init__ sets them (``_impl``). Nothing here needs CUDA.
"""
from __future__ import annotations

import types

import pytest
import torch

from vllm.v1.attention.backends.mla import flashmla_sparse as fms
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseBackend,
    FlashMLASparseImpl,
    FlashMLASparseMetadata,
    FlashMLASparseMetadataBuilder,
)

from ulacache_vllm.engine.config import KVBackendError
from ulacache_vllm.engine.dsa import cuda as ucuda
from ulacache_vllm.engine.dsa.cuda.backend import (
    BACKEND_PATH,
    UlaFlashMLASparseBackend,
    UlaFlashMLASparseImpl,
    UlaFlashMLASparseMetadataBuilder,
)
from ulacache_vllm.engine.dsa.cuda.runtime import CudaRows

B = 64  # block size (CUDA: multiple of 64; fp8 pages of 64)
K = 128  # index_topk (the converter needs a multiple of 128)
D, DV = 576, 512
FP8_ROW = 656
H = 4  # query heads (padded to 64 by stock's kernels wrappers)


# ----------------------------------------------------------- torch references
def convert_ref(req_id, block_table, token_indices, BLOCK_SIZE=64, BLOCK_STRIDE_ROWS=None,
                NUM_TOPK_TOKENS=2048, return_valid_counts=False, **kw):
    """triton_convert_req_index_to_global_index: block_table[req, p // B] * B + p % B (-1 and
    out-of-range blocks: -1); with valid counts, valid entries compacted to the front."""
    assert not kw.get("HAS_PREFILL_WORKSPACE"), "the workspace mode is not used here"
    stride = BLOCK_STRIDE_ROWS or BLOCK_SIZE
    p = token_indices.long()
    blk_i = p.clamp(min=0) // BLOCK_SIZE
    ok = (p >= 0) & (blk_i < block_table.shape[1])
    blk = block_table.long()[req_id.long().unsqueeze(1), blk_i.clamp(max=block_table.shape[1] - 1)]
    out = torch.where(ok & (blk >= 0), blk * stride + p % BLOCK_SIZE, torch.full_like(p, -1))
    out = out.to(torch.int32)
    if not return_valid_counts:
        return out
    valid = out >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return torch.gather(out, 1, order), valid.sum(1).to(torch.int32)


def _attend(q, kv, idx, valid, scale):
    """q [T, Hq, D] float32; kv [N, D] float32; idx/valid [T, K] -> out [T, Hq, DV], lse."""
    rows = kv.index_select(0, idx.clamp(min=0).reshape(-1)).view(*idx.shape, kv.shape[-1])
    logits = torch.einsum("thd,tkd->thk", q, rows) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)
    return torch.einsum("thk,tkd->thd", p, rows[..., :DV]), lse


def sparse_fwd_ref(q, kv, indices, sm_scale, topk_length=None, out=None):
    """flash_mla_sparse_fwd: q [T, Hp, D] bf16, kv [N, 1, D] bf16, indices [T, 1, K] int32."""
    idx = indices[:, 0, :].long()
    valid = idx >= 0
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1]) < topk_length.long().unsqueeze(1)
    o, lse = _attend(q.float(), kv[:, 0, :].float(), idx, valid, sm_scale)
    return o.to(q.dtype), None, lse


def dequant_fp8_rows(raw: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla rows (uint8 [N, 656]: 512 e4m3, 4 fp32 scales, 64 bf16 rope) -> [N, 576]."""
    nope = raw[:, :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = raw[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, dim=1)
    rope = raw[:, 528:656].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope * scales, rope], dim=1)


def fp8_kvcache_ref(q, k_cache, block_table, head_dim_v, cache_seqlens, tile_scheduler_metadata,
                    is_fp8_kvcache, indices, softmax_scale, **kw):
    """flash_mla_with_kvcache (sparse fp8): q [1, T, Hp, D], k_cache uint8 [pages, 64, 1, 656],
    indices [1, T, K] rows of the flattened pages."""
    assert is_fp8_kvcache and head_dim_v == DV
    kv = dequant_fp8_rows(k_cache.reshape(-1, k_cache.shape[-1]))
    idx = indices[0].long()
    o, lse = _attend(q[0].float(), kv, idx, idx >= 0, softmax_scale)
    return o.to(q.dtype).unsqueeze(0), lse.transpose(0, 1).unsqueeze(0)


def fused_write_ref(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor):
    """The fused write kernel's effect: row bytes at ``slot_mapping`` (negative: skipped)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    sm = slot_mapping.reshape(-1).long()
    keep = sm >= 0
    flat.index_copy_(0, sm[keep], rows.view(flat.dtype).view(-1, flat.shape[-1])[keep])


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(fms, "flash_mla_sparse_fwd", sparse_fwd_ref)
    monkeypatch.setattr(fms, "flash_mla_with_kvcache", fp8_kvcache_ref)
    monkeypatch.setattr(fms, "triton_convert_req_index_to_global_index", convert_ref)
    # FlashMLA's tile-scheduler plan object (fp8 chunks get their own; the reference ignores it).
    monkeypatch.setattr(fms, "get_mla_metadata", lambda *a, **k: (types.SimpleNamespace(), None))


# ------------------------------------------------------------------ fixtures
def _impl(cls, kv_cache_dtype, topk_buf):
    impl = object.__new__(cls)
    impl.num_heads = H
    impl.kv_cache_dtype = kv_cache_dtype
    impl.topk_indices_buffer = topk_buf
    impl.softmax_scale = D ** -0.5
    impl.prefill_padding = 64
    impl.fp8_decode_padded_heads = FlashMLASparseImpl._compute_fp8_decode_padded_heads(H)
    impl.q_head_size = D
    impl.kv_lora_rank = DV
    impl.dcp_world_size = 1
    impl.need_to_return_lse_for_decode = False
    impl.index_group = None
    return impl


def _rows_bytes(n: int, fp8: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not fp8:
        return (torch.randn(n, D, generator=g) * 0.5).to(torch.bfloat16).view(torch.uint8)
    nope = (torch.randn(n, 512, generator=g) * 2).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = (torch.rand(n, 4, generator=g) + 0.1).view(torch.uint8)
    rope = torch.randn(n, 64, generator=g).to(torch.bfloat16).view(torch.uint8)
    return torch.cat([nope, scales, rope], 1)


class World:
    """Two requests over logical blocks (request 0: blocks 3, 5, 1; request 1: blocks 6, 2),
    one layer group of two layers; the device pool holds 2 blocks per layer, the rest of the
    live rows sit in the host pool."""

    def __init__(self, fp8: bool, staging: int = 6 * B, promote_after: int = 1):
        self.fp8 = fp8
        self.row_bytes = FP8_ROW if fp8 else 2 * D
        self.layers = ["l0", "l1"]
        self.num_blocks = 8
        self.block_table = torch.tensor([[3, 5, 1], [6, 2, -1]], dtype=torch.int32)
        self.lens = [3 * B, 2 * B]
        live = torch.cat([torch.arange(b * B, (b + 1) * B) for b in (3, 5, 1, 6, 2)])
        self.live = live
        self.logical_bytes = {n: torch.zeros(self.num_blocks * B, self.row_bytes, dtype=torch.uint8)
                              for n in self.layers}
        for i, n in enumerate(self.layers):
            self.logical_bytes[n][live] = _rows_bytes(live.numel(), fp8, seed=10 + i)
        self.rows = CudaRows([self.layers], row_bytes=self.row_bytes, head_size=D,
                             kv_dtype=torch.uint8 if fp8 else torch.bfloat16, block_size=B,
                             device_slots=2 * B, host_slots=6 * B, staging_rows=staging,
                             num_logical=self.num_blocks * B, max_tokens=64, device="cpu",
                             promote_after=promote_after)
        # Written in order: the device pool keeps the last two blocks' rows, the others were
        # demoted to the host pool by assign.
        for b in (3, 5, 1, 6, 2):
            s = torch.arange(b * B, (b + 1) * B)
            self.rows.seed(0, s, {n: self.logical_bytes[n][s] for n in self.layers})

    def stock_cache(self, layer: str) -> torch.Tensor:
        raw = self.logical_bytes[layer]
        t = raw if self.fp8 else raw.view(torch.bfloat16)
        return t.view(self.num_blocks, B, t.shape[-1])

    def batch(self, decode_only: bool, seed: int = 0):
        """q, top-k positions and metadata. Decode-only: one token per request; mixed: request
        0 decodes one token, request 1 prefills 3."""
        g = torch.Generator().manual_seed(seed)
        q_per_req = [1, 1] if decode_only else [1, 3]
        req_id = torch.cat([torch.full((n,), r, dtype=torch.int32)
                            for r, n in enumerate(q_per_req)])
        T = req_id.numel()
        topk = torch.full((T, K), -1, dtype=torch.int32)
        for t in range(T):
            L = self.lens[int(req_id[t])]
            n = min(K - 8, L)
            pos = torch.randperm(L, generator=g)[:n].to(torch.int32)
            pos[:4] = pos[4]  # duplicates within a token
            topk[t, :n] = pos
        q = (torch.randn(T, H, D, generator=g) * 0.3).to(torch.bfloat16)
        qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_per_req), 0)), dtype=torch.int32)
        md = types.SimpleNamespace(
            block_table=self.block_table, req_id_per_token=req_id, block_size=B,
            num_decode_tokens=T if decode_only else 1, num_actual_tokens=T,
            query_start_loc=qsl, fp8_use_mixed_batch=True,
            fp8_extra_metadata=FlashMLASparseMetadata.FP8KernelMetadata(
                scheduler_metadata=None, dummy_block_table=torch.zeros(2, 1, dtype=torch.int32),
                cache_lens=torch.tensor(self.lens, dtype=torch.int32)))
        return q, topk, md


def _stock_out(world, layer, q, topk, md):
    impl = _impl(FlashMLASparseImpl, "fp8_ds_mla" if world.fp8 else "auto", topk)
    # Stock's decode-only path converts through the index group: the same conversion.
    impl._convert_logical_to_physical_topk = lambda ti, m, block_stride_rows=None, \
        return_valid_counts=False: convert_ref(m.req_id_per_token[: ti.shape[0]], m.block_table,
                                               ti, BLOCK_SIZE=m.block_size,
                                               BLOCK_STRIDE_ROWS=block_stride_rows,
                                               NUM_TOPK_TOKENS=ti.shape[1],
                                               return_valid_counts=return_valid_counts)
    out, _ = impl.forward_mqa(q, world.stock_cache(layer), md, None)
    return out


def _ula_out(world, layer, q, topk, md):
    impl = _impl(UlaFlashMLASparseImpl, "fp8_ds_mla" if world.fp8 else "auto", topk)
    impl.register(world.rows, layer)
    out, _ = impl.forward_mqa(q, world.rows.kv_view(layer), md, None)
    return out


# ---------------------------------------------------------------------- tests
def test_backend_classes_subclass_vllms_flashmla_sparse():
    assert issubclass(UlaFlashMLASparseBackend, FlashMLASparseBackend)
    assert issubclass(UlaFlashMLASparseImpl, FlashMLASparseImpl)
    assert issubclass(UlaFlashMLASparseMetadataBuilder, FlashMLASparseMetadataBuilder)
    assert UlaFlashMLASparseBackend.get_impl_cls() is UlaFlashMLASparseImpl
    assert UlaFlashMLASparseBackend.get_builder_cls() is UlaFlashMLASparseMetadataBuilder
    # vLLM keys the fp8_ds_mla layout and the flat-cache choice off the name.
    assert UlaFlashMLASparseBackend.get_name() == "FLASHMLA_SPARSE"
    assert BACKEND_PATH.endswith("cuda.backend.UlaFlashMLASparseBackend")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_attention_equals_stock_with_host_rows_staged(kernels, fp8, decode_only):
    w = World(fp8)
    m = w.rows.mappings[0]
    assert m.host_used > 0 and m.device_used > 0  # both tiers hold live rows
    q, topk, md = w.batch(decode_only)
    for layer in w.layers:
        ref = _stock_out(w, layer, q, topk, md)
        got = _ula_out(w, layer, q, topk, md)
        staged = int(w.rows.logs[layer].counts[0])
        assert staged > 0, "no host row was staged: the test would not exercise the path"
        assert int(w.rows.logs[layer].counts[1]) == 0  # nothing unmapped
        assert got.shape == ref.shape
        assert torch.equal(got, ref), (layer, (got.float() - ref.float()).abs().max())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("decode_only,staging", [(True, 2 * B), (False, 2 * B), (False, 4 * B)],
                         ids=["decode-S=K", "mixed-S=K", "mixed-S=2K"])
def test_call_larger_than_staging_runs_in_token_chunks_equal_to_stock(kernels, fp8, decode_only,
                                                                       staging):
    """Staging below min(T x K, host rows) (decode-sized staging, a larger call): the call runs
    in chunks of S // K tokens, each staged then attended; outputs bit-equal to stock's, every
    chunk's distinct misses <= S, and the settle sees every chunk's misses (carried)."""
    w = World(fp8, staging=staging)
    rows = w.rows
    q, topk, md = w.batch(decode_only)
    T = q.shape[0]
    per_chunk = staging // K
    want = -(-T // per_chunk)
    assert want > 1 and min(T * K, rows.H) > rows.S  # the old design would refuse this call
    seen = {n: [] for n in w.layers}
    orig = rows.resolve_stage

    def spy(layer, logical, ntok=None, **kw):
        out = orig(layer, logical, ntok, **kw)
        seen[layer].append((logical.shape[0], int(rows.logs[layer].counts[0]), kw["carry"]))
        return out

    rows.resolve_stage = spy
    for layer in w.layers:
        got = _ula_out(w, layer, q, topk, md)
        assert torch.equal(got, _stock_out(w, layer, q, topk, md))
    for layer in w.layers:
        calls = seen[layer]
        assert [c[0] for c in calls] == [min(per_chunk, T - i * per_chunk) for i in range(want)]
        assert [c[2] for c in calls] == [False] + [True] * (want - 1)
        assert all(0 <= c[1] <= rows.S for c in calls)
        assert sum(c[1] for c in calls) > 0  # host rows were staged
    assert rows.counters["chunked_calls"] == len(w.layers)
    assert rows.counters["attention_chunks"] == want * len(w.layers) > len(w.layers)
    if fp8:  # one plan per chunk length, shared by the layers (as stock's per step)
        lens = {c[0] for c in seen["l0"]}
        assert set(md._ula_fp8_chunk_meta) == lens - {T}
    # The settle gets every chunk's misses of the group's leader (l0), not just the last.
    rows.begin_step()
    assert rows.counters["staged"] == sum(c[1] for c in seen["l0"])
    assert rows.counters["unsettled"] == rows.counters["overflow"] == 0
    assert rows.counters["promotions"] > 0
    rows.resolve_stage = orig
    for layer in w.layers:  # after the settle moved rows: still equal
        assert torch.equal(_ula_out(w, layer, q, topk, md), _stock_out(w, layer, q, topk, md))


def test_padded_rows_of_a_chunked_call_read_nothing(kernels):
    """Graph padding (tokens past query_start_loc[-1]) falls in a later chunk: its count is
    shifted per chunk on the device; those rows read nothing, the others equal stock."""
    w = World(False, staging=2 * B)  # one token per chunk
    q, topk, md = w.batch(decode_only=False)
    md.query_start_loc = md.query_start_loc.clone()
    md.query_start_loc[-1] -= 2  # the last two tokens are padded rows
    got = _ula_out(w, "l0", q, topk, md)
    ref = _stock_out(w, "l0", q, topk, md)
    assert w.rows.counters["attention_chunks"] == q.shape[0]
    assert torch.equal(got[:-2], ref[:-2])
    assert torch.count_nonzero(got[-2:]) == 0


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_ds_mla"])
def test_settle_promotes_the_staged_rows_and_parity_holds(kernels, fp8):
    w = World(fp8)
    q, topk, md = w.batch(decode_only=True, seed=3)
    for layer in w.layers:
        _ula_out(w, layer, q, topk, md)
    staged_before = int(w.rows.logs["l0"].counts[0])
    w.rows.begin_step()  # outside the forward: settle the logged misses
    c = w.rows.counters
    assert c["promotions"] > 0 and c["demotions"] > 0 and c["staged"] == staged_before
    # The same selection again: fewer host reads (rows promoted), same output as stock.
    for layer in w.layers:
        got = _ula_out(w, layer, q, topk, md)
        assert torch.equal(got, _stock_out(w, layer, q, topk, md))
    assert int(w.rows.logs["l0"].counts[0]) < staged_before


def test_rows_read_once_stay_staged_and_a_second_read_promotes(kernels):
    """``promote_after`` 2 (the product default): the first settle of the staged misses
    promotes nothing (they stay on the host and are staged again, output still stock's); the
    same selection read again is promoted by the next settle."""
    w = World(False, promote_after=2)
    q, topk, md = w.batch(decode_only=True, seed=3)
    staged, moved = [], dict(w.rows.counters)  # (seeding the pools demoted rows)
    for _ in range(2):
        for layer in w.layers:
            assert torch.equal(_ula_out(w, layer, q, topk, md), _stock_out(w, layer, q, topk, md))
        staged.append(int(w.rows.logs["l0"].counts[0]))
        w.rows.begin_step()
        if len(staged) == 1:
            assert all(w.rows.counters[k] == moved[k] for k in ("promotions", "demotions"))
            # ...and counted as deferred (what /metrics reports as ulacache_deferred)
            assert w.rows.counters["deferred"] - moved["deferred"] == staged[0]
    assert staged[0] == staged[1] > 0  # nothing moved in between: the same rows staged again
    assert w.rows.counters["promotions"] > 0
    for layer in w.layers:
        assert torch.equal(_ula_out(w, layer, q, topk, md), _stock_out(w, layer, q, topk, md))
    assert int(w.rows.logs["l0"].counts[0]) < staged[1]


def test_without_resolve_the_output_differs(kernels):
    """Mutation check: reading the pool at logical slots (stock's conversion alone) differs."""
    w = World(False)
    q, topk, md = w.batch(decode_only=False)
    ref = _stock_out(w, "l0", q, topk, md)
    impl = _impl(UlaFlashMLASparseImpl, "auto", topk)
    impl.register(w.rows, "l0")
    kv = w.rows.kv_view("l0")
    n = kv.shape[0] * kv.shape[1]
    # Resolve skipped: logical slots read as rows (wrapped into the view's range).
    w.rows.resolve_stage = lambda layer, lg, ntok=None, **kw: torch.where(lg >= 0, lg % n, lg)
    bad, _ = impl.forward_mqa(q, kv, md, None)
    assert not torch.equal(bad, ref)


def test_padded_batch_rows_read_nothing(kernels):
    w = World(False)
    q, topk, md = w.batch(decode_only=False)
    md.query_start_loc = md.query_start_loc.clone()
    md.query_start_loc[-1] -= 1  # the last token is a padded (graph) row
    impl = _impl(UlaFlashMLASparseImpl, "auto", topk)
    impl.register(w.rows, "l0")
    out, _ = impl.forward_mqa(q, w.rows.kv_view("l0"), md, None)
    ref = _stock_out(w, "l0", q, topk, md)
    assert torch.equal(out[:-1], ref[:-1])
    assert torch.count_nonzero(out[-1]) == 0  # every selection of the padded row: -1


def test_unregistered_layer_and_foreign_cache_are_refused(kernels):
    w = World(False)
    q, topk, md = w.batch(decode_only=True)
    impl = _impl(UlaFlashMLASparseImpl, "auto", topk)
    with pytest.raises(RuntimeError, match="not registered"):
        impl.forward_mqa(q, w.rows.kv_view("l0"), md, None)
    impl.register(w.rows, "l0")
    with pytest.raises(RuntimeError, match="not ulacache's"):
        impl.forward_mqa(q, w.stock_cache("l0"), md, None)
    with pytest.raises(RuntimeError, match="mixed-batch"):
        impl._forward_fp8_kv_separate_prefill_decode(q, None, topk, md)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_ds_mla"])
def test_writes_through_the_static_slot_buffer_land_where_reads_find_them(kernels, fp8):
    """The runner's slot mapping for an MLA layer becomes a view of ulacache's static buffer;
    begin_step fills it with translated rows; the fused write kernel, handed that buffer,
    writes the bytes stock writes at the logical slots; attention then matches stock."""
    w = World(fp8)
    new_block = 7  # request 1 grows into logical block 7
    w.block_table[1, 2] = new_block
    logical_sm = torch.full((8,), -1, dtype=torch.int64)
    logical_sm[:5] = torch.arange(new_block * B, new_block * B + 5)  # 5 new tokens, 3 padding
    new = {n: _rows_bytes(5, fp8, seed=40 + i) for i, n in enumerate(w.layers)}
    views = {n: w.rows.register_writes(n, logical_sm) for n in w.layers}
    ptrs = {n: v.data_ptr() for n, v in views.items()}
    w.rows.begin_step()
    for n in w.layers:
        assert views[n].data_ptr() == w.rows.write_rows[n].data_ptr()  # the static buffer
        assert bool((views[n] >= 0).all())  # padding goes to the trash (staging) row
        assert int(views[n][5]) == w.rows.S - 1
        full = torch.zeros(8, w.row_bytes, dtype=torch.uint8)
        full[:5] = new[n]
        fused_write_ref(w.rows.kv_view(n), views[n], full)
        fused_write_ref(w.stock_cache(n), logical_sm, full)  # stock, at logical slots
    w.lens[1] = 2 * B + 5
    # The next step's views sit at the same address (graph replay reads the same buffer).
    again = w.rows.register_writes("l0", logical_sm)
    assert again.data_ptr() == ptrs["l0"]
    q, topk, md = w.batch(decode_only=True, seed=5)
    topk[1, :5] = torch.arange(2 * B, 2 * B + 5, dtype=torch.int32)  # read the new tokens
    for n in w.layers:
        assert torch.equal(_ula_out(w, n, q, topk, md), _stock_out(w, n, q, topk, md))


def test_host_pool_is_exact_size_and_pinned_through_the_given_pinner():
    pinned = []
    rows = CudaRows([["a"], ["b"]], row_bytes=FP8_ROW, head_size=D, kv_dtype=torch.uint8,
                    block_size=B, device_slots=B, host_slots=3 * B + 5, staging_rows=B,
                    num_logical=8 * B, max_tokens=16, device="cpu",
                    pin=lambda t: pinned.append(t) or t)
    assert [id(t) for t in pinned] == [id(rows.host["a"]), id(rows.host["b"])]
    for t in rows.host.values():
        assert t.untyped_storage().nbytes() == (3 * B + 5) * FP8_ROW
    # [staging | pool a | pool b], layer views in vLLM's [blocks, block, head] shape.
    assert rows.buf.shape == (B + 2 * B, FP8_ROW)
    assert rows.kv_view("b").shape == (3, B, FP8_ROW) and rows.dev_base("b") == 2 * B
    with pytest.raises(ValueError, match="multiple of the block size"):
        CudaRows([["a"]], row_bytes=FP8_ROW, head_size=D, kv_dtype=torch.uint8, block_size=B,
                 device_slots=B, host_slots=B, staging_rows=B + 1, num_logical=4 * B,
                 max_tokens=4, device="cpu")


# ---------------------------------------------------------------- refusals
def _config(**over):
    from vllm.config.compilation import CUDAGraphMode

    pc = types.SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                               pipeline_parallel_size=1)
    cfg = types.SimpleNamespace(
        parallel_config=pc, cache_config=types.SimpleNamespace(cache_dtype="auto"),
        compilation_config=types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
        attention_config=types.SimpleNamespace(hisparse_config=None, sparse_mla_force_mqa=False))
    for k, v in over.items():
        obj, attr = k.split("__")
        setattr(getattr(cfg, obj), attr, v)
    return cfg


@pytest.mark.parametrize("over,problem,fix", [
    ({"parallel_config__decode_context_parallel_size": 2}, "decode context parallelism",
     "Drop --decode-context-parallel-size"),
    ({"parallel_config__prefill_context_parallel_size": 2}, "prefill context parallelism",
     "Drop --prefill-context-parallel-size"),
    ({"parallel_config__pipeline_parallel_size": 2}, "pipeline parallelism",
     "Use --tensor-parallel-size instead"),
    ({"cache_config__cache_dtype": "nvfp4_ds_mla"}, "nvfp4_ds_mla",
     "Use --kv-cache-dtype fp8"),
    ({"compilation_config__cudagraph_mode": "FULL"}, "cudagraph_mode FULL",
     "FULL_AND_PIECEWISE"),
    ({"attention_config__hisparse_config": object()}, "HiSparse", "Drop the HiSparse"),
])
def test_refusals_name_the_problem_and_the_fix(over, problem, fix):
    from vllm.config.compilation import CUDAGraphMode

    over = {k: (CUDAGraphMode.FULL if v == "FULL" else v) for k, v in over.items()}
    with pytest.raises(KVBackendError) as e:
        ucuda.check_cuda_config(_config(**over))
    assert problem in str(e.value) and fix in str(e.value), str(e.value)


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_covered_graph_modes_pass_and_force_mqa_prefill(mode):
    from vllm.config.compilation import CUDAGraphMode

    cfg = _config(compilation_config__cudagraph_mode=CUDAGraphMode[mode])
    ucuda.check_cuda_config(cfg)
    assert cfg.attention_config.sparse_mla_force_mqa is True


class _Stop(Exception):
    pass


@pytest.fixture
def not_cpu(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)


def _finalize_cfg(arch="DeepseekV32ForCausalLM", **over):
    """A config as `wiring.prepare_engine_args` leaves it: the line chosen for the model and
    recorded in additional_config."""
    from transformers import PretrainedConfig

    from ulacache_vllm.engine.lines import choose_line, record_line

    cfg = _config(**over)
    hf = PretrainedConfig(architectures=[arch], index_topk=128)
    cfg.model_config = types.SimpleNamespace(hf_config=hf)
    cfg.additional_config = record_line({"kv_backend": "ulacache"},
                                        choose_line(cfg.model_config))
    return cfg


def test_cuda_is_refused_by_default_with_todays_message(not_cpu, monkeypatch):
    from ulacache_vllm.engine import wiring
    from ulacache_vllm.engine.config import UlaSettings

    for value in (None, "0", "true", "experimental"):
        if value is None:
            monkeypatch.delenv(ucuda.OPT_IN_ENV, raising=False)
        else:
            monkeypatch.setenv(ucuda.OPT_IN_ENV, value)
        with pytest.raises(KVBackendError) as e:
            wiring.finalize_vllm_config(_finalize_cfg(), UlaSettings())
        assert str(e.value) == ucuda.CUDA_REFUSAL
        assert "CPU build only" in str(e.value)


def test_the_cuda_refusal_names_the_opt_in():
    assert f"{ucuda.OPT_IN_ENV}=1" in ucuda.CUDA_REFUSAL
    assert "--kv-backend vllm" in ucuda.CUDA_REFUSAL


def test_opt_in_passes_the_gate_and_runs_the_checks(not_cpu, monkeypatch):
    from ulacache_vllm.engine import wiring
    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.lines import line_named

    monkeypatch.setenv(ucuda.OPT_IN_ENV, "1")

    def stop(*_):
        raise _Stop

    monkeypatch.setattr(line_named("dsa"), "prepare", stop)
    cfg = _finalize_cfg()
    with pytest.raises(_Stop):  # past the refusal, into the line's preparation
        wiring.finalize_vllm_config(cfg, UlaSettings())
    assert cfg.attention_config.sparse_mla_force_mqa is True
    with pytest.raises(KVBackendError, match="decode context parallelism"):
        wiring.finalize_vllm_config(
            _finalize_cfg(parallel_config__decode_context_parallel_size=2), UlaSettings())
    arena = _finalize_cfg("GptOssForCausalLM")
    with pytest.raises(KVBackendError) as e:  # the arena line has no CUDA glue at all
        wiring.finalize_vllm_config(arena, UlaSettings())
    assert str(e.value) == line_named("arena").cuda_refusal
    assert "CPU build only" in str(e.value) and "DSA models only" in str(e.value)


# ------------------------------------------------------------------- patches
def _vllm_config(ulacache: bool):
    """A real VllmConfig of a DSA model (no model files: the model config is a stand-in) with
    the line recorded as `wiring.prepare_engine_args` records it, or a stock one."""
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig

    from ulacache_vllm.engine.lines import choose_line, record_line

    mc = types.SimpleNamespace(hf_config=PretrainedConfig(architectures=["DeepseekV32ForCausalLM"],
                                                          index_topk=K))
    extra = record_line({"kv_backend": "ulacache"}, choose_line(mc)) if ulacache else {}
    cfg = VllmConfig(additional_config=extra)
    return cfg


def test_patch_is_a_no_op_without_cuda_and_opt_in(monkeypatch):
    from ulacache_vllm.patches import cuda_sparse_backend as P
    from ulacache_vllm.patches._hook import is_patched

    monkeypatch.setenv(ucuda.OPT_IN_ENV, "1")
    assert P.install() is False  # the CPU platform
    for m in P.SLOT_MAPPING_MODULES:
        assert not is_patched(m, "build_slot_mappings_by_layer", P.HOOK)


def test_backend_hook_fails_loudly_where_its_module_is_missing():
    """On the CPU build vllm.platforms.cuda cannot import (no compiled ops): the hook says so
    instead of silently leaving stock's backend choice."""
    from ulacache_vllm.patches import cuda_sparse_backend as P
    from ulacache_vllm.patches._hook import VllmHookError

    with pytest.raises(VllmHookError, match="vllm.platforms.cuda"):
        P.install_backend_choice()


def test_patch_hooks_backend_choice_and_slot_mappings(monkeypatch):
    import importlib

    from ulacache_vllm.patches import cuda_sparse_backend as P
    from ulacache_vllm.patches._hook import is_patched, resolve

    saved = [(m, resolve(m, "build_slot_mappings_by_layer", P.HOOK))
             for m in P.SLOT_MAPPING_MODULES]
    try:
        P.install_slot_mappings()
        P.install_slot_mappings()  # idempotent
        for m in P.SLOT_MAPPING_MODULES:
            assert is_patched(m, "build_slot_mappings_by_layer", P.HOOK)

        class Platform:  # stands in for CudaPlatform (its module needs the CUDA build)
            pass

        sparse = types.SimpleNamespace(use_sparse=True)
        dense = types.SimpleNamespace(use_sparse=False)
        orig = lambda cls, sel, cfg, nh=None: "stock"  # noqa: E731
        from vllm.config import set_current_vllm_config

        ula, stock = _vllm_config(ulacache=True), _vllm_config(ulacache=False)
        with set_current_vllm_config(ula):
            assert P.select_backend(orig, Platform, None, sparse) == BACKEND_PATH
            assert P.select_backend(orig, Platform, None, dense) == "stock"
        with set_current_vllm_config(stock):
            assert P.select_backend(orig, Platform, None, sparse) == "stock"
        assert P.select_backend(orig, Platform, None, sparse) == "stock"  # no config in scope

        # Slot mappings: MLA layers of the active rows get the static buffer, others stay.
        rows = CudaRows([["mla0"]], row_bytes=2 * D, head_size=D, kv_dtype=torch.bfloat16,
                        block_size=B, device_slots=B, host_slots=B, staging_rows=B,
                        num_logical=4 * B, max_tokens=16, device="cpu")
        sm = torch.arange(6, dtype=torch.int64)
        group = types.SimpleNamespace(layer_names=["mla0", "indexer0"])
        kvc = types.SimpleNamespace(kv_cache_groups=[group])
        build = importlib.import_module("vllm.v1.worker.gpu.model_runner") \
            .build_slot_mappings_by_layer
        from ulacache_vllm.engine.dsa.cuda.runtime import ACTIVE

        monkeypatch.setitem(ACTIVE, "rows", None)
        plain = build(sm.unsqueeze(0), kvc)
        assert plain["mla0"] is plain["indexer0"]  # no rows active: stock's mapping
        monkeypatch.setitem(ACTIVE, "rows", rows)
        out = build(sm.unsqueeze(0), kvc)
        assert out["mla0"].data_ptr() == rows.write_rows["mla0"].data_ptr()
        assert torch.equal(out["indexer0"], sm)  # the indexer keeps logical slots
        assert torch.equal(rows.logical_writes["mla0"], sm)
        # Graph capture's dummy batches get the static buffer but register nothing.
        rows.logical_writes.clear()
        cap = importlib.import_module("vllm.v1.worker.gpu.cudagraph_utils") \
            .build_slot_mappings_by_layer
        out = cap(sm.unsqueeze(0), kvc)
        assert out["mla0"].data_ptr() == rows.write_rows["mla0"].data_ptr()
        assert rows.logical_writes == {}
    finally:
        for mod, (owner, cur) in saved:
            setattr(owner, "build_slot_mappings_by_layer", cur)


# -------------------------------------------------------------------- worker
def _layout(**over):
    from ulacache_vllm.engine.dsa.sizing import UlaLayout

    kw = dict(block_size=B, device_slots=2 * B, host_slots=6 * B, num_logical=8 * B,
              num_blocks=8, mla_layers=["l0", "l1", "l2"], leaders=["l0", "l2"],
              mla_row_bytes={"l0": 2 * D, "l1": 2 * D, "l2": 2 * D}, mla_head_size=D,
              mla_dtype="bfloat16", indexer_bytes_per_token=132)
    kw.update(over)
    return UlaLayout(**kw)


def _engine(layout, impl_cls=UlaFlashMLASparseImpl):
    ctx = {n: types.SimpleNamespace(impl=_impl(impl_cls, "auto", None), kv_cache=None)
           for n in layout.mla_layers}
    cfg = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(static_forward_context=ctx),
        model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(index_topk=K)),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=32, max_num_seqs=2))
    kv = {n: torch.zeros(4, B, D, dtype=torch.bfloat16) for n in layout.mla_layers}
    return cfg, ctx, kv


def test_worker_installs_rows_registers_impls_and_runs_the_step(monkeypatch):
    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.dsa.cuda import runtime as rt
    from ulacache_vllm.engine.dsa.cuda.worker import CudaDsaWorker, layer_groups

    monkeypatch.setitem(rt.ACTIVE, "rows", None)
    lay = _layout()
    assert layer_groups(lay) == [["l0", "l1"], ["l2"]]
    cfg, ctx, kv = _engine(lay)
    w = CudaDsaWorker.build(lay, cfg, UlaSettings(), kv)
    rows = w.rows
    assert rt.ACTIVE["rows"] is rows
    assert len(rows.mappings) == 2
    assert {m.promote_after for m in rows.mappings} == {UlaSettings().promote_after} == {2}
    # Staging: a decode step's min(max_num_seqs x top-k, host rows), in whole blocks; a
    # 32-token call (max_num_batched_tokens) runs in chunks of S // K tokens.
    assert rows.S == min(2 * K, 6 * B) and rows.S % B == 0
    assert rows.chunks(32, K) == [(t, t + 2) for t in range(0, 32, 2)]
    for n in lay.mla_layers:
        assert ctx[n].impl.ula_rows is rows and ctx[n].impl.layer_name == n
        assert ctx[n].kv_cache.data_ptr() == rows.buf.data_ptr()
        assert ctx[n].kv_cache.shape == rows.kv_view(n).shape
    # A step: writes registered by the slot-mapping hook, then begin_step assigns them.
    sm = torch.arange(3 * B, 3 * B + 5)
    view = rows.register_writes("l0", sm)
    rows.register_writes("l1", sm)
    w.begin_step(types.SimpleNamespace(freed=[], hits=[]), None)
    assert rows.mappings[0].device_used == 5 and bool((view >= rows.dev_base("l0")).all())
    w.begin_step(types.SimpleNamespace(freed=[3], hits=[]), None)  # block 3 freed
    assert rows.mappings[0].device_used == 0
    u = w.usage()
    assert u["experimental_cuda"] is True and u["totals"]["steps"] == 2
    cfg.speculative_config = types.SimpleNamespace(num_speculative_tokens=1)  # 2 x (1 + 1)
    assert CudaDsaWorker.build(lay, cfg, UlaSettings(), kv).rows.S == min(4 * K, 6 * B)


def test_worker_refuses_stock_impls_and_tp_shard_mode():
    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.dsa.cuda.worker import CudaDsaWorker

    lay = _layout()
    cfg, _, kv = _engine(lay, FlashMLASparseImpl)
    with pytest.raises(RuntimeError, match="ULACACHE_EXPERIMENTAL_CUDA=1"):
        CudaDsaWorker.build(lay, cfg, UlaSettings(), kv)
    shard = _layout(tp_mode="shard", tp_world=2)
    cfg, _, kv = _engine(shard)
    with pytest.raises(RuntimeError, match="TP shard mode"):
        CudaDsaWorker.build(shard, cfg, UlaSettings(), kv)


def _no_device_read(*a, **k):
    raise AssertionError("stats() read a tensor")


def test_worker_stats_report_moves_and_pools_without_reading_the_device(kernels, monkeypatch):
    """stats() on the CUDA glue: promotions / demotions / bytes moved and the pool gauges, on
    the CPU path's schedule (moves or pool changes, else every STATS_EVERY steps), from host
    counters begin_step keeps: no tensor is read in stats()."""
    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.dsa.cuda import runtime as rt
    from ulacache_vllm.engine.dsa.cuda.worker import CudaDsaWorker
    from ulacache_vllm.engine.dsa.worker import STATS_EVERY

    monkeypatch.setitem(rt.ACTIVE, "rows", None)
    lay = _layout()  # group 0 = l0 + l1, device pool 2 blocks per group
    cfg, _, kv = _engine(lay)
    cfg.scheduler_config.max_num_batched_tokens = B  # a block of writes per step
    # promote_after 1: the block read once below is promoted by the next settle (the
    # admission itself is test_rows_read_once_stay_staged_and_a_second_read_promotes).
    w = CudaDsaWorker.build(lay, cfg, UlaSettings(promote_after=1), kv)
    rows = w.rows
    step = types.SimpleNamespace(freed=[], hits=[])

    def stats():
        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "__int__", "__bool__", "__index__", "cpu"):
                mp.setattr(torch.Tensor, name, _no_device_read)
            return w.stats(0)

    reports = []
    for b in range(3):  # one new block a step: the third demotes a block
        sm = torch.arange(b * B, (b + 1) * B)
        for n in ("l0", "l1"):
            rows.register_writes(n, sm)
        w.begin_step(step, None)
        reports.append(stats())
    assert all(r is not None for r in reports)  # pools changed every step
    d = reports[2].data
    assert d["demotions"] == B and d["promotions"] == 0 and d["deferred"] == 0
    assert d["bytes_moved"] == B * 2 * D * 2  # rows x 1152 B (bf16) x 2 layers of the group
    red = reports[2].reduce()
    assert red["device_used"] == 2 * B and red["host_used"] == B
    assert red["device_capacity"] == 2 * 2 * B and red["host_capacity"] == 2 * 6 * B
    assert stats() is None  # nothing moved, pools unchanged, not yet due
    # A forward reads the demoted block (host misses staged), the next step promotes it.
    logical = torch.full((1, K), -1, dtype=torch.int64)
    logical[0, :B] = torch.arange(B)
    rows.resolve_stage("l0", logical)
    assert int(rows.logs["l0"].counts[0]) == B
    w.begin_step(step, None)
    d = stats().data
    assert d["promotions"] == B and d["demotions"] == B  # the pool was full
    assert d["bytes_moved"] == 2 * B * 2 * D * 2
    rows.logs["l0"].counts.zero_()  # later forwards miss nothing
    for i in range(STATS_EVERY):
        w.begin_step(step, None)
        r = stats()
        assert (r is None) == (i < STATS_EVERY - 1)
    assert r.data["promotions"] == r.data["demotions"] == r.data["bytes_moved"] == 0
    assert r.reduce()["device_used"] == 2 * B


def test_staging_setting_below_the_bound_is_refused(monkeypatch):
    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.dsa.cuda.worker import STAGING_ENV, CudaDsaWorker

    lay = _layout()  # host pool 6B rows, top-k 128: one token's bound min(128, 384) = 128
    bound = K
    for bad in (str(bound - 1), "0", "lots"):
        monkeypatch.setenv(STAGING_ENV, bad)
        cfg, _, kv = _engine(lay)
        with pytest.raises(RuntimeError) as e:
            CudaDsaWorker.build(lay, cfg, UlaSettings(), kv)
        msg = str(e.value)
        assert f"{STAGING_ENV}={bad}" in msg and f"bound of {bound} rows" in msg
        assert f"Unset {STAGING_ENV}" in msg and f"at least {bound}" in msg
    monkeypatch.setenv(STAGING_ENV, str(bound + 1))  # at or above the bound: taken, in blocks
    cfg, _, kv = _engine(lay)
    rows = CudaDsaWorker.build(lay, cfg, UlaSettings(), kv).rows
    assert rows.S == bound + B
    assert rows.chunk_tokens(32, K) == 1  # one token per chunk: staging < 2 x top-k
    monkeypatch.setenv(STAGING_ENV, str(8 * B))  # above the decode default: taken as well
    cfg, _, kv = _engine(lay)
    assert CudaDsaWorker.build(lay, cfg, UlaSettings(), kv).rows.S == 8 * B
    monkeypatch.delenv(STAGING_ENV)
    cfg, _, kv = _engine(lay)
    cfg.model_config.hf_text_config.index_topk = 0  # no top-k: no bound
    with pytest.raises(RuntimeError, match="no index_topk"):
        CudaDsaWorker.build(lay, cfg, UlaSettings(), kv)


def test_staging_overflow_raises_and_never_returns_attention(kernels):
    """Staging below min(T x K, host rows): the call is refused from its shapes; with that
    check defeated the kernels overflow (the output differs from stock's: what the checks
    prevent) and the next step raises from the overflow count."""
    from ulacache_vllm.engine.dsa.cuda.runtime import StagingOverflowError

    w = World(False, staging=B)
    q, topk, md = w.batch(decode_only=True)
    with pytest.raises(StagingOverflowError, match="ULACACHE_CUDA_STAGING_ROWS"):
        _ula_out(w, "l0", q, topk, md)
    w.rows.H = 0  # defeats the shape check (need = min(T x K, H) = 0) to reach the kernels
    got = _ula_out(w, "l0", q, topk, md)
    assert int(w.rows.logs["l0"].counts[0]) > B  # more distinct misses than staging rows
    assert not torch.equal(got, _stock_out(w, "l0", q, topk, md))
    with pytest.raises(StagingOverflowError, match="overflowed the staging"):
        w.rows.begin_step()
    assert w.rows.counters["overflow"] == int(w.rows.logs["l0"].counts[0]) - B


def test_layout_builds_the_cuda_worker_for_cuda_caches(monkeypatch):
    from ulacache_vllm.engine.dsa.cuda import worker as cw

    seen = []
    monkeypatch.setattr(cw.CudaDsaWorker, "build",
                        classmethod(lambda cls, *a: seen.append(a) or "cuda-worker"))
    lay = _layout()
    cuda_cache = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    assert lay.build_worker("cfg", "settings", {"l0": cuda_cache}) == "cuda-worker"
    assert seen and seen[0][0] is lay


def test_forward_touches_pblru_labels_of_device_hits(kernels, monkeypatch):
    """PB-LRU labels are touched from the forward (resolve) with the current round."""
    from ulacache_vllm.core import policies, pblru

    monkeypatch.setattr(pblru, "SMALL_POOL_SLOTS", 0)
    monkeypatch.setenv("ULACACHE_PBLRU_SMALL_POOL_SLOTS", "0")
    w = World(False)
    m = w.rows.mappings[0]
    assert isinstance(m.policy, pblru.PBLRU) and w.rows.labels[0] is not None
    w.rows.begin_step()  # a new round: the forward's touches carry it
    lab = w.rows.labels[0]
    before = lab.clone()
    q, topk, md = w.batch(decode_only=True)
    _ula_out(w, "l0", q, topk, md)
    changed = (lab != before).nonzero().reshape(-1)
    assert changed.numel() > 0
    assert bool((lab[changed] == m.policy.round).all())


@pytest.mark.parametrize("staging", [B, 4 * B, 2048 * B], ids=["small", "mid", "over-acc"])
@pytest.mark.parametrize("lru", ["pblru", "exact_ts"])
def test_device_extra_bytes_are_what_the_rows_allocate_besides_the_pools(staging, lru):
    """dsa/sizing.py takes `device_extra_bytes` (+ the claim table) out of the KV budget: it
    must equal the device bytes CudaRows allocates besides its pools, so the user's budget
    holds. Counted from the tensors CudaRows holds (CPU: no claim table)."""
    from ulacache_vllm.engine.dsa.cuda import MAPPING_BYTES, device_extra_bytes

    groups = [["a", "b", "d"], ["c"]]
    rows = CudaRows(groups, row_bytes=FP8_ROW, head_size=D, kv_dtype=torch.uint8,
                    block_size=B, device_slots=2 * B, host_slots=4 * B, staging_rows=staging,
                    num_logical=6 * B, max_tokens=48, device="cpu", lru=lru)
    assert rows.state.claim.numel() == 0  # CPU: the reference resolve, no claim table

    def nbytes(ts):
        return sum(t.untyped_storage().nbytes() for t in ts)

    tensors = [rows.buf, rows.identity, rows.write_errors, rows._ar, rows.state.stamp,
               *rows.write_rows.values(), *rows.acc_addr, *rows.acc_counts, *rows.round_t]
    logs = {id(log): log for log in [*rows.logs.values(), rows.state.log]}.values()
    assert len(logs) == 2 + 1 + 1  # two leaders' logs, one shared by b and d, the state's
    assert rows.logs["b"] is rows.logs["d"] and rows.logs["b"] is not rows.logs["a"]
    for log in logs:
        tensors += [log.addr, log.host, log.counts]
    pools = 4 * rows.P * FP8_ROW
    small = nbytes([rows.identity, rows.write_errors, rows.state.stamp, *rows.round_t])
    assert nbytes(tensors) - pools - small == device_extra_bytes(staging, FP8_ROW, 4, 2, 48)
    # The mapping tables per logical address (sizing counts MAPPING_BYTES per group).
    def tensors_of(obj, depth=2):
        out = [v for v in vars(obj).values() if isinstance(v, torch.Tensor)]
        if depth:
            for v in vars(obj).values():
                if hasattr(v, "__dict__") and not isinstance(v, (torch.Tensor, type)):
                    out += tensors_of(v, depth - 1)
        return out

    for m in rows.mappings:
        assert m.num_logical == rows.P + rows.H
        ts = {id(t): t for t in tensors_of(m)}.values()  # tables, pools, policy (all tensors)
        assert any(t.numel() >= m.num_logical for t in ts)  # the per-address tables were found
        assert nbytes(ts) <= MAPPING_BYTES * m.num_logical + 16384  # + fixed index ranges
