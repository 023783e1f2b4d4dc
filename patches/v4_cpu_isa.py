"""Hook: `CpuPlatform.apply_config_platform_defaults` (platforms/interface.py, not overridden by
the CPU platform), called while every `VllmConfig` is built, in the front end first.

DeepSeek-V4's CPU path (models/deepseek_v4/cpu/) runs on kernels that exist only in vLLM's
`_C.abi3.so` (flash_mla_with_kvcache_cpu, fp8_paged_mqa_logits_cpu, the compressor, mHC and
router ops), and vLLM loads that library only on x86 CPUs with AVX512-BF16
(`CpuPlatform.import_kernels`); elsewhere it loads `_C_AVX512`/`_C_AVX2`, which have none of
them, and V4 fails deep inside its first op. Its kernels also take bfloat16 queries only. Here a
V4 model on such a host, or with another dtype, is refused while the config is built, with a
message naming the requirement. Everything else passes through untouched.
"""
from __future__ import annotations

from ._hook import replace, resolve

HOOK = "v4_cpu_isa"
MODULE = "vllm.platforms.cpu"
V4_MODEL_TYPES = ("deepseek_v4",)


class DeepseekV4CpuError(ValueError):
    """DeepSeek-V4 cannot run on this CPU or with these settings: the message says why."""


def host_has_avx512_bf16() -> bool:
    """The probe vLLM's CPU platform uses to pick `_C.abi3.so` (the library with V4's ops)."""
    import torch

    return bool(torch.cpu._is_avx512_supported()) and bool(torch.cpu._is_avx512_bf16_supported())


def is_deepseek_v4(model_config) -> bool:
    hf = getattr(model_config, "hf_config", None)
    return getattr(hf, "model_type", None) in V4_MODEL_TYPES


def check_deepseek_v4_host(model_config) -> None:
    """Raises DeepseekV4CpuError if `model_config` is DeepSeek-V4 and this CPU or its dtype
    cannot run V4's CPU kernels."""
    if model_config is None or not is_deepseek_v4(model_config):
        return
    import torch

    from vllm.platforms import CpuArchEnum, current_platform

    if current_platform.get_cpu_architecture() == CpuArchEnum.X86 and not host_has_avx512_bf16():
        raise DeepseekV4CpuError(
            "DeepSeek-V4 on vLLM's CPU build needs a CPU with AVX512-BF16 (avx512_bf16: Intel "
            "Cooper Lake / Sapphire Rapids or newer, AMD Zen 4 or newer): its attention, "
            "indexer, compressor and router kernels exist only in vLLM's _C library, which "
            "vLLM loads only on such CPUs. This CPU lacks avx512_bf16 (see /proc/cpuinfo); AMX "
            "is not required.")
    if getattr(model_config, "dtype", torch.bfloat16) != torch.bfloat16:
        raise DeepseekV4CpuError(
            f"DeepSeek-V4 on vLLM's CPU build runs in bfloat16 only (its CPU attention kernel "
            f"takes bf16 queries); got dtype={model_config.dtype}. Use dtype='bfloat16' (or "
            f"'auto' with a bfloat16 checkpoint).")


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    _, cur = resolve(MODULE, "CpuPlatform.apply_config_platform_defaults", HOOK)
    if getattr(cur, "__ulacache_patch__", None) == HOOK:
        return
    orig = cur.__func__

    def apply_config_platform_defaults(cls, vllm_config) -> None:
        check_deepseek_v4_host(getattr(vllm_config, "model_config", None))
        orig(cls, vllm_config)

    replace(MODULE, "CpuPlatform.apply_config_platform_defaults",
            classmethod(apply_config_platform_defaults), HOOK)
