"""Lab only (``benchmarks/lab/v4_ops``): imported by every Python process started with this
folder on PYTHONPATH. With ``ULACACHE_LAB_V4_OPS=1`` it defines the emulated V4 ops and makes
ulacache's AVX512-BF16 probe (``patches/v4_cpu_isa.host_has_avx512_bf16``) answer yes once
that module loads, so V4 engines start on an AVX2 host. Without the variable: nothing."""
import os
import sys

if os.environ.get("ULACACHE_LAB_V4_OPS") == "1":
    import importlib.abc
    import importlib.util

    _here = os.path.dirname(os.path.abspath(__file__))
    _bench = os.path.dirname(os.path.dirname(os.path.dirname(_here)))  # benchmarks/
    if _bench not in sys.path:
        sys.path.append(_bench)
    from lab.v4_ops import install

    install()

    _PROBES = ("ulacache_vllm.patches.v4_cpu_isa",)

    class _ProbeFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _PROBES:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            orig = spec.loader.exec_module

            def exec_module(module, _orig=orig):
                _orig(module)
                module.host_has_avx512_bf16 = lambda: True

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _ProbeFinder())
