"""Post-import hook: applies the front-end patches the moment their vLLM modules load.

vLLM loads its general plugins inside `EngineArgs.__post_init__`, which is too late for the
front-end paths: `EngineArgs(model, kv_backend=...)` / `AsyncEngineArgs(...)` and
`LLM(model, kv_backend=...)` (the keywords must be accepted by `__init__`, before
`__post_init__` runs), and the API-server processes of `vllm serve --api-server-count N` /
`--data-parallel-size N`, which rebuild their engine arguments with
`EngineArgs.from_cli_args(args)` before any plugin ran (without the patch they would drop
`--kv-backend` and build a stock config, e.g. without the ulacache metrics). A one-line `.pth`
file written by the install step (`scripts/install_hooks.py`) imports this module at
interpreter start; it only registers a meta-path finder (no vLLM or torch import) and patches
after vLLM's own module body ran. Every patch is idempotent, so the plugin's later
`apply_all()` changes nothing.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

TARGETS = {
    "vllm.entrypoints.llm": ("llm_kwargs",),
    "vllm.engine.arg_utils": ("engine_args", "cli_args", "engine_config"),
}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        hooks = TARGETS.get(fullname)
        if hooks is None:
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
            for hook in hooks:
                try:
                    importlib.import_module(f"ulacache_vllm.patches.{hook}").apply()
                except Exception as e:  # never break `import vllm`; plugin load retries loudly
                    print(f"[ulacache] could not apply patch {hook} at import: {e}",
                          file=sys.stderr)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


install()
