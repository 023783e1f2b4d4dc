"""ulacache KV sizing: one logical address space over a device pool and a host pool.

The device budget (vLLM's normal KV budget, `D` bytes) holds the DSA indexer keys of every
logical token (the indexer scores the whole history each step, so its keys stay on the device)
plus the device pool of sparse-MLA rows; the host budget (`--ula-host-pool-gib`, `H` bytes)
holds host-tier MLA rows. Residency is exclusive, so the logical capacity is
`N = device_slots + host_slots` tokens:

    H = host_slots * M                      (M: MLA bytes per token, all layers)
    D = N * I + device_slots * M            (I: indexer bytes per token, all layers)

vLLM's block pool is sized to `N / block_size` logical blocks (plus its null block); the MLA
layers get a 1-byte placeholder spec so vLLM allocates only the indexer caches, and the worker
allocates the device and host MLA pools itself (`worker_store.py`; on CUDA `cuda.runtime.CudaRows`,
which binds its own ``[staging | pools]`` buffer as the layers' KV caches: vLLM's placeholder
tensors, 1 byte per token and MLA layer, stay allocated and are counted here).

On CUDA (experimental glue) the rows' other device buffers come out of `D` too, so the total
stays the KV budget the user gave: the staging area and the buffers sized by it (miss logs,
carry accumulators, write-slot buffers: `cuda.device_extra_bytes`, with the staging rows
`cuda.staging_rows` the worker uses), the resolve's claim table (`cuda.CLAIM_BYTES` per
logical token) and each layer group's mapping tables (`cuda.MAPPING_BYTES` per logical token
and group), the last two counted like the placeholders. Not counted: the settle's transient
tensors (sized by a step's misses).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any
from dataclasses import dataclass

import torch

from ..config import KVBackendError, UlaSettings, refuse_context_parallel, reported_to_front_end
from ..line import LineLayout, UlaKVCacheConfig
from .cuda import CLAIM_BYTES, MAPPING_BYTES, cuda_glue_active
from .cuda import decode_tokens as cuda_decode_tokens
from .cuda import device_extra_bytes as cuda_device_extra_bytes
from .cuda import staging_rows as cuda_staging_rows
from .layout import DsaLayout

GIB = 1 << 30


@dataclass
class UlaLayout(DsaLayout, LineLayout):
    """The layout figures (`layout.DsaLayout`, which the worker side reads) with the line's
    hooks."""

    def manager_cls(self) -> type:
        from .manager import UlaKVCacheManager

        return UlaKVCacheManager

    def build_worker(self, vllm_config, settings, kv_caches: dict):
        if next(iter(kv_caches.values())).device.type == "cuda":  # experimental opt-in only
            from .cuda.worker import CudaDsaWorker

            return CudaDsaWorker.build(self, vllm_config, settings, kv_caches)
        from .worker import DsaWorker

        return DsaWorker.build(self, vllm_config, settings, kv_caches)

    def summary(self, max_model_len: int) -> str:
        per_req = max(1, max_model_len)
        lowered = ""
        if self.batch_tokens_lowered:
            old, new = self.batch_tokens_lowered
            lowered = (f"; max_num_batched_tokens lowered from its default {old} to {new} "
                       f"so that one step fits the device pool (set it explicitly to choose)")
        if self.shards > 1:
            P = self.shards
            return (
                f"ulacache KV (TP shard mode, {P} ranks, token t on rank t mod {P}): per rank "
                f"{self.device_slots} device slots + {self.host_slots} host slots + "
                f"{self.remote_slots} remote-row buffer slots per MLA layer; total "
                f"{P * self.device_slots} device + {P * self.host_slots} host = "
                f"{self.num_logical} logical tokens ({len(self.mla_layers)} sparse-MLA layers, "
                f"{sum(self.mla_row_bytes.values())} B/token MLA, "
                f"{self.indexer_bytes_per_token} B/token indexer keys, each on one rank); "
                f"max concurrent requests of max_model_len={max_model_len}: "
                f"{self.num_logical // per_req}{lowered}")
        tp = f" (TP replicate mode: each of {self.tp_world} ranks holds all of it)" \
            if self.tp_world > 1 else ""
        return (
            f"ulacache KV{tp}: {self.device_slots} device slots + {self.host_slots} host slots "
            f"per MLA layer = {self.num_logical} logical tokens "
            f"({len(self.mla_layers)} sparse-MLA layers, "
            f"{sum(self.mla_row_bytes.values())} B/token MLA, "
            f"{self.indexer_bytes_per_token} B/token indexer keys); "
            f"max concurrent requests of max_model_len={max_model_len}: "
            f"{self.num_logical // per_req}{lowered}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _layer_index(name: str) -> tuple[int, str]:
    for part in name.split("."):
        if part.isdigit():
            return int(part), name
    return 1 << 30, name


def host_tokens_of(host_pool_gib: float, bytes_per_token: int, block_size: int = 1) -> int:
    """Tokens a host pool of ``host_pool_gib`` holds, in whole blocks."""
    return (int(host_pool_gib * GIB) // bytes_per_token) // block_size * block_size


def check_host_capacity(host_pool_gib: float, host_tokens: int, bytes_per_token: int,
                        num_layers: int, max_model_len: int, block_size: int = 1,
                        shards: int = 1) -> None:
    """The host pool must hold one request of max_model_len (in TP shard mode, each rank's
    pool its share: ceil(max_model_len / P) tokens), checked in the front end from the model
    config and again in the engine core from the exact layer specs. The suggested size is the
    least (in MiB-ish steps of 0.001 GiB) that holds it in whole blocks."""
    need = -(-max_model_len // shards)
    if host_tokens >= need:
        return
    need_gib = math.ceil(need * bytes_per_token / GIB * 1000) / 1000
    while host_tokens_of(need_gib, bytes_per_token, block_size) < need:
        need_gib = round(need_gib + 0.001, 3)
    what = (f"one request of max_model_len={max_model_len}" if shards == 1 else
            f"one request's share per rank ({need} tokens of max_model_len={max_model_len} "
            f"over {shards} TP ranks)")
    raise KVBackendError(
        f"ulacache host pool too small: --ula-host-pool-gib {host_pool_gib} holds "
        f"{host_tokens} tokens of sparse-MLA KV ({bytes_per_token} bytes/token over "
        f"{num_layers} layers), fewer than {what}. "
        f"Set --ula-host-pool-gib to at least {need_gib} or lower --max-model-len."
    )


def split_specs(specs: dict) -> tuple[dict, dict, dict]:
    """(sparse MLA specs, indexer specs, other specs) of one worker."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    mla, idx, other = {}, {}, {}
    for name, spec in specs.items():
        if isinstance(spec, MLAAttentionSpec) and spec.cache_role == SparseCacheRole.INDEXER:
            idx[name] = spec
        elif isinstance(spec, MLAAttentionSpec) and spec.cache_role == SparseCacheRole.SPARSE:
            mla[name] = spec
        else:
            other[name] = spec
    return mla, idx, other


