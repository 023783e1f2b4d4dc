"""Engine sizing of the device / host pools from a KV budget: the layout and the startup
errors, which must name a fix that works on the platform in use."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

from ulacache_vllm.engine.config import KVBackendError, UlaSettings
from ulacache_vllm.engine.dsa.sizing import DEFAULTED_KEY, apply_batch_tokens, plan_layout

BS = 16


def _specs(layers=2, indexer=(128, torch.float32)):
    out = {}
    for i in range(layers):
        out[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.float32,
            cache_role=SparseCacheRole.SPARSE)
        out[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=indexer[0], dtype=indexer[1],
            cache_role=SparseCacheRole.INDEXER)
    return out


def _config(batched=2048, chunked=False, max_len=1024, topk=64, defaulted=False, max_seqs=8):
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_len,
                                     hf_text_config=SimpleNamespace(index_topk=topk)),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=batched,
                                         max_num_scheduled_tokens=batched,
                                         enable_chunked_prefill=chunked, max_num_seqs=max_seqs),
        additional_config={DEFAULTED_KEY: ["max_num_batched_tokens"]} if defaulted else {})


def test_layout_splits_the_budget():
    row, idx = 2 * 576 * 4, 2 * 128 * 4  # bytes per token: MLA rows, indexer keys
    host = UlaSettings(host_pool_gib=4096 * row / 2**30)
    lay = plan_layout(_config(), _specs(), 8192 * (row + idx + 2) + 4096 * (idx + 2), host)
    assert lay.host_slots == 4096 and lay.device_slots == 8192
    assert lay.num_logical == lay.device_slots + lay.host_slots
    assert lay.device_slots % BS == 0 and lay.host_slots % BS == 0


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("defaulted", [False, True])
def test_device_pool_too_small_names_a_fix_that_applies(chunked, defaulted):
    # Without chunked prefill (vLLM's reference CPU MLA path) a defaulted batch size is fixed
    # too; with it, only an explicit one that does not fit is refused (a defaulted one is
    # lowered when max_num_seqs still fits, not here: 1 MB holds almost no slots).
    with pytest.raises(KVBackendError, match="device pool too small") as e:
        plan_layout(_config(chunked=chunked, defaulted=defaulted), _specs(), 1_000_000,
                    UlaSettings(host_pool_gib=0.01))
    msg = str(e.value)
    assert "2112" in msg  # max_num_batched_tokens 2048 + index_topk 64
    if chunked:
        assert "lower --max-num-batched-tokens" in msg
    else:  # vLLM's CPU build fixes the batch size for MLA: do not suggest changing it
        assert "lower --max-num-batched-tokens" not in msg and "fixed at 2048" in msg


def test_host_pool_too_small_for_one_request():
    with pytest.raises(KVBackendError, match="host pool too small.*at least"):
        plan_layout(_config(max_len=4096), _specs(), 1 << 30, UlaSettings(host_pool_gib=0.001))


@pytest.mark.parametrize("topk", [64, 24])  # 2048 + 24 is not a whole number of blocks
def test_suggested_device_budget_is_enough(topk):
    """The budget the error suggests must start: device slots come in whole blocks."""
    import re
    cfg, host = _config(topk=topk), UlaSettings(host_pool_gib=0.01)
    with pytest.raises(KVBackendError, match="device pool too small") as e:
        plan_layout(cfg, _specs(), 1_000_000, host)
    need = int(re.search(r"at least (\d+) bytes", str(e.value)).group(1))
    lay = plan_layout(cfg, _specs(), need, host)
    assert lay.device_slots >= 2048 + topk
    with pytest.raises(KVBackendError, match="device pool too small"):  # and it is the least
        plan_layout(cfg, _specs(), need - 1, host)


@pytest.mark.parametrize("max_len", [225, 1000, 4100])  # 225: 0.001 GiB holds 224 in blocks
def test_suggested_host_pool_is_enough(max_len):
    """The host pool the error suggests must hold one request in whole blocks."""
    import re
    cfg = _config(max_len=max_len)
    with pytest.raises(KVBackendError, match="host pool too small") as e:
        plan_layout(cfg, _specs(), 1 << 30, UlaSettings(host_pool_gib=0.001))
    gib = float(re.search(r"at least ([0-9.]+)", str(e.value)).group(1))
    lay = plan_layout(cfg, _specs(), 1 << 30, UlaSettings(host_pool_gib=gib))
    assert lay.host_slots >= max_len


def _budget_for(device_slots, host_slots=4096):
    row, idx = 2 * 576 * 4, 2 * 128 * 4
    return device_slots * (row + idx + 2) + host_slots * (idx + 2), \
        UlaSettings(host_pool_gib=host_slots * row / 2**30)


def test_defaulted_batch_size_is_lowered_to_the_device_pool_with_chunked_prefill():
    """The AMX path (chunked prefill on, LLM default 4096): a pool of 1024 slots starts with
    max_num_batched_tokens 1024 - index_topk, the startup line says so, and the scheduler
    config is lowered before the scheduler is built."""
    budget, host = _budget_for(1024)
    cfg = _config(batched=4096, chunked=True, defaulted=True)
    lay = plan_layout(cfg, _specs(), budget, host)
    assert lay.device_slots == 1024 and lay.batch_tokens_lowered == (4096, 1024 - 64)
    assert "lowered from its default 4096 to 960" in lay.summary(1024)
    apply_batch_tokens(cfg, lay)
    assert cfg.scheduler_config.max_num_batched_tokens == 960
    assert cfg.scheduler_config.max_num_scheduled_tokens == 960
    # Enough room: nothing lowered, nothing said.
    roomy = _config(batched=512, chunked=True, defaulted=True)
    lay = plan_layout(roomy, _specs(), budget, host)
    assert lay.batch_tokens_lowered is None and "lowered" not in lay.summary(1024)
    apply_batch_tokens(roomy, lay)
    assert roomy.scheduler_config.max_num_batched_tokens == 512


def test_explicit_batch_size_or_no_chunked_prefill_is_never_lowered():
    budget, host = _budget_for(1024)
    for cfg in (_config(batched=4096, chunked=True, defaulted=False),
                _config(batched=4096, chunked=False, defaulted=True)):
        with pytest.raises(KVBackendError, match="one step needs up to 4160"):
            plan_layout(cfg, _specs(), budget, host)


def test_lowering_keeps_room_for_a_decode_step_of_every_sequence():
    budget, host = _budget_for(128)  # 128 - 64 = 64 tokens a step < max_num_seqs 100
    with pytest.raises(KVBackendError, match="device pool too small"):
        plan_layout(_config(batched=4096, chunked=True, defaulted=True, max_seqs=100),
                    _specs(), budget, host)
    lay = plan_layout(_config(batched=4096, chunked=True, defaulted=True, max_seqs=64),
                      _specs(), budget, host)
    assert lay.batch_tokens_lowered == (4096, 64)


def _tp(cfg, tp):
    cfg.parallel_config = SimpleNamespace(tensor_parallel_size=tp)
    return cfg


@pytest.mark.parametrize("P", [2, 4])
def test_shard_mode_holds_p_times_the_tokens_of_replicate_in_the_same_per_rank_memory(P):
    """Per rank: its share of the indexer keys, its device pool, a remote-row buffer and its
    host pool; the logical space is P x the per-rank slots."""
    row, idx = 2 * 576 * 4, 2 * 132  # bytes per token: MLA rows, indexer keys
    budget = 6_000_000
    host = UlaSettings(host_pool_gib=0.006, tp_mode="replicate")
    rep = plan_layout(_tp(_config(batched=512), P), _specs_indexer(), budget, host)
    sh = plan_layout(_tp(_config(batched=512), P), _specs_indexer(), budget,
                     UlaSettings(host_pool_gib=0.006, remote_buffer_rows=64))
    assert (rep.shards, sh.shards, sh.tp_mode) == (1, P, "shard")
    assert sh.num_logical == P * (sh.device_slots + sh.host_slots)
    assert sh.remote_slots == 64 and sh.num_logical % BS == 0
    assert abs(sh.host_slots - rep.host_slots) < BS  # the same host pool per rank (whole blocks)
    # The device pool per rank loses only the remote buffer and gains the indexer keys it
    # no longer replicates: more than P x the replicated device tokens minus the buffer.
    assert P * sh.device_slots >= P * rep.device_slots - P * 64 - P * BS
    assert sh.num_logical >= 0.95 * P * rep.num_logical
    # What vLLM still allocates is placeholders (1 byte per layer per logical token).
    assert "TP shard mode" in sh.summary(1024) and str(sh.num_logical) in sh.summary(1024)


def _specs_indexer(layers=2):
    """The layer specs as a DSA model gives them: the indexer cache is 132 bytes per token."""
    return _specs(layers, indexer=(132, torch.uint8))


def test_shard_mode_refuses_a_block_size_that_p_does_not_divide():
    with pytest.raises(KVBackendError, match=r"block_size % tensor_parallel_size.*--block-size 48"):
        plan_layout(_tp(_config(batched=512), 3), _specs_indexer(), 6_000_000,
                    UlaSettings(host_pool_gib=0.006))


def test_shard_mode_host_pool_needs_only_one_request_s_share_per_rank():
    row = 2 * 576 * 4
    gib = 600 * row / 2**30  # 600 tokens per rank: 1024 / 2 = 512 fit, 1024 do not
    with pytest.raises(KVBackendError, match="max_model_len=1024"):
        plan_layout(_tp(_config(batched=512), 2), _specs_indexer(), 6_000_000,
                    UlaSettings(host_pool_gib=gib, tp_mode="replicate"))
    lay = plan_layout(_tp(_config(batched=512), 2), _specs_indexer(), 6_000_000,
                      UlaSettings(host_pool_gib=gib))
    assert lay.shards == 2 and lay.host_slots >= 512
    with pytest.raises(KVBackendError, match="one request's share per rank"):
        plan_layout(_tp(_config(batched=512, max_len=2048), 2), _specs_indexer(), 6_000_000,
                    UlaSettings(host_pool_gib=gib))


def _cuda_config(batched=2048, max_seqs=8, topk=64, spec_tokens=0):
    cfg = _config(batched=batched, max_seqs=max_seqs, topk=topk)
    cfg.speculative_config = SimpleNamespace(num_speculative_tokens=spec_tokens) \
        if spec_tokens else None
    return cfg


def test_cuda_glue_budget_holds_pools_staging_buffers_and_placeholders(monkeypatch):
    """On CUDA the glue's staging area, miss logs, carry accumulators, write buffers and
    claim table come out of the KV budget: vLLM's placeholders + indexer keys + device pools
    + those stay within it, and the device pool is what is left (no second copy)."""
    from ulacache_vllm.engine.dsa import sizing
    from ulacache_vllm.engine.dsa.cuda import (CLAIM_BYTES, MAPPING_BYTES, device_extra_bytes,
                                               staging_rows)

    layers = 2
    row, idx = 576 * 4, 128 * 4  # one layer's MLA row and indexer keys per token
    host = UlaSettings(host_pool_gib=4096 * layers * row / 2**30)
    budget = 8192 * (layers * (row + idx + 1)) + 4096 * layers * (idx + 1)
    cpu = plan_layout(_cuda_config(), _specs(layers), budget, host)
    monkeypatch.setattr(sizing, "cuda_glue_active", lambda: True)
    gpu = plan_layout(_cuda_config(), _specs(layers), budget, host)
    assert cpu.host_slots == gpu.host_slots == 4096
    S = staging_rows(8, 64, gpu.host_slots, BS)  # decode: max_num_seqs 8 x top-k 64
    assert S == 512
    extra = device_extra_bytes(S, row, layers, layers, 2048)
    # Indexer keys, placeholders, claim table, each group's (= layer's here) mapping tables.
    per_logical = layers * (idx + 1) + CLAIM_BYTES + layers * MAPPING_BYTES
    used = gpu.num_logical * per_logical + gpu.device_slots * layers * row + extra
    assert used <= budget
    # Not more than a block of device slots left unused.
    assert budget - used < BS * (per_logical + layers * row)
    assert gpu.device_slots < cpu.device_slots
    # Speculative tokens widen a decode step, so staging (and its bytes) grow with them.
    spec = plan_layout(_cuda_config(spec_tokens=3), _specs(layers), budget, host)
    assert spec.device_slots < gpu.device_slots


def test_cuda_glue_budget_refusal_counts_the_staging_bytes(monkeypatch):
    from ulacache_vllm.engine.dsa import sizing

    monkeypatch.setattr(sizing, "cuda_glue_active", lambda: True)
    row = 2 * 576 * 4
    host = UlaSettings(host_pool_gib=4096 * row / 2**30)
    with pytest.raises(KVBackendError, match=r"of them for the CUDA staging area"):
        plan_layout(_cuda_config(), _specs(), 100_000, host)
    monkeypatch.setenv("ULACACHE_CUDA_STAGING_ROWS", "3")  # below one token's 64 rows
    with pytest.raises(KVBackendError, match="ULACACHE_CUDA_STAGING_ROWS=3"):
        plan_layout(_cuda_config(), _specs(), 10**9, host)


def test_vllm_allocates_one_byte_per_token_for_the_mla_layers():
    """The spec vLLM allocates for each MLA layer under ulacache is the placeholder: 1 byte
    per token, also for fp8_ds_mla's 656 B packed rows with the FlashMLA block alignment."""
    from vllm.v1.attention.backend import MultipleOf

    from ulacache_vllm.engine.dsa.sizing import placeholder_spec

    fp8 = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=656, dtype=torch.uint8,
                           cache_role=SparseCacheRole.SPARSE, cache_dtype_str="fp8_ds_mla",
                           block_stride_alignment=MultipleOf(64))
    bf16 = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                            cache_role=SparseCacheRole.SPARSE)
    assert fp8.page_size_bytes == 64 * 656 and bf16.page_size_bytes == 64 * 1152
    for s in (fp8, bf16):
        p = placeholder_spec(s)
        assert p.page_size_bytes == 64 and p.get_block_stride_alignment() == 1
