"""Lab only (``benchmarks/lab/v4_ops``): imported by every Python process started with this
folder on PYTHONPATH. With ``ULACACHE_LAB_V4_OPS=1`` it defines the emulated V4 ops and makes
ulacache's AVX512-BF16 probe (``patches/v4_cpu_isa.host_has_avx512_bf16``) answer yes once
that module loads, so V4 engines start on an AVX2 host (on a host with the real kernels it
does nothing). With ``ULACACHE_LAB_AMX_SCHEDULE=1``
as well, vLLM's CPU platform configures a DeepSeek-V4 model as on a host with AMX tiles
(chunked prefill and prefix caching kept, as ``CpuPlatform.check_and_update_config`` does
there): only while that method runs for a V4 config, so no AMX kernel is ever picked.
Without the variables: nothing."""
import os
import sys

def _host_has_the_kernels() -> bool:
    # Where vLLM loads its `_C` (AVX512-BF16), the real kernels exist: defining them from Python
    # first would make that library's registration abort the process. Nothing to do there.
    import torch

    return bool(torch.cpu._is_avx512_supported()) and bool(torch.cpu._is_avx512_bf16_supported())


if os.environ.get("ULACACHE_LAB_V4_OPS") == "1" and not _host_has_the_kernels():
    import importlib.abc
    import importlib.util

    _here = os.path.dirname(os.path.abspath(__file__))
    _bench = os.path.dirname(os.path.dirname(os.path.dirname(_here)))  # benchmarks/
    if _bench not in sys.path:
        sys.path.append(_bench)
    from lab.v4_ops import install

    install()

    def _probe_says_yes(module):
        module.host_has_avx512_bf16 = lambda: True

    def _amx_schedule_for_v4(module):
        import torch

        cls = module.CpuPlatform
        orig = cls.check_and_update_config.__func__

        def check_and_update_config(cls_, vllm_config):
            hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
            if getattr(hf, "model_type", None) != "deepseek_v4":
                return orig(cls_, vllm_config)
            probe = torch.cpu._is_amx_tile_supported
            torch.cpu._is_amx_tile_supported = lambda: True
            try:
                return orig(cls_, vllm_config)
            finally:
                torch.cpu._is_amx_tile_supported = probe

        cls.check_and_update_config = classmethod(check_and_update_config)

    _AFTER = {"ulacache_vllm.patches.v4_cpu_isa": _probe_says_yes}
    if os.environ.get("ULACACHE_LAB_AMX_SCHEDULE") == "1":
        _AFTER["vllm.platforms.cpu"] = _amx_schedule_for_v4

    class _AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _AFTER:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            orig = spec.loader.exec_module

            def exec_module(module, _orig=orig, _then=_AFTER[name]):
                _orig(module)
                _then(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterImport())
    for _name, _then in _AFTER.items():  # (none is imported this early today)
        if _name in sys.modules:
            _then(sys.modules[_name])
