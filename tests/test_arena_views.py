"""The arena's per-layer views (vLLM's own `create_kv_cache_views` over one int8 buffer, block
stride = the arena alignment, so granule g of a layer is its page at byte g * alignment and
pages of a layer overlap in the view) under vLLM's CPU attention kernels: writing K/V and
attending through granule ids gives bit-identical output to a dense cache, with another
layer's pages interleaved in the same bytes."""
from __future__ import annotations

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheLayout, KVCacheTensor,
                                        create_kv_cache_views)

BS, H, D = 32, 2, 64


def _split(kv):
    b, h, bs, _ = kv.size()
    return kv.view((b, h, bs * 2, -1)).chunk(2, dim=2)


def _attend(kv, block_table, q, k, v, slots, seq_lens, qsl, window):
    key_cache, value_cache = _split(kv)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec")
    meta = ops.cpu_attn_get_scheduler_metadata(
        len(seq_lens), H, H, D, seq_lens, q.dtype, qsl, True, window, "vec", False)
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, qsl, seq_lens, D ** -0.5,
                                    True, None, window, block_table, 0.0, meta, None)
    return out


@pytest.mark.parametrize("window", [-1, 40])
def test_granule_views_attend_like_a_dense_cache(window):
    torch.manual_seed(0)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    page = spec.page_size_bytes  # one layer's page
    align = page // 4  # pages start at any multiple of a quarter page: views overlap
    granules = 64
    raw = torch.zeros(granules * align + 2 * page, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=["l0", "l1"], layer_stride=page,
                           block_stride=align, offset=0)
    l0, l1 = create_kv_cache_views(raw, spec, granules, KVCacheLayout.LBHNC, tensor,
                                   kernel_block_size=BS)
    assert l0.shape[0] == granules and l0.stride(0) * 4 == align
    dense = torch.zeros(8, H, BS, 2 * D, dtype=torch.float32)

    lens = [70, 33]  # two requests, 3 and 2 pages
    dense_ids = [[1, 2, 3], [5, 6]]
    # Each page of the group spans both layers (2 * page bytes = 8 granules); scattered.
    arena_ids = [[40, 8, 24], [56, 0]]
    n = sum(lens)
    q = torch.randn(n, H, D)
    k, v = torch.randn(n, H, D), torch.randn(n, H, D)
    qsl = torch.tensor([0, lens[0], n], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    def slots(ids):
        return torch.tensor([ids[r][t // BS] * BS + t % BS
                             for r, L in enumerate(lens) for t in range(L)], dtype=torch.int64)

    def table(ids):
        t = torch.zeros(2, 4, dtype=torch.int32)
        for r, row in enumerate(ids):
            t[r, :len(row)] = torch.tensor(row, dtype=torch.int32)
        return t

    want = _attend(dense, table(dense_ids), q, k, v, slots(dense_ids), seq_lens, qsl, window)
    # Layer 1 writes its own (different) K/V into the same pages first: it sits beside layer
    # 0's bytes in every page and must not disturb them.
    _attend(l1, table(arena_ids), q, -k, 2 * v, slots(arena_ids), seq_lens, qsl, window)
    got = _attend(l0, table(arena_ids), q, k, v, slots(arena_ids), seq_lens, qsl, window)
    assert torch.equal(got, want)
    got1 = _attend(l1, table(arena_ids), q, -k, 2 * v, slots(arena_ids), seq_lens, qsl, window)
    want1 = _attend(torch.zeros_like(dense), table(dense_ids), q, -k, 2 * v, slots(dense_ids),
                    seq_lens, qsl, window)
    assert torch.equal(got1, want1)


def test_gdn_state_views_update_like_a_dense_state():
    """The recurrent (GDN) decode update reads and writes each request's state in place
    through its state index: through granule views over one buffer (states of two layers of a
    page side by side, pages overlapping in the view) it matches a dense state tensor."""
    from vllm.v1.kv_cache_interface import MambaSpec

    torch.manual_seed(0)
    hk, hv, kd, vd = 2, 4, 128, 128
    shapes = ((3, 1024), (hv, vd, kd))
    dtypes = (torch.bfloat16, torch.float32)
    spec = MambaSpec(block_size=1024, shapes=shapes, dtypes=dtypes)
    page = spec.page_size_bytes  # one layer's conv + ssm state
    align = 2048
    assert page % align == 0
    granules = 4 * page // align
    raw = torch.zeros(granules * align + 2 * page, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=["g0", "g1"], layer_stride=page,
                           block_stride=align, offset=0)
    views = create_kv_cache_views(raw, spec, granules, KVCacheLayout.LBHNC, tensor)

    def ssm_of(view):  # what MambaBase.bind_kv_cache makes of a layer's [B, 1, 1, C] pages
        pages = view.squeeze(dim=(1, 2))
        conv = 3 * 1024 * 2
        return pages[:, conv:conv + hv * vd * kd * 4].view(torch.float32).view(-1, hv, kd, vd)

    ssm0, ssm1 = ssm_of(views[0]), ssm_of(views[1])
    dense = torch.zeros(3, hv, kd, vd)
    # Two requests' states: granules 0 and 2 * page / align (pages of 2 layers each).
    g = torch.tensor([0, 2 * page // align], dtype=torch.int32)
    d = torch.tensor([0, 2], dtype=torch.int32)
    init = torch.randn(2, hv, kd, vd) * 0.1
    ssm0[g.long()] = init
    ssm1[g.long()] = -init  # the other layer's state beside it in the same pages
    dense[d.long()] = init
    A_log, dt_bias = torch.randn(hv, dtype=torch.bfloat16), torch.randn(hv, dtype=torch.bfloat16)
    outs = []
    for state, idx in ((ssm0, g), (dense, d)):
        torch.manual_seed(1)
        q = torch.randn(1, 2, hv, kd, dtype=torch.bfloat16)
        k = torch.randn(1, 2, hv, kd, dtype=torch.bfloat16)
        v = torch.randn(1, 2, hv, vd, dtype=torch.bfloat16)
        a, b = torch.randn(2, hv, dtype=torch.bfloat16), torch.randn(2, hv, dtype=torch.bfloat16)
        out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b,
            initial_state_source=state, initial_state_indices=idx,
            cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32),
            use_qk_l2norm_in_kernel=True)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(ssm0[g.long()], dense[d.long()])
    assert not torch.equal(dense[d.long()], init)  # the update really wrote the states
    assert torch.equal(ssm1[g.long()], -init)  # and nothing of the other layer's
