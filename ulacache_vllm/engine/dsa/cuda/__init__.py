"""The DSA line on vLLM's CUDA build: EXPERIMENTAL, behind an explicit opt-in, never run on a GPU.

Without ``ULACACHE_EXPERIMENTAL_CUDA=1`` in the environment, ``--kv-backend ulacache`` on a
non-CPU platform is refused with ``CUDA_REFUSAL`` (`Line.check_platform`). With it, the
configuration is checked here (``check_cuda_config``: DCP, PCP, PP, nvfp4_ds_mla and the
FULL-only graph mode are refused, each naming the fix; dense-MHA prefill is turned off so every
token reads through the sparse path) and vLLM's FlashMLA-sparse backend is replaced by
``backend.UlaFlashMLASparseBackend`` (patches/cuda_sparse_backend.py), whose forward runs stock's
logical conversion, then ulacache's resolve / stage kernels (``kernels.resolve_impl``), then
stock's FlashMLA kernels over ``[staging | device pool]`` rows (``runtime.CudaRows``).

What is verified: the glue against vLLM 0.32.0's real backend classes on the CPU build with the
compiled kernels replaced by torch references over the same bytes (tests/test_cuda_glue.py).
What is not: anything on a GPU (scripts/cuda_e2e_check.py is the check a GPU owner runs).
Nothing in this package needs CUDA to import.
"""
from __future__ import annotations

import os
from typing import Any

from ...config import EXPERIMENTAL_CUDA_ENV as OPT_IN_ENV
from ...config import KVBackendError, experimental_cuda_enabled

__all__ = ["CUDA_REFUSAL", "OPT_IN_ENV", "check_cuda_config", "experimental_cuda_enabled"]

# The DSA line's refusal on a non-CPU platform without the opt-in (`Line.check_platform`).
CUDA_REFUSAL = (
    "--kv-backend ulacache currently runs on vLLM's CPU build only: its translation "
    "hook (SparseMLAIndexGroup.convert_logical_to_physical_topk) is not wired into the "
    "CUDA sparse-MLA backends, except by EXPERIMENTAL glue for DSA models that has never "
    f"run on a GPU (opt in with {OPT_IN_ENV}=1 in the environment to try it). Use "
    "--kv-backend vllm on this machine.")


def _refusals(vllm_config: Any) -> list[tuple[bool, str, str]]:
    """``(refused, problem, fix)`` for each configuration the glue does not cover."""
    pc = vllm_config.parallel_config
    dcp = getattr(pc, "decode_context_parallel_size", 1) or 1
    pcp = getattr(pc, "prefill_context_parallel_size", 1) or 1
    pp = getattr(pc, "pipeline_parallel_size", 1) or 1
    dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    from vllm.config.compilation import CUDAGraphMode

    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    hisparse = getattr(vllm_config.attention_config, "hisparse_config", None)
    return [
        (dcp > 1,
         f"does not support decode context parallelism (DCP, --decode-context-parallel-size "
         f"{dcp}): the staged rows are not sharded across DCP ranks",
         "Drop --decode-context-parallel-size (use --tensor-parallel-size alone) or use "
         "--kv-backend vllm."),
        (pcp > 1,
         f"does not support prefill context parallelism (PCP, --prefill-context-parallel-size "
         f"{pcp}): PCP writes through do_kv_cache_update, which bypasses ulacache's write "
         "translation",
         "Drop --prefill-context-parallel-size or use --kv-backend vllm."),
        (pp > 1,
         f"does not support pipeline parallelism (--pipeline-parallel-size {pp}): the worker "
         "store's step contract is per whole model",
         "Use --tensor-parallel-size instead, or --kv-backend vllm."),
        (dtype.startswith("nvfp4"),
         f"does not support --kv-cache-dtype {dtype}: its 352-byte rows and SM100 page rules "
         "are not covered by the resolve/stage path",
         "Use --kv-cache-dtype fp8 (fp8_ds_mla, 656 B rows) or auto (bf16), or --kv-backend "
         "vllm."),
        (mode == CUDAGraphMode.FULL,
         "does not support cudagraph_mode FULL: mixed and prefill batches would be captured "
         "whole, while their staged rows are bounded only for decode graphs",
         "Use -cc.cudagraph_mode=FULL_AND_PIECEWISE (vLLM's default), PIECEWISE, "
         "FULL_DECODE_ONLY or --enforce-eager."),
        (hisparse is not None,
         "cannot be combined with vLLM's HiSparse host cache (attention_config."
         "hisparse_config): both own the host tier",
         "Drop the HiSparse setting."),
    ]