def placeholder_spec(spec):
    """An MLA spec whose pages vLLM allocates as 1 byte per token: the real rows live in the
    ulacache device/host pools, allocated by the worker."""
    # state_content_bytes (set for packed formats such as fp8_ds_mla's 656 B rows) would
    # override the 1-byte size; alignment would pad it.
    return dataclasses.replace(spec, head_size=1, dtype=torch.uint8, page_size_padded=None,
                               state_content_bytes=None, alignment=None)


def plan_layout(vllm_config, specs: dict, available_bytes: int, settings: UlaSettings) -> UlaLayout:
    mla, idx, other = split_specs(specs)
    if not mla:
        raise KVBackendError(
            "--kv-backend ulacache found no sparse-MLA (DSA) attention layers in this model; "
            "it serves DeepSeek-V3.2 / GLM DSA models. Use --kv-backend vllm."
        )
    if other:
        raise KVBackendError(
            f"--kv-backend ulacache serves pure DSA models; this one also has other KV layers "
            f"({sorted(other)[:3]}...). Use --kv-backend vllm."
        )
    block_sizes = {s.block_size for s in list(mla.values()) + list(idx.values())}
    if len(block_sizes) != 1:
        raise KVBackendError(f"ulacache needs one block size across layers, got {block_sizes}")
    bs = block_sizes.pop()
    tp_world = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
    S = tp_world if settings.tp_mode == "shard" else 1  # shards of the logical space
    if S > 1 and bs % S:
        raise KVBackendError(
            f"--ula-tp-mode shard needs block_size % tensor_parallel_size == 0 (token t lives on "
            f"rank t mod {S}, whole blocks per rank); block_size is {bs}. Pass --block-size "
            f"{bs * S} (or another multiple of {S}), or --ula-tp-mode replicate.")
    lbs = bs // S  # rows per block on one rank
    row = {n: s.page_size_bytes // s.block_size for n, s in mla.items()}
    M = sum(row.values())
    I = sum(s.page_size_bytes // s.block_size for s in idx.values())
    # Placeholder bytes per logical token (1 per layer vLLM keeps allocating a placeholder
    # for: the MLA layers; in shard mode the indexer layers too, whose keys the worker keeps).
    Lp = len(mla) + (len(idx) if S > 1 else 0)
    Ir = I if S == 1 else 0  # indexer keys vLLM allocates (per logical token)
    Il = I if S > 1 else 0  # indexer keys the worker allocates (per local token)
    host_slots = host_tokens_of(settings.host_pool_gib, M, lbs)
    max_model_len = vllm_config.model_config.max_model_len
    sched = vllm_config.scheduler_config
    topk = getattr(vllm_config.model_config.hf_text_config, "index_topk", 0) or 0
    seqs = max(1, getattr(sched, "max_num_seqs", 1) or 1)
    names = sorted(mla, key=_layer_index)
    leaders = [n for n in names if mla[n].is_index_group_leader] or names
    if names[0] not in leaders:
        leaders.insert(0, names[0])
    # Per rank and local token: placeholders of its P logical tokens' share, its indexer keys.
    per_local = S * (Lp + Ir) + Il
    extra = 0  # device bytes of the CUDA glue besides its pools (module doc)
    if S == 1 and cuda_glue_active():
        per_local += CLAIM_BYTES + MAPPING_BYTES * len(leaders)
        extra = cuda_extra_bytes(vllm_config, host_slots, bs, max(row.values()), len(mla),
                                 len(leaders), topk)
        available_bytes -= extra
    remote = 0
    if S > 1:
        budget_rows = max(0, available_bytes) // (per_local + M)
        remote = settings.remote_buffer_rows or max(lbs, min(seqs * topk, budget_rows // 32))
        remote = -(-remote // lbs) * lbs
    device_slots = ((available_bytes - host_slots * per_local - remote * M)
                    // (per_local + M)) // lbs * lbs
    check_host_capacity(settings.host_pool_gib, host_slots, M, len(mla), max_model_len, lbs, S)

    def need_of(batch: int) -> int:  # device rows one step needs on one rank
        return batch + topk if S == 1 else -(-batch // S) + seqs + -(-topk // S)

    need_device = need_of(sched.max_num_batched_tokens)
    lowered = None
    if (device_slots < need_device and sched.enable_chunked_prefill
            and batch_tokens_defaulted(vllm_config)):
        # With chunked prefill a step holds at most max_num_batched_tokens new tokens, so a
        # default that does not fit the device pool is lowered (never below max_num_seqs: a
        # decode step of every running request must fit) instead of refusing to start.
        fit = device_slots - topk if S == 1 else (device_slots - seqs - -(-topk // S)) * S
        if fit >= seqs:
            lowered = (sched.max_num_batched_tokens, fit)
            need_device = need_of(fit)
    if device_slots < need_device:
        # Device slots come in whole blocks: the suggested budget must give a block count
        # that covers the need, not just the need in bytes.
        need_bytes = (-(-need_device // lbs) * lbs * (per_local + M) + host_slots * per_local
                      + remote * M + extra)
        if sched.enable_chunked_prefill:
            batch_fix = ", lower --max-num-batched-tokens,"
        else:  # vLLM's CPU build runs MLA without chunked prefill and fixes the batch size
            batch_fix = (f" (max_num_batched_tokens is fixed at {sched.max_num_batched_tokens} "
                         "here: chunked prefill is off for MLA on this platform)")
        share = "" if S == 1 else f" on each of {S} TP ranks (its share of the step)"
        raise KVBackendError(
            f"ulacache device pool too small: the KV budget of {available_bytes + extra} bytes"
            f"{f' ({extra} of them for the CUDA staging area and buffers)' if extra else ''} leaves "
            f"{max(device_slots, 0)} device slots after indexer keys for {host_slots} host "
            f"tokens, but one step needs up to {need_device}{share} (max_num_batched_tokens "
            f"{sched.max_num_batched_tokens} + index_topk {topk}). Raise the KV budget "
            f"(--kv-cache-memory-bytes / --gpu-memory-utilization) to at least {need_bytes} "
            f"bytes{batch_fix} or shrink --ula-host-pool-gib."
        )
    num_logical = (device_slots + host_slots) * S
    first = mla[names[0]]
    return UlaLayout(
        block_size=bs,
        device_slots=device_slots,
        host_slots=host_slots,
        num_logical=num_logical,
        num_blocks=num_logical // bs + 1,
        mla_layers=names,
        leaders=leaders,
        mla_row_bytes=row,
        mla_head_size=first.head_size,
        mla_dtype=_dtype_name(first.dtype),
        indexer_bytes_per_token=I,
        batch_tokens_lowered=lowered,
        tp_mode=settings.tp_mode if tp_world > 1 else "replicate",
        tp_world=tp_world,
        remote_slots=remote,
        indexer_layers={n: s.page_size_bytes // s.block_size
                        for n, s in sorted(idx.items(), key=lambda kv: _layer_index(kv[0]))},
    )


def cuda_extra_bytes(vllm_config, host_slots: int, block_size: int, row_bytes: int,
                     layers: int, groups: int, topk: int) -> int:
    """`cuda.device_extra_bytes` at the staging rows the CUDA worker will allocate."""
    try:
        staging = cuda_staging_rows(cuda_decode_tokens(vllm_config), topk, host_slots,
                                    block_size)
    except RuntimeError as e:  # no index_topk, or a staging setting below one token's
        raise KVBackendError(str(e)) from None
    return cuda_device_extra_bytes(staging, row_bytes, layers, groups,
                                   vllm_config.scheduler_config.max_num_batched_tokens)


# `additional_config` key listing the scheduler settings the user left to vLLM's defaults
# (written by `wiring.prepare_engine_args` in the front end, read here in the engine core).
DEFAULTED_KEY = "ulacache_defaulted"


def batch_tokens_defaulted(vllm_config) -> bool:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return "max_num_batched_tokens" in (extra.get(DEFAULTED_KEY) or ())


def apply_batch_tokens(vllm_config, layout: UlaLayout) -> None:
    """Engine core, before the scheduler is built: lower the step's token budget to what the
    layout fits (the worker's buffers, sized for the larger default, stay valid)."""
    if not layout.batch_tokens_lowered:
        return
    _, new = layout.batch_tokens_lowered
    sc = vllm_config.scheduler_config
    sc.max_num_batched_tokens = new
    if sc.max_num_scheduled_tokens is not None:
        sc.max_num_scheduled_tokens = min(sc.max_num_scheduled_tokens, new)


def get_kv_cache_configs(orig, vllm_config, kv_cache_specs: list[dict], available_memory: list[int],
                         settings: UlaSettings):
    """ulacache's replacement for vLLM's `get_kv_cache_configs` (same signature + `orig`)."""
    with reported_to_front_end():
        layouts = [plan_layout(vllm_config, s, a, settings)
                   for s, a in zip(kv_cache_specs, available_memory)]
    layout = min(layouts, key=lambda l: l.num_blocks)
    # The step budget every worker can hold: the smallest lowered value, if any was lowered.
    lowered = [l.batch_tokens_lowered for l in layouts if l.batch_tokens_lowered]
    if lowered:
        layout = dataclasses.replace(layout, batch_tokens_lowered=min(lowered, key=lambda x: x[1]))
    apply_batch_tokens(vllm_config, layout)
    new_specs = []
    for specs in kv_cache_specs:
        mla, idx, _ = split_specs(specs)
        if layout.shards > 1:  # the worker keeps each rank's share of the indexer keys
            idx = {n: placeholder_spec(s) for n, s in idx.items()}
        new_specs.append({**idx, **{n: placeholder_spec(s) for n, s in mla.items()}})
    bytes_per_block = sum(s.page_size_bytes for s in new_specs[0].values())
    budget = [layout.num_blocks * bytes_per_block] * len(new_specs)
    configs = orig(vllm_config, new_specs, budget)
    for cfg in configs:
        if cfg.num_blocks != layout.num_blocks:
            raise RuntimeError(
                f"ulacache: vLLM sized {cfg.num_blocks} blocks, expected {layout.num_blocks}"
            )
    return [UlaKVCacheConfig.of(cfg, layout) for cfg in configs]


def prepare_engine_args(engine_args: Any) -> None:
    """Before vLLM builds its configuration: nothing to change. Prefix caching is vLLM's own
    over the logical pool (a hit's rows are read from either tier, `dsa.manager`), on or off as
    vLLM or the user chose (the CPU sparse-MLA backend takes it on every host)."""
    return None


def prepare(vllm_config: Any, settings: UlaSettings) -> None:
    """Front end (before any engine process starts): what this line refuses, named with the
    fix, and whether one request fits the host pool."""
    check_tp_mode(vllm_config, settings)
    check_host_pool(vllm_config, settings)


def shards_of(vllm_config: Any, settings: UlaSettings) -> int:
    """Ranks the logical space is split over: the TP size in shard mode, else 1."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    return tp if settings.tp_mode == "shard" and tp > 1 else 1


def check_tp_mode(vllm_config: Any, settings: UlaSettings) -> None:
    """What TP shard mode does not support yet is refused here, before any engine starts."""
    if shards_of(vllm_config, settings) == 1:
        return
    pc = vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    fix = "; use --ula-tp-mode replicate (every rank holds every row) for this setup."
    if pc.pipeline_parallel_size > 1:
        raise KVBackendError(f"--ula-tp-mode shard (tensor_parallel_size {tp}) does not "
                             f"support pipeline parallelism (pipeline_parallel_size "
                             f"{pc.pipeline_parallel_size}) yet{fix}")
    refuse_context_parallel(pc, "--ula-tp-mode shard",
                             f" (vLLM's context parallelism shards the KV itself){fix}")
    bs = getattr(vllm_config.cache_config, "block_size", None)
    if bs and bs % tp:
        raise KVBackendError(
            f"--ula-tp-mode shard needs block_size % tensor_parallel_size == 0 (token t lives "
            f"on rank t mod {tp}); block_size is {bs}. Pass --block-size {bs * tp} (or another "
            f"multiple of {tp}){fix}")


def check_host_pool(vllm_config: Any, settings: UlaSettings) -> None:
    """Fails in the front end (before any engine process starts) when the host pool cannot
    hold one request of max_model_len; the engine core re-checks with the exact layer specs."""
    import torch


    mc = vllm_config.model_config
    text = mc.hf_text_config
    head = getattr(text, "kv_lora_rank", 0) + getattr(text, "qk_rope_head_dim", 0)
    layers = mc.get_num_layers(vllm_config.parallel_config) + _draft_kv_layers(vllm_config)
    dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else torch.bfloat16
    per_token = layers * head * torch.empty((), dtype=dtype).element_size()
    if per_token <= 0:
        return
    # Whole blocks, as the engine core counts them (the block size may still change there; it
    # checks again with its own).
    bs = getattr(vllm_config.cache_config, "block_size", None) or 1
    shards = shards_of(vllm_config, settings)
    host_tokens = host_tokens_of(settings.host_pool_gib, per_token, max(1, bs // shards))
    check_host_capacity(settings.host_pool_gib, host_tokens, per_token, layers, mc.max_model_len,
                        max(1, bs // shards), shards)


def _draft_kv_layers(vllm_config: Any) -> int:
    """KV layers a speculative draft adds (an MTP module of a DSA model keeps sparse-MLA rows
    like the target's layers); 0 without a draft model (e.g. n-gram speculation)."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is None or draft is vllm_config.model_config:
        return 0
    n = getattr(draft.hf_text_config, "num_nextn_predict_layers", None)
    if getattr(spec, "method", None) in ("mtp", "deepseek_mtp") and n:
        return int(n)
    return draft.get_num_layers(vllm_config.parallel_config)
