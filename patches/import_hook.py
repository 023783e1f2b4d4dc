"""Post-import hook: applies the `LLM.__init__` patch the moment `vllm.entrypoints.llm` loads.

`LLM(model, kv_backend=...)` runs before vLLM loads its general plugins (that happens inside
`EngineArgs.__post_init__`), so the keyword must be accepted earlier. A one-line `.pth` file
written by the install step imports this module at interpreter start; it only registers a
meta-path finder (no vLLM or torch import) and patches after vLLM's own module body ran.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "vllm.entrypoints.llm"


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            try:
                from ulacache_vllm.patches import llm_kwargs

                llm_kwargs.apply()
            except Exception as e:  # never break `import vllm`; plugin load retries loudly
                print(f"[ulacache] could not patch LLM kwargs at import: {e}", file=sys.stderr)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


install()