def check_cuda_config(vllm_config: Any) -> None:
    """Refuses what the experimental CUDA glue does not cover (`_refusals`, first match), each
    error naming the problem and the fix, and sets what it needs (MQA prefill through the
    sparse path). Runs in the front end after VllmConfig is built (no device needed)."""
    for refused, problem, fix in _refusals(vllm_config):
        if refused:
            raise KVBackendError(f"--kv-backend ulacache on CUDA (experimental) {problem}. {fix}")
    # Dense-MHA prefill gathers whole contexts through the logical block table (the rows are
    # not there under ulacache): every token goes through the sparse MQA path instead.
    vllm_config.attention_config.sparse_mla_force_mqa = True


# ------------------------------------------------------------------- device sizing
# Shared by the worker (what it allocates) and dsa/sizing.py (what the KV budget leaves for
# the device pools), so the two agree by construction.
STAGING_ENV = "ULACACHE_CUDA_STAGING_ROWS"
CLAIM_BYTES = 12  # per logical address: the Triton resolve's claim table (int64 + int32)
# Per logical address and layer group: the group's TieredMapping on the device (loc, visible,
# the unique-address claims: 3 x int64; the device and host slot pools' stacks and owners,
# 2 x int64 per slot, slots = logical addresses) and its eviction policy's tables (at most 16 B
# per device slot: PB-LRU labels int16, the timestamp scan's stamps and index range; counted per
# logical address: an upper bound).
MAPPING_BYTES = 56
ACC_ROWS = 1 << 16  # per layer group: addresses of a chunked call's earlier chunks (runtime)


def cuda_glue_active() -> bool:
    """True where the worker will build the CUDA glue (a non-CPU platform;
    `Line.check_platform` refuses one without the opt-in before sizing runs)."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def decode_tokens(vllm_config: Any) -> int:
    """Query tokens of the largest decode step: max_num_seqs x (1 + speculative tokens),
    at most max_num_batched_tokens."""
    sched = vllm_config.scheduler_config
    seqs = max(1, getattr(sched, "max_num_seqs", 1) or 1)
    spec = getattr(vllm_config, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    return max(1, min(seqs * (1 + k), sched.max_num_batched_tokens))


def staging_rows(decode_toks: int, topk: int, host_rows: int, block_size: int) -> int:
    """Staging rows, in whole blocks. Default: a decode step's worst case, min(decode tokens x
    top-k, host rows) (larger calls run in token chunks). ``ULACACHE_CUDA_STAGING_ROWS``
    replaces it; below one token's worth, min(top-k, host rows), no chunk fits: refused."""
    if topk <= 0:
        raise RuntimeError(
            "ulacache (CUDA, experimental): the model config has no index_topk, so the staging "
            "area has no bound (tokens x top-k); only DSA models with index_topk are covered. "
            "Use --kv-backend vllm.")
    host_rows = max(1, host_rows)
    floor = min(topk, host_rows)
    n = min(decode_toks * topk, host_rows)
    env = os.environ.get(STAGING_ENV, "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < floor:
            raise RuntimeError(
                f"ulacache (CUDA, experimental): {STAGING_ENV}={env} is below the staging "
                f"bound of {floor} rows (one token's selections: min(index_topk {topk}, host "
                f"pool rows {host_rows})): no token chunk would fit, and an overflow would "
                f"read nothing (wrong attention). Unset {STAGING_ENV} (the default is a decode "
                f"step's min({decode_toks} tokens x {topk}, {host_rows}) rows) or set it to at "
                f"least {floor}.")
    return -(-n // block_size) * block_size


def device_extra_bytes(staging: int, row_bytes: int, layers: int, groups: int,
                       max_tokens: int) -> int:
    """Device bytes `runtime.CudaRows` allocates besides the device pools and the claim table
    (`CLAIM_BYTES` per logical address): staging rows, miss logs (one per group leader, one
    shared by the other layers, the resolve state's: 16 B per staging row each), the per-group
    carry accumulators, the static write-slot buffers (int64 per batch token per layer) and the
    staging index range."""
    logs = groups + (1 if layers > groups else 0) + 1
    acc = groups * (8 * (min(staging, ACC_ROWS) + 1) + 24)
    return (staging * row_bytes + logs * (16 * staging + 8) + acc
            + layers * 8 * max_tokens + 8 * staging)
