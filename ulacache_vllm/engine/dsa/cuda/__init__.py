"""The DSA line on vLLM's CUDA build: EXPERIMENTAL, behind an explicit opt-in, never run on a GPU.

Without ``ULACACHE_EXPERIMENTAL_CUDA=1`` in the environment, ``--kv-backend ulacache`` on a
non-CPU platform is refused with ``CUDA_REFUSAL`` (wiring.finalize_vllm_config). With it, the
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

from ...config import KVBackendError

OPT_IN_ENV = "ULACACHE_EXPERIMENTAL_CUDA"

# Today's refusal, unchanged, plus how to opt in (wiring.finalize_vllm_config raises it).
CUDA_REFUSAL = (
    "--kv-backend ulacache currently runs on vLLM's CPU build only: its translation "
    "hook (SparseMLAIndexGroup.convert_logical_to_physical_topk) is not wired into the "
    "CUDA sparse-MLA backends yet. Use --kv-backend vllm on this machine.")


def experimental_cuda_enabled() -> bool:
    """True only for an explicit ``ULACACHE_EXPERIMENTAL_CUDA=1`` (anything else: refused)."""
    return os.environ.get(OPT_IN_ENV, "").strip() == "1"


def check_cuda_config(vllm_config: Any) -> None:
    """Refuses what the experimental CUDA glue does not cover, each error naming the fix, and
    sets what it needs (MQA prefill through the sparse path). Runs in the front end after
    VllmConfig is built (no device needed)."""
    pc = vllm_config.parallel_config
    who = "--kv-backend ulacache on CUDA (experimental)"
    if (getattr(pc, "decode_context_parallel_size", 1) or 1) > 1:
        raise KVBackendError(
            f"{who} does not support decode context parallelism (DCP, "
            f"--decode-context-parallel-size {pc.decode_context_parallel_size}): the staged "
            f"rows are not sharded across DCP ranks. Drop --decode-context-parallel-size (use "
            f"--tensor-parallel-size alone) or use --kv-backend vllm.")
    if (getattr(pc, "prefill_context_parallel_size", 1) or 1) > 1:
        raise KVBackendError(
            f"{who} does not support prefill context parallelism (PCP, "
            f"--prefill-context-parallel-size {pc.prefill_context_parallel_size}): PCP writes "
            f"through do_kv_cache_update, which bypasses ulacache's write translation. Drop "
            f"--prefill-context-parallel-size or use --kv-backend vllm.")
    if (getattr(pc, "pipeline_parallel_size", 1) or 1) > 1:
        raise KVBackendError(
            f"{who} does not support pipeline parallelism (--pipeline-parallel-size "
            f"{pc.pipeline_parallel_size}): the worker store's step contract is per whole "
            f"model. Use --tensor-parallel-size instead, or --kv-backend vllm.")
    dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if dtype.startswith("nvfp4"):
        raise KVBackendError(
            f"{who} does not support --kv-cache-dtype {dtype}: its 352-byte rows and SM100 "
            f"page rules are not covered by the resolve/stage path. Use --kv-cache-dtype fp8 "
            f"(fp8_ds_mla, 656 B rows) or auto (bf16), or --kv-backend vllm.")
    from vllm.config.compilation import CUDAGraphMode

    cc = vllm_config.compilation_config
    mode = getattr(cc, "cudagraph_mode", None)
    if mode == CUDAGraphMode.FULL:
        raise KVBackendError(
            f"{who} does not support cudagraph_mode FULL: mixed and prefill batches would be "
            f"captured whole, while their staged rows are bounded only for decode graphs. Use "
            f"-cc.cudagraph_mode=FULL_AND_PIECEWISE (vLLM's default), PIECEWISE, "
            f"FULL_DECODE_ONLY or --enforce-eager.")
    ac = vllm_config.attention_config
    if getattr(ac, "hisparse_config", None) is not None:
        raise KVBackendError(
            f"{who} cannot be combined with vLLM's HiSparse host cache (attention_config."
            f"hisparse_config): both own the host tier. Drop the HiSparse setting.")
    # Dense-MHA prefill gathers whole contexts through the logical block table (the rows are
    # not there under ulacache): every token goes through the sparse MQA path instead.
    ac.sparse_mla_force_mqa = True
